"""Activation store: a folder of safetensors shards joined by a JSON manifest; its reader.

A store holds, per layer, one row per input: a fixed-shape tensor, or for a ragged layer (token
sequences of different lengths) the tokens of all rows stored flat with offsets, padding left
out. ``manifest.json`` lists the shards in row order with their row ranges, byte sizes, a digest
of the whole file (``xxh3_128``; ``sha256`` in a version-1 store: ``manifest.DIGESTS``) and a
checksum of every ``CHUNK_BYTES`` of file (``chunk_sum``); the README documents the format field
by field. Writing lives in ``hookscope.store.writer``.

Reading is memory-mapped and checked, so nothing reads damaged data silently: a shard whose size
differs from the manifest fails when the store is opened, and each chunk is compared with its
checksum the first time any byte of it is read (``StoreCorruptError`` names the shard);
``Store.verify()`` also checks every shard's digest. The chunk checksum (``chunk_sums``) is a
page-weighted sum of 64-bit words: it runs at memory speed (about 7x zlib's crc32 here), so a
first read stays near memmap speed.
"""

from __future__ import annotations

import bisect
import fnmatch
import mmap
import operator
import os
import stat
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors
import torch

from hookscope.engine import brief, check_path, unresolved_standard
from hookscope.errors import StoreCorruptError, StoreError
from hookscope.store.fs import (
    ChunkCache,
    RemotePath,
    StorePath,
    listdir,
    local_copy,
    location,
    read_range,
)
from hookscope.store.manifest import (
    COLUMN_PREFIX,
    DIGESTS,
    FORMAT,
    MAX_MANIFEST_BYTES,
    check_header,
    check_manifest,
    check_metadata,
    corrupt,
    inside,
    parse_json,
    read_regular,
    tensor_specs,
)

if TYPE_CHECKING:
    from hookscope.store.tokens import TokenView

__all__ = ["FORMAT", "ChunkSums", "LayerInfo", "LayerView", "ShardInfo", "Store", "StoreDataset",
           "chunk_sums", "open_store", "read_manifest", "CHUNK_BYTES", "MANIFEST", "dtype_name"]

MANIFEST = "manifest.json"
CHUNK_BYTES = 4 * 2**20  # granularity of the read-time checksums
REMOTE_CACHE_BYTES = 64 * 2**20  # chunks of a remote store's shards kept in memory, per store
PAGE_BYTES = 4096  # a chunk checksum weighs each page of the chunk by its position
Tensor = torch.Tensor

# torch dtype <-> safetensors dtype name (the manifest uses torch's name without "torch.")
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest name of ``dtype`` (``torch.float16`` -> ``"float16"``)."""
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in _ST_DTYPES:
        raise StoreCorruptError(f"unknown dtype {name!r} in the manifest; known: "
                                f"{sorted(dtype_name(d) for d in _ST_DTYPES)}")
    return dtype


@dataclass(frozen=True)
class LayerInfo:
    """What one row of a layer is: ``shape`` (``None`` first for ragged rows), ``dtype``."""

    path: str
    shape: tuple[int | None, ...]
    dtype: torch.dtype

    @property
    def ragged(self) -> bool:
        """True when rows have different lengths (first dimension ``None``): tokens, flat."""
        return bool(self.shape) and self.shape[0] is None

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype), "ragged": self.ragged}


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


# ---------------------------------------------------------------------------------------- reading
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


def read_manifest(path: StorePath) -> dict[str, Any]:
    """Parse a manifest and check it against the schema (``hookscope.store.manifest``).

    Raises:
        StoreCorruptError: the file cannot be read or parsed, is a link leading outside its
            folder, or breaks the schema (naming the file and the field).
    """
    inside(path.parent, path.name, path, "name")
    try:
        data = parse_json(read_regular(path, max_bytes=MAX_MANIFEST_BYTES))
    except (OSError, ValueError) as err:
        raise StoreCorruptError(f"cannot read {path}: {err}. The file is damaged; extract the "
                                f"store again (overwrite=True / --overwrite).") from err
    check_manifest(data, path)
    return data  # type: ignore[no-any-return]


_REDO = ("its rows cannot be trusted. Restore the file from a copy, or extract the store again "
         "(overwrite=True / --overwrite).")


def _as_tensor(data: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    if data.size == 0:
        return torch.empty(*shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).reshape(*shape)


class LayerView:
    """Rows of one layer: ``view[i]``, ``view[i:j]`` (one tensor), ``view[[i, j, ...]]``.

    A fixed layer returns ``(rows, *shape)`` tensors; a ragged layer returns a ``(tokens, *rest)``
    tensor for one row and a list of them for several. Reads copy only the rows asked for.
    ``view[mask]`` with a bool list, array or tensor of one entry per row takes the rows where
    it is True, as torch does. Any other index (a float, a str, 2-dim indices) is an
    ``IndexError``, as is a row out of range.
    """

    def __init__(self, store: Store, info: LayerInfo):
        self.store, self.info = store, info
        self._row_shape = tuple(int(n or 0) for n in info.shape[info.ragged:])  # known dims

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int | slice | Sequence[int] | Tensor) -> Tensor | list[Tensor]:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return self[list(range(start, stop, step))]
            return self._rows(start, max(start, stop))
        if isinstance(index, (Sequence, Tensor, np.ndarray)) and not isinstance(index, str):
            if isinstance(index, Tensor) and index.layout != torch.strided:  # no numpy view
                raise IndexError(f"rows of layer {self.info.path!r} are indexed by a dense "
                                 f"tensor, not a {index.layout} one: pass index.to_dense()")
            found = np.asarray(index.cpu() if isinstance(index, Tensor) else index)
            if found.ndim == 1:
                rows = [self._one(i, n) for i in self._indices(found, n)]
                if self.info.ragged:
                    return [row for i in rows for row in self._ragged(i, i + 1)]
                return torch.cat([self._fixed(i, i + 1) for i in rows]) if rows else \
                    self._fixed(0, 0)
            if found.ndim != 0:
                raise IndexError(f"rows of layer {self.info.path!r} are indexed by an int, a "
                                 f"slice, or a 1-dim list of ints or bool mask, not "
                                 f"{found.ndim}-dim indices")
            index = found.item()
        i = self._one(_as_int(index, self.info.path), n)
        return self._ragged(i, i + 1)[0] if self.info.ragged else self._fixed(i, i + 1)[0]

    def _indices(self, found: np.ndarray, n: int) -> list[int]:
        """Row numbers of a 1-dim index: ints as given, a bool mask (length ``n``) as the rows
        where it is True (as torch and numpy read a mask)."""
        if found.dtype == np.bool_:
            if len(found) != n:
                raise IndexError(f"a bool mask over layer {self.info.path!r} needs {n} entries "
                                 f"(one per row), not {len(found)}")
            return np.flatnonzero(found).tolist()
        if found.size and not np.issubdtype(found.dtype, np.integer):
            raise IndexError(f"row indices of layer {self.info.path!r} must be integers or a "
                             f"bool mask, not {found.dtype}")
        return [int(i) for i in found]

    def _one(self, i: int, n: int) -> int:
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for layer {self.info.path!r} of {n} rows")
        return i % n

    def _rows(self, start: int, stop: int) -> Tensor | list[Tensor]:
        return self._ragged(start, stop) if self.info.ragged else self._fixed(start, stop)

    def _fixed(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` as one ``(rows, *shape)`` tensor."""
        info = self.info
        pieces = [_as_tensor(shard.array(info.path, a, b), info.dtype, (b - a, *self._row_shape))
                  for shard, a, b in self.store._locate(start, stop)]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(0, *self._row_shape, dtype=info.dtype)

    def _ragged(self, start: int, stop: int) -> list[Tensor]:
        """Rows ``start:stop`` as a list of ``(tokens, *shape[1:])`` tensors."""
        rows: list[Tensor] = []
        for shard, a, b in self.store._locate(start, stop):
            offsets = shard.offsets(self.info.path)
            first, last = int(offsets[a]), int(offsets[b])
            flat = _as_tensor(shard.array(self.info.path, first, last), self.info.dtype,
                              (last - first, *self._row_shape))
            rows += torch.split(flat, np.diff(offsets[a:b + 1]).tolist())
        return rows


def _column_text(name: str, info: LayerInfo) -> str:
    """``ids: text``, ``ids: data-set indices``, ``labels: int64``, ``labels: 3 float32``: a
    column as ``repr`` shows it."""
    if name == "token":
        return "tokens: token ids"
    kind = "text" if info.ragged else "data-set indices" if name == "id" else \
        dtype_name(info.dtype) if not info.shape else f"{row_shape(info)} {dtype_name(info.dtype)}"
    return f"{name}s: {kind}"


def _text(row: Tensor, column: str, i: int) -> str:
    """Row ``i`` of text column ``column`` (``id``, ``label``): its bytes decoded as strict UTF-8.

    Raises:
        StoreCorruptError: the bytes are not UTF-8 (hookscope writes them with ``str.encode``).
    """
    try:
        return bytes(row.numpy()).decode("utf-8")
    except UnicodeDecodeError as err:
        raise StoreCorruptError(f"column @{column}, row {i}: its bytes are not UTF-8 text "
                                f"({err.reason} at byte {err.start}); {_REDO}") from err


def row_shape(info: LayerInfo) -> str:
    """``"tokensx8"``, ``"3x4"``, ``"scalar"``: a row's shape as ``show`` prints it."""
    return "x".join("tokens" if n is None else str(n) for n in info.shape) or "scalar"


def _as_int(index: object, layer: str) -> int:
    """``index`` as a row number; a float, str or other non-integer is an IndexError."""
    try:
        if isinstance(index, (bool, np.bool_)):
            raise TypeError
        return operator.index(index)  # type: ignore[arg-type]
    except TypeError:
        raise IndexError(f"a row of layer {layer!r} is indexed by an int, a slice, or a list of "
                         f"ints or a bool mask, not {type(index).__name__} {index!r:.40}") from None


class StoreDataset(torch.utils.data.Dataset[Tensor]):
    """``store.dataset(layer)``: item ``i`` is row ``i`` of the layer; safe in DataLoader workers."""

    def __init__(self, view: LayerView):
        self.view = view

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, i: int) -> Tensor:
        return self.view[i]  # type: ignore[return-value]


class Store:
    """A store opened for reading (``hookscope.open_store``); see ``LayerView`` for row access.

    Shards are memory-mapped on their first read and stay mapped until ``close()``: the pages
    read count in the process's RSS (clean file pages, which the kernel may drop under memory
    pressure), so reading a whole store grows RSS by the bytes touched. ``close()`` (or ``with
    hookscope.open_store(path) as store:``) unmaps them; reading a closed store is
    ``StoreError``. A ``DataLoader`` worker maps the shards it reads itself.

    Besides the layers, a store may hold per-row columns (``store.columns``): ``ids``, what each
    row was (a file path relative to the data folder, a data-set index) and ``labels`` (a folder
    label, the ``y`` of ``(x, y)`` batches). ``repr(store)`` describes it in a few lines.
    """

    def __init__(self, path: StorePath, manifest: dict[str, Any], verify_reads: bool):
        self.path, self.manifest = path, manifest
        self.complete: bool = bool(manifest["complete"])
        self.layers: dict[str, LayerInfo] = {
            name: LayerInfo(name, tuple(spec["shape"]), _dtype(spec["dtype"]))
            for name, spec in manifest["layers"].items()}
        # {standard name: layer} for layers extracted by a standard name ("resid_post.1")
        self.standard_names: dict[str, str] = dict(manifest.get("standard_names", {}))
        self.columns: dict[str, LayerInfo] = {
            name: LayerInfo(COLUMN_PREFIX + name, tuple(spec["shape"]), _dtype(spec["dtype"]))
            for name, spec in manifest.get("columns", {}).items()}
        self.shards = [ShardInfo.from_json(e, manifest["version"]) for e in manifest["shards"]]
        chunk = int(manifest["chunk_bytes"])
        self._cache = ChunkCache(REMOTE_CACHE_BYTES)  # used by remote shards only
        self._shards = [_Shard(path, info, chunk, verify_reads, tensor_specs(manifest),
                               manifest.get("run"), self._cache) for info in self.shards]
        self._starts = [s.rows[0] for s in self.shards]
        self._rows = self.shards[-1].rows[1] if self.shards else 0

    def close(self) -> None:
        """Unmap every shard, so the pages read leave the process's RSS (a store at a URL: drop
        its cached chunks); closing twice is fine. Afterwards, reading rows
        (``store[layer][i]``, ``store.tokens``, ``verify()``) raises ``StoreError``."""
        for shard in self._shards:
            shard.close()
        self._cache.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, layer: str) -> LayerView:
        if not isinstance(layer, str):
            raise StoreError(f"a store's layer is named by a str; got {type(layer).__name__} "
                             f"{brief(layer)}: pass one of {list(self.layers)}")
        layer = self.standard_names.get(layer, layer)  # store["resid_post.1"]
        if layer not in self.layers:
            if self._shards:  # a layer cut from the manifest: the shard header still holds it
                self._shards[0].open()
            raise StoreError(f"store {self.path} has no layer {layer!r}; it has "
                             f"{list(self.layers)}.{unresolved_standard(layer, 'this store')}")
        return LayerView(self, self.layers[layer])

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    @property
    def paths(self) -> dict[str, str]:
        """``{name asked: layer}`` for every layer, in layer order: the standard name a layer
        was extracted by (``{"resid_post.1": "transformer.h.1"}``; the first when it had
        several), else the layer itself (a path, a glob's match; every layer of a store
        written before standard names were kept). ``store[name]`` reads by either."""
        asked: dict[str, str] = {}  # layer -> its first standard name
        for name, layer in self.standard_names.items():
            asked.setdefault(layer, name)
        return {asked.get(layer, layer): layer for layer in self.layers}

    def __repr__(self) -> str:
        """What ``hookscope show`` shows, in a few lines: path, rows, shards, bytes, complete
        or not, one line per layer (row shape, dtype), and the columns (no row is read)."""
        state = "complete" if self.complete else "INCOMPLETE (resume the extraction)"
        lines = [f"Store({str(self.path)!r}: {len(self)} rows in {len(self.shards)} shard"
                 f"{'s' if len(self.shards) != 1 else ''}, {self.nbytes} bytes, {state})"]
        named = {name: (f"{name} ({layer})" if name != layer else name)
                 for name, layer in self.paths.items()}  # the name asked, its path beside it
        width = max((len(text) for text in named.values()), default=0)
        shape = max((len(row_shape(info)) for info in self.layers.values()), default=0)
        lines += [f"  {named[name]:<{width}}  {row_shape(self.layers[layer]):<{shape}}  "
                  f"{dtype_name(self.layers[layer].dtype)}" for name, layer in self.paths.items()]
        lines.append("  " + "; ".join(_column_text(name, info)
                                      for name, info in self.columns.items())
                     if self.columns else "  ids: row numbers (no id column); no labels")
        return "\n".join(lines)

    @property
    def ids(self) -> Tensor | list[str]:
        """What each row was: a ``list[str]`` (file paths relative to the data folder, as
        ``--data FOLDER`` gives), an ``(rows,)`` int64 tensor of data-set indices (a Dataset,
        or a DataLoader over one), or, when the store has no id column (an iterable of
        batches), the row numbers ``0..rows-1``."""
        column = self._column("id")
        return torch.arange(len(self)) if column is None else column

    @property
    def labels(self) -> Tensor | list[str] | None:
        """Each row's label: a ``list[str]`` (the class folder of ``--data FOLDER``), a
        ``(rows, ...)`` tensor (the ``y`` of ``(x, y)`` batches, as the data gave it), or
        ``None`` when the data had none."""
        return self._column("label")

    @property
    def token_ids(self) -> list[Tensor] | None:
        """Each row's token ids, real tokens only (a ``(tokens_i,)`` int64 tensor per row,
        aligned with the rows of every ragged layer: token ``t`` of a row is the one whose id
        is ``token_ids[row][t]``), or ``None`` when the data gave no ``input_ids`` beside an
        ``attention_mask`` (or no layer was stored per token). The attention mask is these
        rows' lengths: padding is not stored."""
        info = self.columns.get("token")
        return None if info is None else LayerView(self, info)[:]  # type: ignore[return-value]

    def tokens(self, layer: str, *, exclude: Sequence[int] = ()) -> TokenView:
        """A flat ``(tokens, *shape)`` view over the rows of ragged ``layer`` (``TokenView``):
        padding is never stored, and tokens whose id is in ``exclude`` (e.g. BOS) are left
        out. ``.ids`` and ``.rows`` give each token's id and row; ``.stream(buffer_tokens=,
        seed=)`` a shuffled, resumable stream a ``DataLoader`` reads
        (``hookscope.store.tokens``).

        Raises:
            StoreError: no such layer, the layer is not ragged, or ``exclude`` without stored
                token ids.
        """
        from hookscope.store.tokens import TokenView  # the module builds on this one
        return TokenView(self, self[layer].info, exclude)

    def _column(self, name: str) -> Tensor | list[str] | None:
        info = self.columns.get(name)
        if info is None:
            return None
        rows = LayerView(self, info)[:]
        if info.ragged:  # text: UTF-8 bytes per row
            return [_text(row, name, i) for i, row in enumerate(rows)]
        return rows  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Total bytes of the shard files."""
        return sum(s.bytes for s in self.shards)

    def dataset(self, layer: str, *, ragged: bool = False) -> StoreDataset:
        """Return a ``torch.utils.data.Dataset`` whose item ``i`` is row ``i`` of ``layer``.

        A ragged layer's rows hold different numbers of tokens, which a ``DataLoader``'s
        default collate cannot stack: pass ``ragged=True`` and ``collate_fn=pad_rows``
        (``hookscope.store.pad_rows``: padded rows and their mask), or read tokens with
        ``store.tokens(layer)``.

        Raises:
            StoreError: no such layer, or ``layer`` is ragged and ``ragged`` is False.
        """
        view = self[layer]
        if view.info.ragged and not ragged:
            raise StoreError(
                f"layer {layer!r} is ragged: its rows hold different numbers of tokens, so a "
                f"DataLoader cannot stack them (torch: 'stack expects each tensor to be equal "
                f"size'). For tokens: store.tokens({layer!r}) (a flat (tokens, d) view; "
                f".stream() shuffles them); for whole rows: DataLoader(store.dataset({layer!r}, "
                f"ragged=True), collate_fn=hookscope.store.pad_rows)")
        return StoreDataset(view)

    def verify(self) -> None:
        """Check every shard as reading does (size, header against the manifest with byte
        ranges that follow each other without overlap or gap, every chunk sum, ragged offsets),
        its sha256 (reads every byte), and that safetensors' own parser accepts it; then that
        every row of a text column (``ids``, ``labels``) is UTF-8.

        Raises:
            StoreCorruptError: naming the first shard that is missing, truncated or damaged
                (or the column and row whose text is not UTF-8).
        """
        for shard in self._shards:
            shard.verify()
        for name, info in self.columns.items():
            if info.ragged:  # text: strict UTF-8, each row
                self._column(name)

    def _locate(self, start: int, stop: int) -> Iterator[tuple[_Shard, int, int]]:
        """Yield ``(shard, local start, local stop)`` covering global rows ``[start, stop)``."""
        k = bisect.bisect_right(self._starts, start) - 1
        while start < stop and k < len(self._shards):
            first, last = self.shards[k].rows
            if last > start:
                yield self._shards[k], start - first, min(stop, last) - first
                start = min(stop, last)
            k += 1


def open_store(path: str | os.PathLike[str], *, allow_incomplete: bool = False,
               verify_reads: bool = True, storage_options: dict[str, Any] | None = None) -> Store:
    """Open the store at ``path`` for reading; rows are memory-mapped (local) or read by byte
    ranges (a URL), not loaded.

    Args:
        path: the folder ``hookscope.extract`` wrote, or its URL (``s3://bucket/acts``,
            ``gs://...``, ``memory://...``, ``file://...``; any fsspec URL).
        allow_incomplete: read the rows of an interrupted single-process run written so far.
        verify_reads: check each chunk (``CHUNK_BYTES``) against its checksum the first time it
            is read. Off, a damaged shard is only found by ``verify()``.
        storage_options: for a URL, fsspec's options (credentials, ``client_kwargs``, ...);
            otherwise the environment's credentials apply. Never written anywhere.

    A store at a URL is read by chunks of ``CHUNK_BYTES`` (4 MiB): each read fetches the chunks
    it touches that are not cached, one ranged GET each, checks them, and keeps the last
    ``REMOTE_CACHE_BYTES`` (64 MiB) of them; ``verify()`` downloads each shard once.

    Returns:
        A ``Store``: ``store.layers`` (``{path: LayerInfo}``), ``len(store)`` rows,
        ``store[layer][i:j]`` tensors, ``store.dataset(layer)``, ``store.verify()``;
        ``store.close()`` (or a ``with`` block) unmaps the shards read.

    Raises:
        ArgumentTypeError: ``path`` is not a path (``None``, a number).
        StoreError: ``path`` is not a store, or its extraction did not finish, or is a URL
            whose file system is not installed (``s3fs`` for ``s3://``).
        StoreCorruptError: the manifest is damaged, or a shard is missing or has the wrong size.
    """
    check_path("path", path, "hookscope.open_store('acts/') (the folder extract wrote)")
    folder = location(path, StoreError, storage_options)
    if not folder.exists():
        raise StoreError(f"{folder} does not exist: give the folder that hookscope.extract / "
                         f"`hookscope extract --out` wrote")
    if not (folder / MANIFEST).is_file():
        names = listdir(folder) if folder.is_dir() else []
        parts = [n for n in names if fnmatch.fnmatchcase(n, "manifest-r*.json")]
        detail = (f"it holds the part manifests of an interrupted run over {len(parts)}+ "
                  f"processes; rerun the same torchrun command with --resume" if parts else
                  "it is empty: an extraction stopped before it began writing; run it again "
                  "(--resume starts afresh)" if folder.is_dir() and not names else
                  "point to the folder hookscope.extract / `hookscope extract --out` wrote")
        raise StoreError(f"{folder} is not a hookscope store (no {MANIFEST}): {detail}.")
    manifest = read_manifest(folder / MANIFEST)
    if not manifest["complete"] and not allow_incomplete:
        raise StoreError(f"{folder} is incomplete: its extraction stopped after "
                         f"{manifest['rows']} rows. Resume it (resume=True / --resume), or pass "
                         f"allow_incomplete=True to read the rows written so far.")
    store = Store(folder, manifest, verify_reads)
    for shard in store._shards:
        shard.check_size()
    return store
