"""Shards: the safetensors files of a store, each read through its chunk checksums.

A shard is memory-mapped on first use (remotely: read by chunks through the store's
``ChunkCache``); each chunk of ``CHUNK_BYTES`` is compared with its checksum in the manifest the
first time any byte of it is read (``StoreCorruptError`` names the shard), and ``verify()`` also
checks the shard's digest. The chunk checksum (``chunk_sums``) is a page-weighted sum of 64-bit
words: it runs at memory speed (about 7x zlib's crc32 here), so a first read stays near memmap
speed. The writer sums each shard as it writes it (``ChunkSums``); ``Store``
(``hookscope.store.reader``) reads rows through these shards.
"""

from __future__ import annotations

import mmap
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors

from hookscope.errors import StoreCorruptError, StoreError
from hookscope.store.fs import ChunkCache, RemotePath, StorePath, local_copy, read_range
from hookscope.store.manifest import (
    DIGESTS,
    check_header,
    check_metadata,
    corrupt,
    inside,
    parse_json,
)

__all__ = ["CHUNK_BYTES", "MANIFEST", "ChunkSums", "ShardInfo", "chunk_sums"]

MANIFEST = "manifest.json"
CHUNK_BYTES = 4 * 2**20  # granularity of the read-time checksums
PAGE_BYTES = 4096  # a chunk checksum weighs each page of the chunk by its position


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it: global row range ``[start, stop)``, size, checksums
    (``digest``: the whole file's, by the store's ``version``: ``manifest.DIGESTS``)."""

    file: str
    rows: tuple[int, int]
    batches: tuple[int, int]
    bytes: int
    digest: str
    chunk_sums: tuple[str, ...]
    version: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "rows": list(self.rows), "batches": list(self.batches),
                "bytes": self.bytes, DIGESTS[self.version].name: self.digest,
                "chunk_sum": list(self.chunk_sums)}

    @staticmethod
    def from_json(entry: dict[str, Any], version: int) -> ShardInfo:
        return ShardInfo(str(entry["file"]), (int(entry["rows"][0]), int(entry["rows"][1])),
                         (int(entry["batches"][0]), int(entry["batches"][1])), int(entry["bytes"]),
                         str(entry[DIGESTS[version].name]), tuple(str(c) for c in entry["chunk_sum"]),
                         version)


def chunk_sums(data: bytes | mmap.mmap | np.ndarray, size: int, chunk_bytes: int = CHUNK_BYTES,
               chunks: Iterable[int] | None = None) -> list[str]:
    """Checksum each ``chunk_bytes`` of ``data[:size]`` (every chunk, or those in ``chunks``).

    A chunk is cut into 4096-byte pages (the last one zero-padded); page ``p`` is read as 512
    little-endian uint64 words whose sum mod 2**64 is ``s_p``; the chunk's checksum is
    ``sum((2p + 1) * s_p) mod 2**64``, as 16 hex digits. Odd weights are invertible mod 2**64,
    so a change to any one word, a zeroed or foreign page, or two pages that trade places are
    caught; it runs at memory speed. ``Store.verify()`` checks the full sha256.

    Returns:
        One 16-hex-digit string per chunk.
    """
    sums = []
    flat = np.frombuffer(data, np.uint8, size)
    for k in chunks if chunks is not None else range(-(-size // chunk_bytes)):
        one = ChunkSums(chunk_bytes)  # the one algorithm, fed the chunk whole
        one.update(flat[k * chunk_bytes:min((k + 1) * chunk_bytes, size)])
        sums += one.finish()
    return sums


class ChunkSums:
    """``chunk_sums`` of bytes handed over piece by piece (a shard's, as it is written; a
    reader's chunk, whole), each byte read once, from memory: the writer no longer maps the
    file it wrote to read it all again (25 ms of the writer's 200 per 256 MiB extracted,
    ``bench/throughput.py``).

    ``update`` each piece in file order, then ``finish()`` returns what ``chunk_sums(data,
    len(data), chunk_bytes)`` of their concatenation returns."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self.sums: list[str] = []
        self._pos, self._page, self._total = 0, 0, 0  # in the current chunk: bytes, whole pages, sum
        self._carry = bytearray()  # a page begun in one piece and ended in the next

    def update(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        at, n = 0, len(view)
        while at < n:
            left = self.chunk_bytes - self._pos  # in the current chunk
            if not self._carry and min(left, n - at) >= PAGE_BYTES:  # whole pages, read in place
                pages = min(n - at, left) // PAGE_BYTES
                self._add(np.frombuffer(view, "<u8", pages * PAGE_BYTES // 8, at).reshape(pages, -1))
                at += pages * PAGE_BYTES
            else:  # a page, or a chunk's last bytes, across pieces
                take = min(PAGE_BYTES - len(self._carry), left, n - at)
                self._carry += view[at:at + take]
                self._pos += take
                at += take
                if len(self._carry) == PAGE_BYTES:
                    self._pos -= PAGE_BYTES  # counted again by _add
                    self._add(np.frombuffer(self._carry, "<u8").reshape(1, -1))
                    self._carry = bytearray()
            if self._pos == self.chunk_bytes:
                self._close()

    def finish(self) -> list[str]:
        """The checksum of each chunk, the last one (shorter) included."""
        if self._pos:
            self._close()
        return self.sums

    def _add(self, words: np.ndarray) -> None:
        """Sum ``words``, ``(pages, 512)`` uint64: the current chunk's next whole pages."""
        first = self._page
        self._total += int(np.dot(np.add.reduce(words, axis=1), _odd(first + len(words))[first:]))
        self._page += len(words)
        self._pos += len(words) * PAGE_BYTES

    def _close(self) -> None:
        """End the current chunk: its last bytes short of a page (zero-padded to whole words)
        weigh as the next page."""
        if self._carry:
            tail = bytes(self._carry).ljust(-(-len(self._carry) // 8) * 8, b"\0")
            self._total += (2 * self._page + 1) * int(np.add.reduce(np.frombuffer(tail, "<u8")))
        self.sums.append(f"{self._total % 2**64:016x}")
        self._pos, self._page, self._total, self._carry = 0, 0, 0, bytearray()


def _odd(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # 1, 3, 5, ...


class _Shard:
    """One shard file, memory-mapped on first use (remotely: read by chunks through the store's
    ``ChunkCache``); each chunk checked when first read (remotely: each time it is fetched)."""

    def __init__(self, folder: StorePath, info: ShardInfo, chunk_bytes: int, verify_reads: bool,
                 layers: dict[str, Any], run: str | None, cache: ChunkCache):
        self.path = inside(folder, info.file, folder / MANIFEST, f"shards[{info.file!r}].file")
        self.info, self.chunk_bytes, self.layers = info, chunk_bytes, layers
        self.verify_reads, self.run, self.cache = verify_reads, run, cache
        self._mm: mmap.mmap | None = None
        self._entries: dict[str, dict[str, Any]] | None = None
        self._data_start = 0
        self._checked = bytearray(len(info.chunk_sums))
        self._offsets: dict[str, np.ndarray] = {}
        self.closed = False

    def __getstate__(self) -> dict[str, Any]:  # a DataLoader worker reopens the file itself
        return {**self.__dict__, "_mm": None, "_entries": None, "_offsets": {}}

    def check_size(self) -> None:
        """Raise ``StoreCorruptError`` unless the file exists with the manifest's byte size."""
        try:
            status = self.path.stat()
        except OSError as err:
            raise StoreCorruptError(f"shard {self.info.file} of {self.path.parent} is missing "
                                    f"({err.strerror}); {_REDO}") from err
        if not stat.S_ISREG(status.st_mode):
            raise StoreCorruptError(f"shard {self.info.file} of {self.path.parent} is not a regular "
                                    f"file (a folder, FIFO or device); {_REDO}")
        size = status.st_size
        if size != self.info.bytes:
            raise StoreCorruptError(f"shard {self.info.file} of {self.path.parent} has {size} bytes, "
                                    f"the manifest says {self.info.bytes}: it is truncated or was "
                                    f"replaced; {_REDO}")

    def open(self) -> dict[str, dict[str, Any]]:
        """Map the file (a local one) and check its header against the manifest (once); return
        the header's tensor entries.

        Raises:
            StoreError: the store was closed.
        """
        self._check_open()
        if self._entries is None:
            self.check_size()
            if not isinstance(self.path, RemotePath):
                with open(self.path, "rb") as f:
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._entries, self._data_start = self._header()
        return self._entries

    def _check_open(self) -> None:
        if self.closed:
            folder = self.path.parent
            raise StoreError(f"store {folder} is closed: open it again with "
                             f"hookscope.open_store({str(folder)!r}) to read its rows")

    def close(self) -> None:
        """Unmap the file (its pages leave the process's RSS); a later ``open`` raises."""
        self.closed = True
        if self._mm is not None:
            mm, self._mm = self._mm, None
            try:
                mm.close()
            except BufferError:  # a read in another thread holds a view: unmapped when it ends
                pass

    def _header(self) -> tuple[dict[str, Any], int]:
        """Read, check (chunk sums, then against the manifest) and return the safetensors header
        and where the tensor data starts."""
        (length,) = struct.unpack("<Q", self._read(0, 8).tobytes())
        if length > self.info.bytes - 8:
            raise corrupt(self.info.file, "header length", f"is {length}, past the end of the "
                                                           f"{self.info.bytes}-byte file")
        try:
            header = parse_json(self._read(8, 8 + length).tobytes())
        except ValueError as err:
            raise StoreCorruptError(f"shard {self.info.file}: unreadable header ({err}); "
                                    f"{_REDO}") from err
        if isinstance(header, dict):
            check_metadata(header.pop("__metadata__", None), self.run, self.info.file)
        rows = self.info.rows[1] - self.info.rows[0]
        check_header(header, layers=self.layers, rows=rows, size=self.info.bytes,
                     data_start=8 + length, name=self.info.file)
        return header, 8 + length

    def _read(self, begin: int, end: int) -> np.ndarray:
        """Bytes ``begin:end`` of the file as a ``(end - begin,)`` uint8 copy, their chunks
        checked against the manifest's sums (``verify_reads``).

        A local file is copied one chunk at a time, and a chunk read whole for the first time
        is checked on the copy, while it is still in the CPU's cache: the bytes returned are
        the bytes checked, and the file is read once (checking the mapping, then copying it,
        read every byte twice; bench/throughput.py's first-pass row). A chunk read in part is
        checked on the mapping."""
        out = np.empty(end - begin, np.uint8)
        size, first, stop = self.chunk_bytes, begin // self.chunk_bytes, -(-end // self.chunk_bytes)
        mapped, remote = self._mm, self._chunks(first, stop) if self._mm is None else []
        for k in range(first, stop):
            lo, hi = max(begin, k * size), min(end, (k + 1) * size)
            piece = out[lo - begin:hi - begin]
            if mapped is None:  # checked as it arrived
                piece[:] = np.frombuffer(remote[k - first], np.uint8, hi - lo, lo - k * size)
                continue
            piece[:] = np.frombuffer(mapped, np.uint8, hi - lo, lo)
            if self.verify_reads and not self._checked[k]:
                whole = lo == k * size and hi == min((k + 1) * size, self.info.bytes)
                self._check_sum(k, chunk_sums(piece, hi - lo, size)[0] if whole else
                                chunk_sums(mapped, self.info.bytes, size, range(k, k + 1))[0])
                self._checked[k] = 1
        return out

    def _chunks(self, first: int, stop: int) -> list[bytes]:
        """Chunks ``first:stop`` of a remote shard: cached ones from the cache, the others in
        one ranged GET (from the first missing chunk to the last), each checked against its sum
        as it arrives, then cached."""
        size, key = self.chunk_bytes, str(self.path)
        cached = [self.cache.get((key, k)) for k in range(first, stop)]
        missing = [k for k, chunk in enumerate(cached, first) if chunk is None]
        got: dict[int, bytes] = {}
        if missing:
            lo, hi = missing[0], missing[-1] + 1
            data = read_range(self.path, lo * size, min(hi * size, self.info.bytes))
            for k in range(lo, hi):
                got[k] = data[(k - lo) * size:(k - lo + 1) * size]
                if self.verify_reads:
                    self._check_sum(k, chunk_sums(got[k], len(got[k]), size)[0])
                self.cache.put((key, k), got[k])
        return [chunk if chunk is not None else got[k] for k, chunk in enumerate(cached, first)]

    def _check_sum(self, k: int, found: str) -> None:
        if found != self.info.chunk_sums[k]:
            raise StoreCorruptError(
                f"shard {self.info.file} of {self.path.parent} is corrupt: bytes "
                f"{k * self.chunk_bytes}..{min((k + 1) * self.chunk_bytes, self.info.bytes)} "
                f"fail their checksum; {_REDO}")

    def array(self, key: str, first: int, stop: int) -> np.ndarray:
        """Return a copy of rows ``first:stop`` (along dim 0) of tensor ``key``, checked."""
        entry = self.open()[key]
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        row_bytes = (end - begin) // shape[0] if shape[0] else 0
        lo = self._data_start + begin + first * row_bytes
        return self._read(lo, lo + (stop - first) * row_bytes)

    def offsets(self, path: str) -> np.ndarray:
        """Return the ``(rows + 1,)`` int64 token offsets of ragged layer ``path``."""
        if path not in self._offsets:
            offsets = self.array(f"{path}:offsets", 0, self.info.rows[1] -
                                 self.info.rows[0] + 1).view(np.int64)
            tokens = self.open()[path]["shape"][0]
            if offsets[0] != 0 or offsets[-1] != tokens or (np.diff(offsets) < 0).any():
                raise corrupt(self.info.file, f"{path}:offsets", f"must rise from 0 to the "
                                                                 f"{tokens} tokens of the shard")
            self._offsets[path] = offsets
        return self._offsets[path]

    def verify(self) -> None:
        """Check size, the digest, the header against the manifest, every chunk sum, that
        safetensors' own parser accepts the file, and ragged offsets. Reads the whole file once
        (a remote shard is downloaded to a temporary file, its size on disk, for the time of the
        check).

        Raises:
            StoreError: the store was closed.
            StoreCorruptError: naming what differs.
        """
        self._check_open()
        self.check_size()
        with local_copy(self.path) as copy:
            digest, sums = DIGESTS[self.info.version], []
            hashed = digest.new()
            with open(copy, "rb") as f:
                while block := f.read(self.chunk_bytes):
                    hashed.update(block)
                    sums.append(chunk_sums(block, len(block), self.chunk_bytes)[0])
            if hashed.hexdigest() != self.info.digest:
                raise StoreCorruptError(f"shard {self.info.file} of {self.path.parent} is "
                                        f"corrupt: its {digest.name} differs from the manifest's; "
                                        f"{_REDO}")
            entries = self.open()
            for k, found in enumerate(sums):
                self._check_sum(k, found)
            self._check_with_safetensors(copy)
        for path in self.layers:
            if f"{path}:offsets" in entries:
                self.offsets(path)

    def _check_with_safetensors(self, copy: str) -> None:
        """Parse the file with safetensors' own parser too: what it refuses is not a store."""
        try:
            with safetensors.safe_open(copy, framework="pt"):
                pass
        except (safetensors.SafetensorError, OSError, ValueError) as err:
            raise StoreCorruptError(f"shard {self.info.file} of {self.path.parent} is not a valid "
                                    f"safetensors file ({err}); {_REDO}") from err

_REDO = ("its rows cannot be trusted. Restore the file from a copy, or extract the store again "
         "(overwrite=True / --overwrite).")
