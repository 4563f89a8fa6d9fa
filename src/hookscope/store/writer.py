"""Writing stores (private; ``hookscope.extract`` is the public way): shards, manifests, joins,
the memory rows wait in (``Staging``) and the thread that writes shards (``BackgroundWriter``).

Crash safety: every file goes to a temporary name in the store folder, is fsync'ed, then renamed
over its final name and the folder fsync'ed (``hookscope.util.files``; at a URL it is uploaded
whole in one PUT instead, ``hookscope.store.fs``); the manifest is written when the run starts
and replaced the same way after each shard, once the shard is whole. A crash therefore loses at
most the shard in progress, and a reader never sees a half-written file under a final name. What an
output folder may hold and what ``overwrite`` deletes is ``hookscope.store.folder``'s.
"""

from __future__ import annotations

import fnmatch
import json
import mmap
import queue
import secrets
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookscope.errors import StoreCorruptError, StoreError
from hookscope.store.fs import StorePath, listdir, write_atomic
from hookscope.store.layers import _ST_DTYPES
from hookscope.store.manifest import DIGESTS, FORMAT, VERSION, Digest, tensor_specs
from hookscope.store.reader import read_manifest
from hookscope.store.shards import CHUNK_BYTES, MANIFEST, ChunkSums, ShardInfo

__all__ = ["BackgroundWriter", "ShardData", "Staging", "StoreWriter", "join_parts", "read_part",
           "write_shard"]

Tensor = torch.Tensor


@dataclass
class ShardData:
    """Rows of one shard held in memory, not yet written.

    ``tensors[path]`` lists one CPU tensor per batch: ``(rows_b, *shape)`` for a fixed layer,
    ``(tokens_b, *shape[1:])`` for a ragged one, whose ``lengths[path]`` lists ``(rows_b,)`` int64
    token counts per batch. ``batches`` is the global batch range ``[start, stop)``.
    """

    batches: tuple[int, int]
    rows: int = 0
    nbytes: int = 0
    tensors: dict[str, list[Tensor]] = field(default_factory=dict)
    lengths: dict[str, list[Tensor]] = field(default_factory=dict)
    buffers: list[Tensor] = field(default_factory=list)  # memory the tensors live in, for reuse
    last: bool = False  # the run's last shard: its manifest also says the run is complete

    def append(self, tensors: dict[str, Tensor], lengths: dict[str, Tensor], rows: int) -> None:
        """Add one batch: ``rows`` rows, ``tensors[path]`` each, ``lengths`` for ragged paths."""
        for key, tensor in tensors.items():
            self.tensors.setdefault(key, []).append(tensor)
            self.nbytes += tensor.numel() * tensor.element_size()
        for key, counts in lengths.items():
            self.lengths.setdefault(key, []).append(counts)
            self.nbytes += counts.numel() * counts.element_size()
        self.rows += rows


# ---------------------------------------------------------------------------------------- writing
def _write_hashed(f: Any, pieces: list[memoryview], digest: Digest, sums: ChunkSums) -> tuple[int, str]:
    """Write ``pieces`` to the file ``f`` in order, hashing each first and adding it to
    ``sums``; return the bytes written and their ``digest`` (hex). XXH3-128 (version 2) hashes
    at memory speed, so it runs inline: sha256 (version 1) cost a thread of its own beside the
    write."""
    hashed = digest.new()
    for piece in pieces:
        hashed.update(piece)
        sums.update(piece)
        f.write(piece)
    return sum(len(p) for p in pieces), hashed.hexdigest()


def _bytes_of(t: Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _shard_tensors(shard: ShardData) -> list[tuple[str, tuple[int, ...], torch.dtype, list[Tensor]]]:
    """Return ``(key, shape, dtype, chunks)`` per safetensors tensor, in file order."""
    out = []
    for path, chunks in shard.tensors.items():
        first = chunks[0]
        shape = (sum(int(c.shape[0]) for c in chunks), *first.shape[1:])
        out.append((path, shape, first.dtype, chunks))
        if path in shard.lengths:
            lengths = torch.cat(shard.lengths[path])
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            out.append((f"{path}:offsets", (shard.rows + 1,), torch.int64, [offsets]))
    return out


def write_shard(path: StorePath, shard: ShardData, run: str, version: int
                ) -> tuple[int, str, tuple[str, ...]]:
    """Write ``shard`` as one safetensors file at ``path`` (atomically; its metadata and its
    temporary name carry the ``run`` id) of a store of format ``version``; return its size,
    digest (``DIGESTS[version]``) and chunk checksums (computed from the written file, read
    back from the page cache)."""
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "version": str(version),
                                               "run": run}}
    begin, tensors = 0, _shard_tensors(shard)
    for key, shape, dtype, _ in tensors:
        end = begin + int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    written: list[Any] = []

    def write(tmp: str) -> None:
        pieces = [memoryview(struct.pack("<Q", len(text)) + text),
                  *(_bytes_of(chunk) for _, _, _, chunks in tensors for chunk in chunks)]
        sums = ChunkSums(CHUNK_BYTES)
        with open(tmp, "wb") as f:
            size, digest = _write_hashed(f, pieces, DIGESTS[version], sums)
        written.extend([size, digest, tuple(sums.finish())])

    write_atomic(path, write, tag=run)
    return written[0], written[1], written[2]


# ------------------------------------------------------------------- staging and background writing
class Staging:
    """Recycled CPU memory ("slabs") that rows wait in until their shard is written.

    Keeping each batch's output tensors instead would take fresh memory every batch, which
    glibc hands back to the OS when a written shard is freed and faults in again: about 20% of
    a small model's forward pass. A shard's slabs return to the pool once it is written, so at
    most the slabs of three shards exist, plus one: a thread of its own prepares the next slab
    (its pages touched) whenever the pool is empty, so the forward pass's thread does not pay
    the page faults of fresh memory. ``close()`` stops that thread.
    """

    def __init__(self, slab_bytes: int):
        self.slab_bytes, self.used = slab_bytes, 0
        self.free: queue.SimpleQueue[Tensor] = queue.SimpleQueue()
        self.slab: Tensor | None = None
        self._wanted, self._closed = threading.Semaphore(1), False  # one slab ready at the start
        self._thread = threading.Thread(target=self._prepare, name="hookscope-slabs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread that prepares slabs."""
        self._closed = True
        self._wanted.release()
        self._thread.join()

    def keep(self, t: Tensor, shard: ShardData) -> Tensor:
        """Return a CPU copy of ``t`` in a slab that ``shard`` owns (or alone, if too big)."""
        size = t.numel() * t.element_size()
        if size == 0 or size > self.slab_bytes:
            return torch.empty(t.shape, dtype=t.dtype).copy_(t)  # compact, on the CPU
        if self.slab is None or self.used + size > self.slab_bytes:
            self.slab, self.used = self._take(), 0
            shard.buffers.append(self.slab)
        kept = self.slab[self.used:self.used + size]
        _serial_copy(kept, t)
        self.used += -(-size // 64) * 64  # keep every tensor 64-byte aligned
        return kept.view(t.dtype).view(t.shape)

    def start_shard(self) -> None:
        """Give the next shard slabs of its own (a shard's slabs are recycled together)."""
        self.slab = None

    def recycle(self, shard: ShardData) -> None:
        """Return the slabs of ``shard``, now written, to the pool (called by the writer)."""
        shard.tensors.clear()
        for slab in shard.buffers:
            self.free.put(slab)
        shard.buffers.clear()

    def _take(self) -> Tensor:
        try:
            slab = self.free.get_nowait()
        except queue.Empty:
            slab = _fresh(self.slab_bytes)
        self._wanted.release()  # prepare the next one meanwhile, if none is free by then
        return slab

    def _prepare(self) -> None:
        while True:
            self._wanted.acquire()
            if self._closed:
                return
            if self.free.empty():
                self.free.put(_touched(self.slab_bytes))


_GRAIN = 32768  # at::internal::GRAIN_SIZE: torch copies fewer elements on the calling thread


def _serial_copy(dest: Tensor, t: Tensor) -> None:
    """Copy ``t`` into ``dest`` (uint8, ``t``'s bytes, contiguous) on this thread alone: a CPU
    tensor laid out densely in pieces of fewer than ``_GRAIN`` elements (8-byte words where
    the bytes allow), anything else by one ``copy_``.

    One ``copy_`` of a large tensor splits over torch's OpenMP threads, and its barrier waits
    for the slowest: beside the writer's two threads of the time (write, sha256) on a 2-core machine, a
    preempted OpenMP thread made copying 256 MiB of rows take 26 ms to 1.5 s (median 62 ms);
    in pieces it took 20 ms, 18 ms on an idle machine where one ``copy_`` took 13
    (``bench/throughput.py``'s extract row; ``torch.set_num_threads(1)`` around the copy did
    as well, but would change a setting of the user's process for every thread). Copying a
    copy-on-write capture (``torch._lazy_clone``) this way reads it without making it a copy
    of its own, which numpy (``Tensor.numpy()``) would."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg() or t.is_quantized:
        dest.view(t.dtype).view(t.shape).copy_(t)
        return
    size = dest.numel()
    source = t.as_strided((t.numel(),), (1,)).view(torch.uint8)  # dense (size-1 axes' strides aside)
    if size % 8 == 0 and t.storage_offset() * t.element_size() % 8 == 0:
        dest, source = dest.view(torch.int64), source.view(torch.int64)
    for at in range(0, dest.numel(), _GRAIN - 1):
        dest[at:at + _GRAIN - 1].copy_(source[at:at + _GRAIN - 1])


def _fresh(nbytes: int) -> Tensor:
    """``nbytes`` of fresh CPU memory (uint8), in transparent huge pages where the kernel offers
    them (``MADV_HUGEPAGE``, Linux): a 64 MiB slab then costs 32 page faults, not 16,384 (it
    was ready in 6 ms instead of 35 here, and a copy into it misses the TLB less). Elsewhere,
    or if the mapping is refused, torch's own allocation."""
    try:
        mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapped.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):  # not Linux, no THP, or nbytes of 0
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the mapping alive


def _touched(nbytes: int) -> Tensor:
    """``nbytes`` of fresh CPU memory (``_fresh``), every page written (numpy's single-threaded
    fill).

    Not ``torch.zeros``: a torch op on this thread starts an OpenMP team of its own, whose
    extra threads stay for the thread's life and change how the forward pass's threads wait
    (libgomp throttles its spinning once it runs more threads than there are CPUs): measured on
    a busy 2-core machine, LeNet's forwards at 2 threads ran 5x faster beside such a team than
    in a bare loop. The forward pass must run as it would without ``extract``."""
    slab = _fresh(nbytes)
    slab.numpy().fill(0)
    return slab


class BackgroundWriter:
    """Writes shards on one thread; ``put`` blocks while a shard is written and another waits."""

    def __init__(self, writer: StoreWriter, staging: Staging):
        self.writer, self.staging = writer, staging
        self.queue: queue.Queue[ShardData | None] = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="hookscope-writer", daemon=True)
        self.thread.start()

    def put(self, shard: ShardData | None) -> None:
        while self.thread.is_alive():
            try:
                self.queue.put(shard, timeout=0.1)
                break
            except queue.Full:
                continue
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Write what is queued, stop the thread, and raise its error if it had one."""
        if self.thread.is_alive():
            self.put(None)
            self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _loop(self) -> None:
        while (shard := self.queue.get()) is not None:
            try:
                self.writer.write(shard)
                self.staging.recycle(shard)
            except BaseException as err:  # noqa: BLE001  (re-raised on the main thread)
                self.error = err
                return



def _part_name(rank: int, world_size: int) -> str:
    return MANIFEST if world_size == 1 else f"manifest-r{rank:04d}.json"


def _shard_name(rank: int, world_size: int, index: int) -> str:
    return f"shard-{index:05d}.safetensors" if world_size == 1 else \
        f"shard-r{rank:04d}-{index:05d}.safetensors"


class StoreWriter:
    """Append the shards of one process to a store folder, replacing its manifest after each.

    With ``world_size == 1`` the process writes ``manifest.json``; rank ``r`` of a multi-process
    run writes ``manifest-rNNNN.json`` (rows counted from 0 on that rank), which ``join_parts``
    merges into ``manifest.json`` once every rank has finished.
    """

    def __init__(self, folder: StorePath, header: dict[str, Any], *, rank: int = 0, world_size: int = 1,
                 resume_from: dict[str, Any] | None = None):
        """Args:
            folder: the store folder; it must exist (``prepare_output``).
            header: manifest fields other than ``complete``, ``rows`` and ``shards``: ``model``,
                ``extract`` (the arguments a resume must repeat), ``layers``, and ``run``, the
                store's run id (32 hex digits; drawn here when missing). It goes into every
                shard's metadata and every temporary name, so that ``hookscope.store.folder``
                can prove those files the store's.
            rank, world_size: this process in a torchrun group (0, 1 alone).
            resume_from: this process's part manifest from an interrupted run, to append to.
        """
        self.folder, self.rank, self.world_size = folder, rank, world_size
        self.run = str(header.get("run") or secrets.token_hex(16))
        self.manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, **header,
                                         "run": self.run,
                                         "complete": False, "rows": 0, "chunk_bytes": CHUNK_BYTES,
                                         "world_size": world_size, "shards": []}
        if world_size > 1:
            self.manifest["rank"] = rank
        self.saved = (0, 0)  # (rows, shards) the manifest in the folder lists now
        if resume_from is not None:  # the store keeps its version (its shards' digest)
            self.manifest.update(version=resume_from["version"], rows=resume_from["rows"],
                                 shards=resume_from["shards"])
            self.saved = (resume_from["rows"], len(resume_from["shards"]))
        else:  # a run killed before its first shard leaves a store that says it is unfinished
            self._save()

    def write(self, shard: ShardData) -> None:
        """Write ``shard`` as the next shard file, then the manifest that lists it (and, for the
        run's ``last`` shard, says the run is complete: one manifest write, not two)."""
        name = self.shard_name(0)
        self.add(name, shard.rows, shard.batches,
                 *write_shard(self.folder / name, shard, self.run, self.manifest["version"]),
                 complete=shard.last)

    def shard_name(self, ahead: int) -> str:
        """The file name of the shard ``ahead`` places after the last one listed (0: the next)."""
        return _shard_name(self.rank, self.world_size, len(self.manifest["shards"]) + ahead)

    def add(self, name: str, rows: int, batches: tuple[int, int], size: int, digest: str,
            sums: tuple[str, ...], *, complete: bool = False) -> None:
        """List the shard ``name`` (already written: ``write_shard``) as the next one, holding
        ``rows`` rows of ``batches``, then replace the manifest (``complete``: marked complete
        in the same write, as ``finish`` would)."""
        start = self.manifest["rows"]
        info = ShardInfo(name, (start, start + rows), batches, size, digest, sums,
                         self.manifest["version"])
        self.manifest["shards"].append(info.to_json())
        self.manifest["rows"] = start + rows
        self.manifest["complete"] = self.manifest["complete"] or complete
        self._save()

    def finish(self) -> None:
        """Mark this process's rows complete (nothing to write when the last shard's manifest
        said so already)."""
        if self.manifest["complete"] and self.saved == (self.manifest["rows"],
                                                         len(self.manifest["shards"])):
            return
        self.manifest["complete"] = True
        self._save()

    def _save(self) -> None:
        text = _manifest_text(self.manifest)
        write_atomic(self.folder / _part_name(self.rank, self.world_size),
                     lambda tmp: Path(tmp).write_bytes(text), tag=self.run)
        self.saved = (self.manifest["rows"], len(self.manifest["shards"]))


def _manifest_text(manifest: dict[str, Any]) -> bytes:
    """JSON with one line per top-level field, per layer and per shard (diff- and grep-friendly)."""
    def field_text(value: Any) -> str:
        if isinstance(value, dict) and value:
            inner = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            return "{\n" + inner + "\n }"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            return "[\n" + ",\n".join(f"  {json.dumps(v)}" for v in value) + "\n ]"
        return json.dumps(value)
    lines = [f" {json.dumps(k)}: {field_text(v)}" for k, v in manifest.items()]
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


def read_part(folder: StorePath, rank: int, world_size: int) -> dict[str, Any] | None:
    """Return what an earlier run in ``folder`` wrote for this process, or ``None``.

    That is ``manifest.json`` once the store is joined (or for a single process), else this
    rank's ``manifest-rNNNN.json``.

    Raises:
        StoreError: the folder was written by a run with another number of processes.
        StoreCorruptError: a manifest cannot be parsed.
    """
    for name in listdir(folder):
        if not fnmatch.fnmatchcase(name, "manifest*.json"):
            continue
        wrote = read_manifest(folder / name).get("world_size", 1)
        if wrote != world_size:
            raise StoreError(
                f"{folder} was written by {wrote} process(es) and this run has {world_size}; "
                f"resume with the same number of processes (torchrun --nproc_per_node={wrote}), "
                f"or start over with overwrite=True (--overwrite).")
    for name in (MANIFEST, _part_name(rank, world_size)):
        if (folder / name).exists():
            return read_manifest(folder / name)
    return None


def join_parts(folder: StorePath, world_size: int) -> None:
    """Merge the part manifests of all ranks into ``manifest.json`` (global row order).

    Rank ``r`` holds a contiguous range of batches that follows rank ``r - 1``'s, so the global
    order is rank 0's rows, then rank 1's, and so on.

    Raises:
        StoreCorruptError: a part is missing, incomplete, of another run, or its batches do not
            follow the last.
    """
    if (folder / MANIFEST).exists():
        return  # joined by an earlier run
    parts = [read_manifest(folder / _part_name(r, world_size)) for r in range(world_size)]
    joined = {k: v for k, v in parts[0].items() if k != "rank"}
    runs = [part.get("run") for part in parts]
    if len(set(runs)) > 1:
        raise StoreCorruptError(f"the parts of {folder} carry different run ids {runs}: one was "
                                f"copied from another run and its shards are not this store's. "
                                f"Extract again (overwrite=True).")
    versions = [part["version"] for part in parts]
    if len(set(versions)) > 1:  # a rank that began after a hookscope upgrade: other digests
        raise StoreCorruptError(f"the parts of {folder} have store versions {versions}: the ranks "
                                f"ran different hookscope releases. Extract again (overwrite=True).")
    for key in ("layers", "columns"):  # a rank without rows has none to describe
        joined[key] = next((p.get(key, {}) for p in parts if p["rows"]), joined.get(key, {}))
    shards: list[dict[str, Any]] = []
    rows, next_batch = 0, None
    for rank, part in enumerate(parts):
        if not part["complete"]:
            raise StoreCorruptError(f"rank {rank} did not finish ({_part_name(rank, world_size)} "
                                    f"is incomplete); resume the run with resume=True.")
        if tensor_specs(part) != tensor_specs(joined) and part["rows"]:
            raise StoreCorruptError(f"rank {rank} wrote layers and columns {tensor_specs(part)}, "
                                    f"rank 0 wrote {tensor_specs(joined)}; the ranks saw "
                                    f"different data.")
        for entry in part["shards"]:
            if next_batch is not None and entry["batches"][0] != next_batch:
                raise StoreCorruptError(f"{entry['file']} starts at batch {entry['batches'][0]}, "
                                        f"but the shard before it ends at batch {next_batch}; "
                                        f"the parts do not join. Extract again (overwrite=True).")
            next_batch = entry["batches"][1]
            shards.append({**entry, "rows": [entry["rows"][0] + rows, entry["rows"][1] + rows]})
        rows += part["rows"]
    joined.update(rows=rows, shards=shards, complete=True)
    text = _manifest_text(joined)
    write_atomic(folder / MANIFEST, lambda tmp: Path(tmp).write_bytes(text),
                 tag=joined.get("run", ""))
    for rank in range(world_size):
        (folder / _part_name(rank, world_size)).unlink()
