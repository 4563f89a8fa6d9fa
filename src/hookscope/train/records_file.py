"""Private: the monitor's JSON Lines file, where each record is appended whole or not at all.

A record is one write of its line (``util.files.write_all``) at the end of the file. When
the disk is full the write fails, possibly after writing part of the line; the file is then cut
back to the end of the last whole record (``ftruncate`` needs no free space), so a reader never
meets a torn line in the middle of the file, and the records after the disk has room again
follow on cleanly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hookscope.util import write_all

__all__ = ["RecordsFile"]


class RecordsFile:
    """``path`` created (it must not exist) and opened for appending records.

    Raises:
        FileExistsError: ``path`` exists.
        OSError: the folder cannot be written.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND,
                                       0o666)
        self._size = 0  # the end of the last whole record

    def append(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line (non-finite floats as JSON's ``NaN``/``Infinity``).

        Raises:
            OSError: the line could not be written (nothing of it is left in the file).
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = (json.dumps(record) + "\n").encode()
        try:
            write_all(self._fd, data)  # the one door to the disk (tests inject faults)
        except OSError:
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass  # the torn line stays; the reader skips a torn last line
            raise
        self._size += len(data)

    def close(self) -> None:
        """Close the file (once; later calls do nothing)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
