"""Extraction: run a model over a data set and stream chosen activations into a store.

``extract(model, data, layers, out)`` runs one forward pass per batch under ``hookscope.capture``,
turns each selected output into rows (reduced, cast, padding dropped), and hands full shards to
a background thread that writes them (``hookscope.store``), so compute and disk overlap. At most
three shards are in memory (one filling, one queued, one being written): about
``3 * shard_bytes``, however large the data set. ``load_data`` makes the data of the CLI's
``--data PATH`` (``hookscope._batches``).

Resume and torchrun both rest on one rule: batch ``k`` of the data is always the same batch. A
resumed run starts at the first batch of the shard that was in progress; under torchrun
(``RANK``/``WORLD_SIZE`` set) rank ``r`` of ``W`` takes the contiguous batches
``[r * B // W, (r + 1) * B // W)`` of ``B``, so rank 0's rows, then rank 1's, ... are the rows of a
single-process run, in its order, computed on identical batches.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from hookscope._batches import BatchSource, load_data
from hookscope._nested import describe_keys, iter_tensors, map_tensors
from hookscope._store_writer import ShardData, StoreWriter, join_parts, prepare_output, read_part
from hookscope.capture import capture
from hookscope.errors import ExtractError
from hookscope.select import resolve
from hookscope.store import LayerInfo, Store, dtype_name, open_store

__all__ = ["extract", "load_data", "Reduce"]

Tensor = torch.Tensor
Reduce = str | Callable[[Tensor], Tensor] | None
Rows = dict[str, tuple[Tensor, Tensor | None]]  # key -> (rows or flat tokens, token counts)


def extract(model: nn.Module, data: Any, layers: str | Sequence[str], out: str | os.PathLike[str],
            *, reduce: Reduce = None, dtype: torch.dtype | None = None, batch_size: int = 32,
            shard_bytes: int = 256 * 2**20, resume: bool = False, overwrite: bool = False,
            progress: bool = True, model_spec: str | None = None, early_stop: bool = False) -> Store:
    """Run ``model`` over ``data`` and store the output of each selected layer, row by row.

    Args:
        model: any ``nn.Module``; it runs in eval mode without grad (its mode is restored).
        data: a ``DataLoader`` (not shuffled), a map-style ``Dataset`` (batched here by
            ``batch_size``), or any iterable of batches. A batch is a tensor (``model(batch)``),
            a dict such as a tokenizer's output (``model(**batch)``; its ``attention_mask``
            marks real tokens), or a tuple/list whose first item is the input (labels ignored).
        layers: patterns as in ``hookscope.select``; each selected module (or output part,
            ``"lstm[0]"``) becomes one store layer. Its output must hold one tensor whose dim 0
            is the batch.
        out: the store folder to create.
        reduce: ``None`` keeps each row whole: with an attention mask, a ``(batch, seq, ...)``
            output keeps only real tokens (a ragged layer). ``"mean"`` averages over tokens
            (honouring the mask) for ``(batch, seq, d)``, over pixels for ``(batch, c, h, w)``
            and leaves ``(batch, d)`` alone; ``"first"``/``"last"`` take the first/last real
            position of dim 1 (CLS / last token); a callable maps ``(batch, ...)`` to
            ``(batch, ...)``.
        dtype: cast floating rows to this dtype before storing (``torch.float16`` halves disk).
        batch_size: batch size when ``data`` is a ``Dataset``; a DataLoader keeps its own.
        shard_bytes: bytes of rows per shard file (the last shard may be smaller).
        resume: continue an interrupted run into ``out`` (same arguments and data).
        overwrite: delete an existing store at ``out`` first.
        progress: show a progress bar (rows/s, MB/s) on stderr (rank 0 only under torchrun).
        model_spec: how the model was made, kept in the manifest (the CLI's ``MODEL``).
        early_stop: stop each forward once every selected layer has returned (the rest of the
            model does not run; same rows, less time for early layers; see ``capture``).

    Returns:
        The finished store, opened (``hookscope.open_store(out)``).

    Raises:
        SelectorError: a pattern matches no module or names a container (before any file).
        StoreExistsError: ``out`` exists and neither ``resume`` nor ``overwrite`` was passed.
        ExtractError: a bad argument, an output that is not one batch-first tensor, rows whose
            shape changes between batches, shuffled data, or a resume with other arguments.
        StoreCorruptError: ``resume`` finds a damaged manifest.
    """
    folder, keys = Path(out), [t.key for t in resolve(model, _patterns(layers))]
    reducer, source = _reducer(reduce), BatchSource(data, batch_size)
    if shard_bytes <= 0:
        raise ExtractError(f"shard_bytes={shard_bytes} must be positive, e.g. 256 * 2**20")
    if resume and overwrite:
        raise ExtractError("resume=True continues the store in place and overwrite=True deletes "
                           "it: pass one of them")
    ranks = _Ranks.start()
    training = model.training
    try:
        model.eval()
        config = {"layers": keys, "reduce": _reduce_name(reduce), "batches": source.count,
                  "dtype": dtype_name(dtype) if dtype else None}
        header = {"model": {"spec": model_spec, "class": _class_name(model)}, "extract": config}
        job = _Job(model, keys, reducer, dtype, source, ranks, progress, early_stop)
        with torch.no_grad():
            _extract(job, folder, header, shard_bytes, resume=resume, overwrite=overwrite)
    finally:
        model.train(training)
        ranks.stop()
    return open_store(folder)


# ------------------------------------------------------------------------------- the run
@dataclass
class _Job:
    model: nn.Module
    keys: list[str]
    reducer: Callable[[Tensor, Tensor | None], Tensor] | None
    dtype: torch.dtype | None
    source: BatchSource
    ranks: _Ranks
    progress: bool
    early_stop: bool = False


def _extract(job: _Job, folder: Path, header: dict[str, Any], shard_bytes: int, *,
             resume: bool, overwrite: bool) -> None:
    ranks = job.ranks
    prior: dict[str, Any] | None = None
    todo: Iterator[tuple[int, Rows]] = iter(())
    start = 0
    try:  # everything that can fail on bad input fails here, before any file is written
        prepare_output(folder, resume=resume, overwrite=overwrite, check_only=True)
        if resume and folder.is_dir():
            prior = read_part(folder, ranks.rank, ranks.world_size)
        _check_resume(prior, header)
        if not (prior and prior["complete"]):
            start, stop = ranks.batch_range(job.source.count)
            start = _resume_batch(prior, start)
            todo, header["layers"] = _first_batch(job, start, stop, prior)
        error = None
    except Exception as err:  # noqa: BLE001  (shared with the other ranks, then re-raised)
        error = err
    ranks.agree(error)
    if ranks.rank == 0:
        prepare_output(folder, resume=resume, overwrite=overwrite, check_only=False)
    ranks.barrier()
    if not (prior and prior["complete"]):
        writer = StoreWriter(folder, header, rank=ranks.rank, world_size=ranks.world_size,
                             resume_from=prior)
        _write_all(job, writer, todo, start, shard_bytes)
    ranks.barrier()
    if ranks.rank == 0 and ranks.world_size > 1:
        join_parts(folder, ranks.world_size)
    ranks.barrier()


def _first_batch(job: _Job, start: int, stop: int | None, prior: dict[str, Any] | None
                 ) -> tuple[Iterator[tuple[int, Rows]], dict[str, Any]]:
    """Run the first batch (the check that model, data and layers fit) and return an iterator
    over the rows of every batch from ``start`` on, with the layers' row specs."""
    batches = job.source.batches(start, stop)
    first = next(batches, None)
    if first is None:
        if job.ranks.world_size == 1 and prior is None:
            raise ExtractError("data yielded no batch: there is nothing to extract")
        return iter(()), prior["layers"] if prior else {}
    rows = _rows(job, first[1])
    rest = ((i, _rows(job, b)) for i, b in batches)
    return itertools.chain([(first[0], rows)], rest), _layer_infos(rows, prior)


def _write_all(job: _Job, writer: StoreWriter, todo: Iterator[tuple[int, Rows]], start: int,
               shard_bytes: int) -> None:
    """Store the rows of every remaining batch, handing full shards to a background writer."""
    staging = _Staging(min(max(shard_bytes, 2**20), 16 * 2**20))
    background = _BackgroundWriter(writer, staging)
    bar = _Progress(job, start)
    layers = writer.manifest["layers"]
    shard = ShardData(batches=(start, start))
    try:
        for index, rows in todo:
            _check_layers(rows, layers, index)
            _append(shard, index, rows, staging)
            bar.update(rows)
            if shard.nbytes >= shard_bytes:
                background.put(shard)
                shard = ShardData(batches=(index + 1, index + 1))
                staging.start_shard()
        if shard.rows:
            background.put(shard)
        background.close()
        writer.finish()
    finally:
        background.close()
        bar.close()


def _append(shard: ShardData, index: int, rows: Rows, staging: _Staging) -> None:
    data, lengths = next(iter(rows.values()))
    n = len(lengths) if lengths is not None else int(data.shape[0])
    shard.append({k: staging.keep(d, shard) for k, (d, _) in rows.items()},
                 {k: c for k, (_, c) in rows.items() if c is not None}, n)
    shard.batches = (shard.batches[0], index + 1)


class _Staging:
    """Recycled CPU memory ("slabs") that rows wait in until their shard is written.

    Keeping each batch's output tensors instead would take fresh memory every batch, which
    glibc hands back to the OS when a written shard is freed and faults in again: about 20% of
    a small model's forward pass. A shard's slabs return to the pool once it is written, so at
    most the slabs of three shards exist.
    """

    def __init__(self, slab_bytes: int):
        self.slab_bytes, self.used = slab_bytes, 0
        self.free: queue.SimpleQueue[Tensor] = queue.SimpleQueue()
        self.slab: Tensor | None = None

    def keep(self, t: Tensor, shard: ShardData) -> Tensor:
        """Return a CPU copy of ``t`` in a slab that ``shard`` owns (or alone, if too big)."""
        size = t.numel() * t.element_size()
        if size == 0 or size > self.slab_bytes:
            return torch.empty(t.shape, dtype=t.dtype).copy_(t)  # compact, on the CPU
        if self.slab is None or self.used + size > self.slab_bytes:
            self.slab, self.used = self._take(), 0
            shard.buffers.append(self.slab)
        kept = self.slab[self.used:self.used + size].view(t.dtype).view(t.shape)
        kept.copy_(t)
        self.used += -(-size // 64) * 64  # keep every tensor 64-byte aligned
        return kept

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
            return self.free.get_nowait()
        except queue.Empty:
            return torch.empty(self.slab_bytes, dtype=torch.uint8)


class _BackgroundWriter:
    """Writes shards on one thread; ``put`` blocks while a shard is written and another waits."""

    def __init__(self, writer: StoreWriter, staging: _Staging):
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


class _Progress:
    """tqdm bar over rows with the MB/s of rows produced; a no-op when disabled.

    The first batch was computed before the bar existed (as a check), so the MB/s clock starts
    at the first update and counts the bytes of the batches after it.
    """

    def __init__(self, job: _Job, start: int):
        shown = job.progress and job.ranks.rank == 0
        total = job.source.rows(start, job.ranks.batch_range(job.source.count)[1])
        self.bar = tqdm(total=total, unit="row", desc="extract", file=sys.stderr, disable=not shown,
                        dynamic_ncols=True)
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


# ------------------------------------------------------------------------- batch -> rows
def _rows(job: _Job, batch: Any) -> Rows:
    """Run one batch; return ``{key: (rows, None)}`` or ``{key: (flat tokens, counts)}``."""
    args, kwargs = _model_inputs(batch)
    device = next(job.model.parameters(), torch.empty(0)).device
    args, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (args, kwargs))
    mask = kwargs.get("attention_mask")
    n = _batch_rows(args, kwargs)
    with capture(job.model, *job.keys, on_unfired="error", early_stop=job.early_stop) as acts:
        job.model(*args, **kwargs)
    return {key: _layer_rows(key, _one_tensor(key, acts[key]), n, mask, job) for key in job.keys}


def _model_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and batch:
        return _model_inputs(batch[0])  # (inputs, labels, ...): the inputs come first
    raise ExtractError(f"a batch is a {type(batch).__name__}; extract takes a tensor "
                       f"(model(batch)), a dict of keyword inputs (model(**batch)) or a tuple/list "
                       f"whose first item is one of those")


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    tensors = list(iter_tensors((args, kwargs)))
    if not tensors or tensors[0].dim() == 0:
        raise ExtractError("a batch holds no tensor with a batch dimension; each batch needs "
                           "one, e.g. (batch, 3, 224, 224) images or (batch, seq) token ids")
    return int(tensors[0].shape[0])


def _one_tensor(key: str, output: Any) -> Tensor:
    tensors = list(iter_tensors(output))
    if isinstance(output, Tensor) or len(tensors) == 1:
        return tensors[0]
    raise ExtractError(
        f"'{key}' returns a {type(output).__name__} holding {len(tensors)} tensors; a store "
        f"layer is one tensor, so name the part to keep, e.g. '{key}[0]' (its parts: "
        f"{describe_keys(output)})")


def _layer_rows(key: str, t: Tensor, n: int, mask: Tensor | None, job: _Job
                ) -> tuple[Tensor, Tensor | None]:
    if t.dim() == 0 or t.shape[0] != n:
        raise ExtractError(f"'{key}' returned shape {tuple(t.shape)}, whose first dimension is "
                           f"not the batch size {n}; a store keeps one row per input, so select "
                           f"a module whose output is batch-first")
    lengths = None
    if job.reducer is not None:
        t = job.reducer(t, mask)
        if t.dim() == 0 or t.shape[0] != n:
            raise ExtractError(f"reduce turned the output of '{key}' into shape "
                               f"{tuple(t.shape)}; it must keep dim 0 (the batch, {n})")
    elif mask is not None and t.dim() >= 2 and t.shape[:2] == mask.shape:
        keep = mask.bool()  # (batch, seq): real tokens only, padding is not stored
        lengths, t = keep.sum(dim=1).to("cpu", torch.int64), t[keep]
    if job.dtype is not None and t.is_floating_point():
        t = t.to(job.dtype)
    return t.detach(), lengths


def _layer_infos(rows: Rows, prior: dict[str, Any] | None) -> dict[str, Any]:
    infos = {key: LayerInfo(key, ((None,) if lengths is not None else ()) +
                            tuple(data.shape[1:]), data.dtype).to_json()
             for key, (data, lengths) in rows.items()}
    if prior is not None and prior["layers"] and prior["layers"] != infos:
        raise ExtractError(f"the layers now give rows {infos}, the interrupted run stored "
                           f"{prior['layers']}: resume with the same model, data and options, or "
                           f"start over with overwrite=True")
    return infos


def _check_layers(rows: Rows, layers: dict[str, Any], index: int) -> None:
    for key, (data, lengths) in rows.items():
        shape = ([None] if lengths is not None else []) + list(data.shape[1:])
        spec = layers[key]
        if shape != spec["shape"] or dtype_name(data.dtype) != spec["dtype"]:
            raise ExtractError(
                f"rows of '{key}' were {tuple(spec['shape'])} {spec['dtype']} and are "
                f"{tuple(shape)} {dtype_name(data.dtype)} in batch {index}; a layer's rows must "
                f"keep one shape: pass reduce='mean' (or 'first'), pad to one length, or give an "
                f"attention_mask so tokens are stored ragged")


# ----------------------------------------------------------------------------- reductions
def _reducer(reduce: Reduce) -> Callable[[Tensor, Tensor | None], Tensor] | None:
    if reduce is None:
        return None
    if callable(reduce):
        return lambda t, mask: reduce(t)
    named = {"mean": _mean, "first": _first, "last": _last}
    if reduce not in named:
        raise ExtractError(f"reduce={reduce!r} is not one of None, 'mean', 'first', 'last' or a "
                           f"function of the (batch, ...) output")
    return named[reduce]


def _reduce_name(reduce: Reduce) -> str | None:
    if callable(reduce):
        return f"{getattr(reduce, '__module__', '?')}.{getattr(reduce, '__qualname__', '?')}"
    return reduce


def _mean(t: Tensor, mask: Tensor | None) -> Tensor:
    if t.dim() >= 3 and mask is not None and t.shape[:2] == mask.shape:
        acc = torch.promote_types(t.dtype, torch.float32)
        weight = mask.to(acc).reshape(*mask.shape, *[1] * (t.dim() - 2))  # (batch, seq, 1, ...)
        return ((t.to(acc) * weight).sum(1) / weight.sum(1).clamp(min=1)).to(t.dtype)
    if t.dim() >= 4:
        return t.mean(dim=tuple(range(2, t.dim())))  # (batch, channels, height, width) -> (batch, c)
    return t.mean(dim=1) if t.dim() == 3 else t


def _position(t: Tensor, mask: Tensor | None, last: bool) -> Tensor:
    if t.dim() < 2:
        raise ExtractError(f"reduce='{'last' if last else 'first'}' picks a position of dim 1, "
                           f"but the output is {tuple(t.shape)}")
    if mask is None or t.shape[:2] != mask.shape:
        return t[:, -1 if last else 0]
    real = mask.bool().flip(1) if last else mask.bool()
    index = real.int().argmax(dim=1)  # first real token (of the flipped mask for last)
    if last:
        index = mask.shape[1] - 1 - index
    return t[torch.arange(t.shape[0], device=t.device), index]


def _first(t: Tensor, mask: Tensor | None) -> Tensor:
    return _position(t, mask, last=False)


def _last(t: Tensor, mask: Tensor | None) -> Tensor:
    return _position(t, mask, last=True)


def _patterns(layers: str | Sequence[str]) -> list[str]:
    return [layers] if isinstance(layers, str) else list(layers)


def _class_name(model: nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _check_resume(prior: dict[str, Any] | None, header: dict[str, Any]) -> None:
    if prior is None:
        return
    changed = {k: (prior["extract"].get(k), v) for k, v in header["extract"].items()
               if prior["extract"].get(k) != v}
    if changed:
        listing = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ExtractError(f"cannot resume: the arguments differ from the interrupted run's "
                           f"({listing}). Resume with the same arguments and data, or start "
                           f"over with overwrite=True (--overwrite).")


def _resume_batch(prior: dict[str, Any] | None, start: int) -> int:
    if prior is None or not prior["shards"]:
        return start
    return int(prior["shards"][-1]["batches"][1])


# ---------------------------------------------------------------------------- torchrun
@dataclass
class _Ranks:
    """This process in a torchrun group (rank 0 of 1 when alone)."""

    rank: int
    world_size: int
    owns_group: bool

    @staticmethod
    def start() -> _Ranks:
        """Join the torch.distributed group that torchrun's environment describes (gloo)."""
        if dist.is_available() and dist.is_initialized():
            return _Ranks(dist.get_rank(), dist.get_world_size(), False)
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return _Ranks(0, 1, False)
        if not dist.is_available():
            raise ExtractError("WORLD_SIZE > 1 but this torch has no torch.distributed")
        dist.init_process_group("gloo")
        return _Ranks(dist.get_rank(), dist.get_world_size(), True)

    def batch_range(self, count: int | None) -> tuple[int, int | None]:
        """Return this rank's contiguous batch range ``[start, stop)``."""
        if self.world_size == 1:
            return 0, None
        if count is None:
            raise ExtractError("under torchrun the data must have a length (a Dataset, or a "
                               "DataLoader over one) so that each rank can take its part")
        return self.rank * count // self.world_size, (self.rank + 1) * count // self.world_size

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank failed (its own error, or which rank failed)."""
        if self.world_size > 1:
            found: list[str | None] = [None] * self.world_size
            dist.all_gather_object(found, None if error is None else str(error))
            failed = [(r, m) for r, m in enumerate(found) if m is not None]
            if failed and error is None:
                raise ExtractError(f"rank {failed[0][0]} failed before writing: {failed[0][1]}")
        if error is not None:
            raise error

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def stop(self) -> None:
        if self.owns_group:
            dist.destroy_process_group()
