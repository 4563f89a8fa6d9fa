"""Private: files appear whole or not at all (write to a temporary name, fsync, rename).

The temporary file is ``.NAME.tmp-PID-RANDOM`` beside ``NAME`` (``.NAME.tmp-TAG-PID-RANDOM`` when
the caller tags it, so that it can later prove the file is its own), so a leftover says what it
was for; it is created with mode 0o666 less the umask, as ``open()`` creates files, so the renamed
file gets the permissions any other program's file would. A failed write (disk full, permission
denied, ...) removes it and raises ``OSError`` naming the target, not the temporary name.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["advice", "fsync_folder", "read_regular", "write_all", "write_atomic", "write_bytes"]

_ADVICE = {
    errno.ENOSPC: "the disk is full: free space, or write to another disk",
    errno.EDQUOT: "the disk quota is used up: free space, or write elsewhere",
    errno.EACCES: "permission denied: choose a folder you may write to, or change its permissions",
    errno.EPERM: "not permitted: choose a folder you may write to, or change its permissions",
    errno.EROFS: "the file system is read-only: choose a folder on a writable disk",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
    errno.EEXIST: "a part of the path is a file, not a folder: choose another path",
    errno.EISDIR: "the path is a folder: give a file name inside it",
    errno.ENOENT: "no such file or folder: check the path",
}


def advice(err: OSError) -> str:
    """One line for a file-system error: the path, what happened, and what to do."""
    what = _ADVICE.get(err.errno or 0, err.strerror or str(err))
    return f"cannot use {err.filename}: {what}" if err.filename else f"{err.strerror}: {what}"


def write_atomic(file: str | os.PathLike[str], write: Callable[[str], Any], *,
                 tag: str = "") -> None:
    """Call ``write(tmp)`` for a temporary path beside ``file``, fsync it, rename it to ``file``,
    fsync the folder. ``tag`` (letters and digits) goes into the temporary name
    (``.NAME.tmp-TAG-PID-RANDOM``): a store puts its run id there.

    A crash leaves either the old file or the new one, never half of one.

    Raises:
        OSError: the folder cannot be made or written, or the disk is full; ``filename`` is
            ``file`` and no temporary file is left behind.
    """
    file = os.fspath(file)
    folder = os.path.dirname(os.path.abspath(file))
    tmp = os.path.join(folder, f".{os.path.basename(file)}.tmp-{tag + '-' if tag else ''}"
                               f"{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # umask applies
        mode = os.stat(tmp).st_mode & 0o777
        write(tmp)
        os.chmod(tmp, mode)  # a writer that made its own file (safetensors: 0o600) gets it too
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, file)
        fsync_folder(folder)
    except BaseException as err:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename in (None, tmp) and err.errno is not None:
            raise type(err)(err.errno, err.strerror, file) from err
        raise


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the file descriptor ``fd`` (``os.write`` again after a short
    write); the one place hookscope's appends reach the disk.

    Raises:
        OSError: the disk is full (``ENOSPC``) or the write fails otherwise; part of ``data``
            may be written (a caller that needs whole records truncates back).
    """
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_bytes(file: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` as the whole content of ``file`` (created or truncated) through
    ``write_all``; for ``write_atomic``'s temporary file."""
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        write_all(fd, data)  # looked up here at each call: a test may replace it
    finally:
        os.close(fd)


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make a rename in ``folder`` durable (fsync of the folder itself)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_regular(path: Path, limit: int = -1, *, max_bytes: int | None = None) -> bytes:
    """Return the bytes of ``path`` (at most ``limit``) after checking it is a regular file:
    a FIFO or device named like a store file would block or never end, a folder cannot be read.
    With ``max_bytes``, a file larger than that is refused before any byte is read (its size
    from ``fstat``; a sparse file reads as its full size).

    Raises:
        OSError: ``path`` is missing, unreadable, not a regular file (``EINVAL``), or larger
            than ``max_bytes`` (``EFBIG``).
    """
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
        status = os.fstat(f.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if max_bytes is not None and status.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{status.st_size} bytes, more than the {max_bytes} a "
                                       f"hookscope file of this kind may have", str(path))
        return f.read(limit)
