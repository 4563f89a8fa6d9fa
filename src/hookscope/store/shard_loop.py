"""The shard loop: batches' rows into shard files, in this process (a background writer) or on Ray
actors (``write_batch_range``), with its progress bar."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hookscope.errors import (
    ExtractInterrupted,
)
from hookscope.record import (
    capture,
)
from hookscope.store.batch_rows import Rows, _check_layers, _Job, _rows
from hookscope.store.fs import StorePath
from hookscope.store.manifest import tensor_specs
from hookscope.store.ranks import Ranks
from hookscope.store.ray_engine import (
    RayEngine,
    ShardMade,
    Work,
    write_on_ray,
)
from hookscope.store.writer import (
    BackgroundWriter,
    ShardData,
    Staging,
    StoreWriter,
    write_shard,
)

__all__ = ["write_batch_range"]

Tensor = torch.Tensor


def _write_all(job: _Job, writer: StoreWriter, todo: Iterator[tuple[int, Rows]],
               start: int) -> None:
    """Store the rows of every remaining batch, handing full shards to a background writer."""
    staging = Staging(_slab_bytes(job))
    try:
        job.session = capture(job.model, *job.keys, on_unfired="ignore", early_stop=job.early_stop)
        with job.session:
            _write_batches(job, writer, todo, start, staging)
    finally:
        staging.close()


def _slab_bytes(job: _Job) -> int:
    """Bytes per staging slab: room for about four batches of rows (measured on the first
    batch), at least 1 MiB, at most 16 MiB and at most a shard. Each slab is zeroed ahead of
    use by the staging thread, so a slab far larger than the rows costs CPU time for nothing
    (16 MiB for a batch of 120 KiB: about 5 ms per extraction on a 2-core machine)."""
    return min(max(job.shard_bytes, 2**20), 16 * 2**20, max(4 * job.batch_bytes, 2**20))


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _write_on_ray(job: _Job, engine: RayEngine, folder: StorePath, writer: StoreWriter,
                  prior: dict[str, Any] | None, start: int) -> None:
    """Write batches ``start:`` on Ray actors, this process listing their shards."""
    if not write_on_ray(engine, _for_workers(job, engine, folder, writer), writer, start,
                        _batches_per_shard(job, prior), job.source.count or 0,
                        progress=job.progress, stop=job.stop):
        _interrupted(writer)
    writer.finish()


def _batches_per_shard(job: _Job, prior: dict[str, Any] | None) -> int:
    """Batches per shard on Ray: those of the interrupted run's first shard, else as many as
    one process puts in a shard when every batch has the first one's bytes (it closes a shard
    once its rows reach ``shard_bytes``): ``ceil(shard_bytes / batch_bytes)``."""
    if prior is not None and prior["shards"]:
        first = prior["shards"][0]["batches"]
        return int(first[1] - first[0])
    if not job.batch_bytes:
        return max(job.source.count or 1, 1)  # rows of no bytes never fill a shard
    return max(1, -(-job.shard_bytes // job.batch_bytes))


def _worker_copy(job: _Job) -> _Job:
    """The job a Ray actor runs: this one without the state of this process's run."""
    return dataclasses.replace(job, ranks=Ranks(0, 1, False), engine=None, shared=None,
                               device=None, session=None, stop=None, progress=False)


def _for_workers(job: _Job, engine: RayEngine, folder: StorePath, writer: StoreWriter) -> Work:
    """What a Ray actor runs for one shard: ``write_batch_range`` over the shared copy of the
    job, bound to this run's folder (made absolute: an actor's working directory is not this
    process's on a cluster, or after a ``chdir`` here), run id and layers."""
    device = "cuda" if engine.num_gpus > 0 else None
    where = folder.absolute() if isinstance(folder, Path) else folder
    return write_batch_range, job.shared, (where, writer.run, writer.manifest["version"],
                                           tensor_specs(writer.manifest), device)


def write_batch_range(job: _Job, folder: StorePath, run: str, version: int, layers: dict[str, Any],
                      device: str | None, name: str, start: int, stop: int) -> ShardMade:
    """Run batches ``start:stop`` and write their rows as the shard file ``folder/name`` (a
    Ray actor's unit of work: the same per-batch code as ``_write_batches``), with the model
    moved to ``device`` first unless it is ``None``.

    Returns:
        ``(rows, bytes, digest, chunk sums)`` of the shard written (a store of ``version``).

    Raises:
        ExtractError: as ``extract`` does for a batch whose rows do not fit ``layers``.
    """
    if device is not None:
        job.model.to(device)
    staging = Staging(_slab_bytes(job))
    shard = ShardData(batches=(start, start))
    try:
        with torch.no_grad(), capture(job.model.eval(), *job.keys, on_unfired="ignore",
                                      early_stop=job.early_stop) as job.session:
            for index, batch, ids in job.source.batches(start, stop):
                _keep_batch(shard, index, _rows(job, batch, ids), layers, staging)
        return (shard.rows, *write_shard(folder / name, shard, run, version))
    finally:
        job.session = None
        staging.close()


def _write_batches(job: _Job, writer: StoreWriter, todo: Iterator[tuple[int, Rows]], start: int,
                   staging: Staging) -> None:
    background = BackgroundWriter(writer, staging)
    bar = _Progress(job, start, writer.manifest["rows"])
    layers = tensor_specs(writer.manifest)
    shard, started = ShardData(batches=(start, start)), time.monotonic()
    try:
        for index, rows in todo:
            _keep_batch(shard, index, rows, layers, staging)
            bar.update(rows)
            if shard.nbytes >= job.shard_bytes or \
                    time.monotonic() - started >= job.shard_seconds:
                background.put(shard)
                shard, started = ShardData(batches=(index + 1, index + 1)), time.monotonic()
                staging.start_shard()
            if job.stop is not None and job.stop.asked:
                break
        if shard.rows:
            shard.last = job.stop is None or not job.stop.asked  # its manifest ends the run
            background.put(shard)
        background.close()
        if job.stop is not None and job.stop.asked and not writer.manifest["complete"]:
            _interrupted(writer)  # (a stop asked once the last shard was on its way: all stored)
        writer.finish()
    finally:
        background.close()
        bar.close()


def _interrupted(writer: StoreWriter) -> None:
    """Raise ``ExtractInterrupted`` saying what a graceful stop kept and how to go on."""
    rows, folder = writer.manifest["rows"], str(writer.folder)
    where = "this rank's " if writer.world_size > 1 else ""
    raise ExtractInterrupted(
        f"extract interrupted: {where}{rows} rows are stored in {folder} "
        f"({len(writer.manifest['shards'])} shards, the open one included); continue with the "
        f"same arguments and resume=True (--resume)", rows=rows, out=folder)


def _keep_batch(shard: ShardData, index: int, rows: Rows, layers: dict[str, Any],
                staging: Staging) -> None:
    """Add batch ``index``'s rows to ``shard`` once they fit ``layers`` (every engine's step)."""
    _check_layers(rows, layers, index)
    data, lengths = next(iter(rows.values()))
    n = len(lengths) if lengths is not None else int(data.shape[0])
    shard.append({k: staging.keep(d, shard) for k, (d, _) in rows.items()},
                 {k: c for k, (_, c) in rows.items() if c is not None}, n)
    shard.batches = (shard.batches[0], index + 1)


class _Progress:
    """tqdm bar over rows with the MB/s of rows produced; a no-op when disabled.

    The first batch was computed before the bar existed (as a check), so the MB/s clock starts
    at the first update and counts the bytes of the batches after it. A resumed run's bar
    starts at the rows the store kept, out of the whole run's.
    """

    def __init__(self, job: _Job, start: int, kept: int):
        shown = job.progress and job.ranks.rank == 0
        first, stop = job.ranks.batch_range(job.source.count)
        total = job.source.rows(first, stop)  # kept rows (a resumed run's) count as done
        self.bar = tqdm(total=total, initial=kept, unit="row", desc="extract", file=sys.stderr,
                        disable=not shown, dynamic_ncols=True)
        self.bytes, self.since = 0, 0.0

    def update(self, rows: Rows) -> None:
        data, lengths = next(iter(rows.values()))
        self.bar.update(len(lengths) if lengths is not None else int(data.shape[0]))
        if not self.since:
            self.since = time.perf_counter()
            return
        self.bytes += sum(d.numel() * d.element_size() for d, _ in rows.values())
        rate = self.bytes / max(time.perf_counter() - self.since, 1e-9) / 2**20
        self.bar.set_postfix_str(f"{rate:.1f} MB/s", refresh=False)

    def close(self) -> None:
        self.bar.close()
