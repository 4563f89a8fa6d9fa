"""Private: what an object store's failures become (``StoreFaultError``), and the bounded
retries of the faults that pass.

Every request ``hookscope.store.fs`` makes to a remote file system goes through ``guarded``:

- a transient fault (the connection refused, reset or dropped mid-body, a timeout, a 500/503
  or ``SlowDown``) is tried again, ``ATTEMPTS`` times in all, waiting ``BACKOFF_S`` seconds
  before the second try and twice as long before each next one (0.25 + 0.5 + 1 + 2 s: under
  4 s of waiting), on top of the client's own retries (s3fs and botocore retry too, so one
  try at a dead endpoint takes about 5 s with their defaults): no new try starts once
  ``BUDGET_S`` (15 s) have passed since the first;
- ``FileNotFoundError`` is an answer, not a fault: it is raised as it is (a missing manifest,
  a shard a crash never wrote) and the caller decides;
- anything else (refused credentials, a missing bucket, a bad request, or a transient fault
  that outlived its tries) becomes a ``StoreFaultError`` naming the store's URL, the endpoint
  asked, the fault, how many times it was tried over how long, and what to check.

The endpoint is the one the file system was given (``storage_options``: ``client_kwargs=
{"endpoint_url": ...}`` or ``endpoint_url``), else ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``
from the environment, else the service's default. Credentials are never part of a message.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hookscope.errors import StoreFaultError

__all__ = ["ATTEMPTS", "BACKOFF_S", "endpoint_of", "guarded", "is_transient"]

T = TypeVar("T")

ATTEMPTS = 5  # tries of one request whose fault is transient, the first included
BACKOFF_S = 0.25  # wait before the second try; doubled before each next one
BUDGET_S = 15.0  # no new try once this long has passed since the first (the client retries too)

# class names (anywhere in the error's MRO) of the faults that pass: botocore's and aiohttp's
_TRANSIENT_NAMES = frozenset({
    "ConnectionError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "ClientPayloadError",
    "ClientConnectionError", "ServerDisconnectedError", "ClientOSError", "HTTPClientError",
    "ProxyConnectionError", "TimeoutError",
})
_TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                               errno.EPIPE, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                               errno.ENETUNREACH})
_TRANSIENT_WORDS = ("Service Unavailable", "SlowDown", "InternalError", "Internal Server Error",
                    "ServiceUnavailable", "RequestTimeout", "Connection reset",
                    "Server disconnected", "Response payload is not completed")


def is_transient(err: BaseException) -> bool:
    """True for a fault that may pass if the request is sent again (see the module docstring)."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, FileExistsError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    if {c.__name__ for c in type(err).__mro__} & _TRANSIENT_NAMES:
        return True
    if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
        return True
    return any(word in str(err) for word in _TRANSIENT_WORDS)


def endpoint_of(fs: Any) -> str:
    """The endpoint ``fs`` sends its requests to, in words (no credentials): an ``http``
    URL for S3, else the file system's default. A connected client's own endpoint comes first:
    fsspec caches file systems per process, so an instance made under another
    ``AWS_ENDPOINT_URL`` keeps talking to that one, and the message must name it."""
    client = getattr(fs, "_s3", None)  # s3fs's botocore client, once connected
    kwargs = getattr(fs, "client_kwargs", None) or {}
    found = getattr(getattr(client, "meta", None), "endpoint_url", None) or \
        (kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None) or \
        getattr(fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or \
        os.environ.get("AWS_ENDPOINT_URL")
    if found:
        return str(found)
    if "s3" in str(getattr(fs, "protocol", "")):
        return "https://s3.amazonaws.com (AWS's default: no endpoint_url given)"
    protocol = getattr(fs, "protocol", "?")
    protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
    return f"the default endpoint of {protocol}:// (no endpoint_url given)"


def guarded(fs: Any, url: str, what: str, call: Callable[[], T]) -> T:
    """Return ``call()``, a request to ``fs`` about ``url`` (``what``: "read", "write"...),
    trying a transient fault again (``ATTEMPTS`` tries with doubling waits, within
    ``BUDGET_S``).

    Raises:
        FileNotFoundError: the object is not there (as ``call`` raised it).
        StoreFaultError: any other fault, or a transient one on every try.
    """
    began, wait = time.monotonic(), BACKOFF_S
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001  (every fault of the client becomes one error)
            late = time.monotonic() - began + wait > BUDGET_S
            if attempt < ATTEMPTS and is_transient(err) and not late:
                time.sleep(wait)
                wait *= 2
                continue
            raise fault(fs, url, what, err, attempt, time.monotonic() - began) from err
    raise AssertionError("unreachable")  # the loop returns or raises


def fault(fs: Any, url: str, what: str, err: BaseException, tries: int,
          seconds: float) -> StoreFaultError:
    """The ``StoreFaultError`` for ``err``, met ``tries`` times over ``seconds`` (module
    docstring)."""
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    text = " ".join(str(err).split())[:300] or "no message"
    tried = (f"tried {tries} times over {seconds:.1f} s (transient faults are retried with "
             f"backoff)" if tries > 1 else "not retried: it is not a transient fault")
    check = _what_to_check(err, bucket, endpoint_of(fs).startswith("http"))
    return StoreFaultError(
        f"cannot {what} {url}: the object store at {endpoint_of(fs)} answered "
        f"{type(err).__name__}: {text}; {tried}. {check}")


def _what_to_check(err: BaseException, bucket: str, s3: bool) -> str:
    if not s3:
        return "Check that the store is reachable from here and that it may be written."
    if isinstance(err, PermissionError):
        return ("The credentials were refused: check the key and secret (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY in the environment, or storage_options key=/secret=; "
                "the CLI reads the environment) and that they may read and write bucket "
                f"{bucket!r}.")
    return (f"Check that the endpoint is up and reachable from here (storage_options "
            f"client_kwargs={{'endpoint_url': ...}}, or AWS_ENDPOINT_URL in the environment), "
            f"the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), and that bucket "
            f"{bucket!r} exists.")
