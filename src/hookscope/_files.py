"""Private: files appear whole or not at all (write to a temporary name, fsync, rename)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any


def write_atomic(file: str | os.PathLike[str], write: Callable[[str], Any]) -> None:
    """Call ``write(tmp)`` for a temporary path beside ``file``, fsync it, rename it to ``file``.

    A crash leaves either the old file or the new one, never half of one.
    """
    file = os.fspath(file)
    folder = os.path.dirname(os.path.abspath(file))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(file)}.tmp-", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
