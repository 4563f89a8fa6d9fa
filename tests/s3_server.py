"""A real S3 API for the tests: moto's standalone server on a free port of 127.0.0.1, with one
bucket, ``hookscope``, and fake credentials (``KEY``, ``SECRET``) in the environment while a test
module uses it. ``tests/conftest.py`` makes ``s3_endpoint`` a fixture of every test file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

__all__ = ["KEY", "SECRET", "s3_endpoint"]

KEY, SECRET = "hookscope-test-key", "hookscope-test-secret-do-not-store"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """The server's URL (``http://127.0.0.1:PORT``, for ``client_kwargs={"endpoint_url": ...}``),
    serving the module's tests; ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` are set meanwhile."""
    import fsspec.core
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AWS_ACCESS_KEY_ID", KEY)
            patch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
            patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
            fs, _ = fsspec.core.url_to_fs("s3://hookscope",
                                          client_kwargs={"endpoint_url": endpoint})
            if not fs.exists("hookscope"):  # moto keeps its buckets per process, not per server
                fs.mkdir("hookscope")
            yield endpoint
    finally:
        server.stop()
