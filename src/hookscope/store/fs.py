"""Private: where a store's files live, and the few file operations that differ by place.

A store is a local folder (a ``pathlib.Path``: memory-mapped reads, ``flock``, write to a
temporary name then rename, as ``hookscope.util.files`` does) or any fsspec URL (``s3://``,
``gs://``, ``memory://``; a ``RemotePath``). This is the only module that imports fsspec, and
only when a URL other than ``file://`` is opened, so ``import hookscope`` never imports it.

An object store has no rename, no lock and no memory map; the store keeps its guarantees
without them:

- a file is uploaded whole, in one PUT (``pipe_file``): the object store makes it visible only
  once every byte has arrived, so no reader ever sees half a shard or half a manifest. The
  writer still finishes a shard (its size, sha256 and chunk sums known) before it writes the
  manifest that lists it, and readers trust only the manifest;
- nothing takes a temporary name there (the temporary file is local, in ``tempfile``'s folder);
- there is no lock: two extractions into one URL at once are not detected (the local folder's
  ``flock`` has no object-store equivalent); run one at a time;
- reads go by byte ranges (``read_range``: one ranged GET) through a bounded ``ChunkCache``.

Credentials come from the environment or fsspec's ``storage_options`` (``s3fs``: ``key``,
``secret``, ``client_kwargs={"endpoint_url": ...}``); they are handed to fsspec and never
written anywhere by hookscope.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeAlias, cast

from hookscope.errors import HookscopeError, StoreFaultError
from hookscope.store.faults import endpoint_of, guarded
from hookscope.util import read_regular as read_local
from hookscope.util import write_atomic as write_local

__all__ = ["ChunkCache", "RemotePath", "StorePath", "in_this_process", "listdir", "local_copy",
           "location", "open_read", "read_range", "read_regular", "write_atomic"]

_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)", re.S)


class RemotePath:
    """A file or folder at an fsspec URL, with the part of ``pathlib.Path``'s interface the store
    uses (``/``, ``name``, ``parent``, ``exists``, ``is_dir``, ``is_file``, ``is_symlink``,
    ``stat``, ``mkdir``, ``unlink``; ``listdir`` lists a folder). Each call is one request or
    more to the file system (its listing cache is dropped first, so another process's writes
    are seen)."""

    def __init__(self, fs: Any, path: str, url: str):
        self.fs, self.path, self.url = fs, path.rstrip("/"), url.rstrip("/")

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.fs, f"{self.path}/{name}", f"{self.url}/{name}")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (other.fs, other.path) == (self.fs, self.path)

    def __hash__(self) -> int:
        return hash(self.path)  # __eq__ compares (fs, path): equal paths, equal hashes

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, self.path.rsplit("/", 1)[0], self.url.rsplit("/", 1)[0])

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, a request about this path, through ``faults.guarded`` (retries,
        ``StoreFaultError``)."""
        return guarded(self.fs, self.url, what, call)

    def _info(self) -> dict[str, Any] | None:
        self.fs.invalidate_cache(self.path)
        try:
            return self._call("look up", lambda: self.fs.info(self.path))  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def exists(self) -> bool:
        return self._info() is not None

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info["type"] == "directory"

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info["type"] == "file"

    def is_symlink(self) -> bool:
        return False  # object stores have no links

    def stat(self) -> os.stat_result:
        """``st_size``, ``st_mode`` (a regular file or a folder), ``st_mtime_ns`` (a number that
        changes when the object is replaced: from its ETag or modification time), ``st_ino`` 0.

        Raises:
            FileNotFoundError: nothing is there.
        """
        info = self._info()
        if info is None:
            raise FileNotFoundError(2, "no such file", self.url)
        mode = stat.S_IFDIR if info["type"] == "directory" else stat.S_IFREG
        version = str(info.get("ETag") or info.get("LastModified") or info.get("created")
                      or info.get("mtime"))
        stamp = int.from_bytes(hashlib.sha256(version.encode()).digest()[:7], "little")
        return os.stat_result((mode | 0o644, 0, 0, 1, 0, 0, int(info["size"] or 0), 0, 0, 0),
                              {"st_mtime_ns": stamp})

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Make the folder (an object store has no empty folders: nothing to do there) once its
        bucket is known to exist: a bucket is never created here (a typo in its name would
        otherwise make a new one).

        Raises:
            StoreFaultError: the bucket does not exist, or the store cannot be reached.
        """
        self.check_bucket()
        if not _is_object_store(self.fs):
            self._call("create the folder", lambda: self.fs.makedirs(self.path, exist_ok=True))

    def check_bucket(self) -> None:
        """Raise unless this path's bucket exists (one request; nothing for a file system
        without buckets, such as ``memory://``).

        Raises:
            StoreFaultError: the bucket does not exist, the store cannot be reached, or it
                refuses the credentials.
        """
        if not _is_object_store(self.fs):
            return
        bucket = self.path.split("/", 1)[0]
        self.fs.invalidate_cache(bucket)
        try:
            self._call("look up the bucket of", lambda: self.fs.info(bucket))
        except FileNotFoundError:
            raise StoreFaultError(
                f"bucket {bucket!r} of {self.url} does not exist (at {endpoint_of(self.fs)}), "
                f"and hookscope never creates one: a typo in its name would make a new bucket. "
                f"Check the name, or create the bucket first (aws s3 mb s3://{bucket}, or "
                f"fsspec's fs.mkdir({bucket!r})), then run again.") from None

    def unlink(self) -> None:
        try:
            self._call("delete", lambda: self.fs.rm_file(self.path))
        except FileNotFoundError:
            pass  # a retry after a delete whose answer was lost: the object is gone
        self.fs.invalidate_cache(self.path)


StorePath: TypeAlias = "Path | RemotePath"


def _is_object_store(fs: Any) -> bool:
    """True for a file system whose first path part is a bucket (s3, gcs, azure blob)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(set(protocol) & {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def location(path: str | os.PathLike[str], error: type[HookscopeError],
             storage_options: dict[str, Any] | None = None) -> StorePath:
    """The store folder ``path`` names: a local ``Path`` for a path or a ``file://`` URL,
    else a ``RemotePath`` on the fsspec file system of the URL's scheme.

    Args:
        path: a folder path, or a URL (``s3://bucket/acts``, ``memory://acts``, ...).
        error: the error class to raise (``ExtractError``, ``StoreError``).
        storage_options: passed to fsspec's file system (credentials, ``endpoint_url``...);
            refused for a local folder, where they would mean nothing.

    Raises:
        error: ``storage_options`` that is not a dict, or given with a local folder; fsspec, or
            the package for the scheme (``s3fs`` for ``s3://``), is not installed; the scheme is
            unknown; ``path`` holds ``://`` but is no plain URL (a chained fsspec URL,
            ``simplecache::s3://b/x``, would otherwise name a local folder ``simplecache::s3:``).
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise error(f"storage_options must be a dict of fsspec options, e.g. {{'client_kwargs': "
                    f"{{'endpoint_url': 'http://127.0.0.1:9000'}}}}, not "
                    f"{type(storage_options).__name__}")
    text = os.fspath(path)
    found = _URL.fullmatch(text) if isinstance(text, str) else None
    if found is None and isinstance(text, str) and "://" in text:
        raise error(f"{text!r:.100} is neither a folder nor a plain URL (scheme://path): "
                    f"chained fsspec URLs (simplecache::s3://...) are not stores' (a store "
                    f"checks and caches what it reads itself, 64 MiB of chunks); pass the plain "
                    f"URL, e.g. {text.rsplit('::', 1)[-1]!r:.100}")
    if found is None or found["scheme"].lower() == "file":
        if storage_options:
            raise error(f"storage_options apply to a URL (s3://, gs://, memory://); {text!r:.100} "
                        f"is a local folder: leave storage_options out")
        return Path(found["rest"] if found else path)
    try:
        import fsspec.core  # noqa: PLC0415  (lazy: only stores at a URL need it)
        fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
    except (ImportError, ValueError) as err:
        extra = "pip install 'hookscope[s3]'" if found["scheme"].lower() in ("s3", "s3a") else \
            f"install fsspec and the package for {found['scheme']}:// (fsspec names it)"
        raise error(f"cannot open {text!r:.100}: {err}. Stores at a URL go through fsspec: "
                    f"{extra}") from err
    return RemotePath(fs, root, text)


def in_this_process(path: StorePath) -> bool:
    """True when the files at ``path`` live in this process's memory (fsspec's
    ``MemoryFileSystem``, ``memory://``): another process opening the same URL sees a file
    system of its own. A local folder or any other URL is shared between the processes of a
    machine (``file://``) or of every machine that reaches the service (``s3://``, ``gs://``)."""
    if isinstance(path, Path):
        return False
    from fsspec.implementations.memory import MemoryFileSystem  # noqa: PLC0415  (loaded already)
    return isinstance(path.fs, MemoryFileSystem)


def listdir(folder: StorePath) -> list[str]:
    """The names in ``folder``, sorted (``os.listdir`` for a local folder; none for a remote
    folder that holds nothing, which an object store does not keep)."""
    if isinstance(folder, Path):
        return sorted(os.listdir(folder))
    folder.fs.invalidate_cache(folder.path)
    try:
        entries = folder._call("list", lambda: folder.fs.ls(folder.path, detail=False))
    except FileNotFoundError:
        return []
    return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries
                  if str(entry).rstrip("/") != folder.path)


def read_range(path: StorePath, begin: int, end: int) -> bytes:
    """Bytes ``begin:end`` of the file at ``path`` (fewer at its end): ``os.pread`` locally, one
    ranged GET remotely."""
    if isinstance(path, Path):
        with open(path, "rb") as f:
            return os.pread(f.fileno(), end - begin, begin)
    return path._call(  # type: ignore[no-any-return]
        "read", lambda: path.fs.cat_file(path.path, start=begin, end=end))


def open_read(path: StorePath) -> IO[bytes]:
    """The file at ``path`` open for reading in binary (remotely: fsspec's buffered file, each
    ``read`` guarded as every request is: ``hookscope.store.faults``)."""
    if isinstance(path, Path):
        return open(path, "rb")
    return cast(IO[bytes], _GuardedFile(path, path._call("open", lambda: path.fs.open(path.path, "rb"))))


class _GuardedFile:
    """A remote file open for reading whose ``read`` retries transient faults and names the
    others (fsspec's buffered file moves its position only once a read has succeeded)."""

    def __init__(self, path: RemotePath, file: Any):
        self.path, self.file = path, file

    def read(self, size: int = -1) -> bytes:
        return self.path._call("read", lambda: self.file.read(size))  # type: ignore[no-any-return]

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> _GuardedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_regular(path: StorePath, limit: int = -1, *, max_bytes: int | None = None) -> bytes:
    """``hookscope.util.files.read_regular`` for a local file; remotely, the same checks on the
    object's size (an object is always a regular file) before one GET.

    Raises:
        OSError: ``path`` is missing, a folder (``EINVAL``), or larger than ``max_bytes``
            (``EFBIG``).
    """
    if isinstance(path, Path):
        return read_local(path, limit, max_bytes=max_bytes)
    size = path.stat()
    if not stat.S_ISREG(size.st_mode):
        raise OSError(22, "not a regular file", str(path))
    if max_bytes is not None and size.st_size > max_bytes:
        raise OSError(27, f"{size.st_size} bytes, more than the {max_bytes} a hookscope file of "
                          f"this kind may have", str(path))
    return read_range(path, 0, size.st_size if limit < 0 else min(limit, size.st_size))


def write_atomic(path: StorePath, write: Callable[[str], Any], *, tag: str = "") -> None:
    """Make the file at ``path`` whole or not at all: ``write(tmp)`` writes a temporary file.
    Locally it is ``hookscope.util.files.write_atomic`` (beside the file, fsync, rename);
    remotely the temporary file is local and is uploaded in one PUT (``pipe_file``: the object
    appears once complete; memory: the file's size, once more), then deleted.

    Raises:
        OSError: the file cannot be written (locally, named as ``write_atomic`` names it).
    """
    if isinstance(path, Path):
        write_local(path, write, tag=tag)
        return
    folder = tempfile.mkdtemp(prefix="hookscope-upload-")
    try:
        tmp = os.path.join(folder, path.name)
        write(tmp)
        with open(tmp, "rb") as f:
            data = f.read()
        path._call("write", lambda: path.fs.pipe_file(path.path, data))
        path.fs.invalidate_cache(path.path)
    finally:
        shutil.rmtree(folder)


@contextlib.contextmanager
def local_copy(path: StorePath) -> Iterator[str]:
    """Yield a local file path with the bytes of ``path``: the file itself when local, else a
    temporary download (disk: the file's size, deleted afterwards)."""
    if isinstance(path, Path):
        yield str(path)
        return
    folder = tempfile.mkdtemp(prefix="hookscope-download-")
    try:
        tmp = os.path.join(folder, path.name)
        path._call("download", lambda: path.fs.get_file(path.path, tmp))
        yield tmp
    finally:
        shutil.rmtree(folder)


class ChunkCache:
    """The most recently read chunks of a store's remote shards, ``max_bytes`` in all (LRU).

    A remote read fetches whole chunks (``CHUNK_BYTES``, the checksum granularity: each fetched
    chunk is checked once, as it arrives), the uncached chunks it spans in one ranged GET, so
    reading one row costs at least one GET of a chunk, and reading a layer's rows in order costs
    each chunk once while it stays cached.
    Safe across threads; a ``DataLoader`` worker gets an empty cache of its own.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._chunks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_bytes"])  # type: ignore[misc]

    def clear(self) -> None:
        """Drop every chunk (``Store.close``)."""
        with self._lock:
            self._chunks.clear()
            self.nbytes = 0

    def get(self, key: tuple[str, int]) -> bytes | None:
        """The chunk ``key`` (file, index) if it is cached (it becomes the most recent)."""
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                return self._chunks[key]
        return None

    def put(self, key: tuple[str, int], data: bytes) -> None:
        """Keep chunk ``key``, dropping the least recently used ones beyond ``max_bytes``."""
        with self._lock:
            if key not in self._chunks:
                self._chunks[key] = data
                self.nbytes += len(data)
            while self.nbytes > self.max_bytes and len(self._chunks) > 1:
                self.nbytes -= len(self._chunks.popitem(last=False)[1])
