"""Extraction: run a model over a data set and stream chosen activations into a store.

``extract(model, data, layers, out)`` runs one forward pass per batch under one
``hookscope.capture`` session kept open across the batches (``clear()`` between them; the first
batch runs in a capture of its own, which checks that model, data and layers fit and says why a
module did not run), turns each selected output into rows (reduced, cast, padding dropped), and
hands full shards to a background thread that writes them (``hookscope.store``), so compute and
disk overlap. At most
three shards are in memory (one filling, one queued, one being written): about
``3 * shard_bytes``, however large the data set. ``load_data`` makes the data of the CLI's
``--data PATH`` (``hookscope.store.batches``).

A shard is closed when it holds ``shard_bytes`` of rows or when ``shard_seconds`` have passed
since it was started, whichever comes first, so a killed run loses at most about
``shard_seconds`` of work however small the data set is.

Resume, torchrun and Ray rest on one rule: batch ``k`` of the data is always the same batch. A
resumed run starts at the first batch of the shard that was in progress; under torchrun each
rank takes a contiguous block of batches (``hookscope.store.ranks``); with ``engine="ray"``
actors run ``write_batch_range`` (the same per-batch code) for one shard's batches each and
this process lists their shards (``hookscope.store.ray_engine``). Reductions are
``hookscope.reductions``; writing, staging and the writer thread ``hookscope.store.writer``; what
an output folder may hold ``hookscope.store.folder``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from hookscope.engine import (
    GracefulStop,
    Tokens,
    as_patterns,
    batch_first,
    brief,
    check_no_unmasked_padding,
    input_device,
    kind_of,
    model_inputs,
    one_index_per_call,
    resolve,
    rows_for,
    untouched,
    values_for,
)
from hookscope.errors import (
    ExtractError,
    ExtractInterrupted,
    HookNeverFiredError,
    HookscopeError,
    MisalignedLabelsWarning,
    SelectorError,
    StoreFaultError,
    warn,
)
from hookscope.record import (
    REDUCTIONS,
    Capture,
    Reduce,
    Reduction,
    capture,
    reduction,
    reduction_name,
)
from hookscope.store.batches import BatchSource
from hookscope.store.folder import check_output, prepare_output, writing
from hookscope.store.fs import StorePath, location
from hookscope.store.layers import _ST_DTYPES, LayerInfo, dtype_name
from hookscope.store.manifest import COLUMN_PREFIX, tensor_specs
from hookscope.store.ranks import Ranks
from hookscope.store.ray_engine import (
    Engine,
    RayEngine,
    ShardMade,
    Work,
    as_engine,
    check_data,
    check_reachable,
    share,
    write_on_ray,
)
from hookscope.store.reader import Store, open_store
from hookscope.store.writer import (
    BackgroundWriter,
    ShardData,
    Staging,
    StoreWriter,
    join_parts,
    read_part,
    write_shard,
)
from hookscope.util import describe_keys, iter_tensors, map_tensors

__all__ = ["Reduce", "check_output", "extract", "SHARD_BYTES", "SHARD_SECONDS", "write_batch_range"]

Tensor = torch.Tensor
SHARD_BYTES = 256 * 2**20
SHARD_SECONDS = 60.0
Rows = dict[str, tuple[Tensor, Tensor | None]]  # key -> (rows or flat tokens, token counts)


@one_index_per_call
def extract(model: nn.Module, data: Any, layers: str | Sequence[str], out: str | os.PathLike[str],
            *, reduce: Reduce = None, dtype: torch.dtype | None = None, batch_size: int = 32,
            shard_bytes: int = SHARD_BYTES, shard_seconds: float = SHARD_SECONDS,
            resume: bool = False, overwrite: bool = False, progress: bool = True,
            model_spec: str | None = None, early_stop: bool = False, engine: Engine = "local",
            storage_options: dict[str, Any] | None = None) -> Store:
    """Run ``model`` over ``data`` and store the output of each selected layer, row by row.

    Args:
        model: any ``nn.Module``; it runs in eval mode without grad, and is left as it was
            found (mode, buffers, ``requires_grad``, ``.grad``, RNG; ``engine.run.untouched``).
        data: a ``DataLoader`` (not shuffled), a map-style ``Dataset`` (batched here by
            ``batch_size``), or any iterable of batches. A batch is a tensor (``model(batch)``),
            a dict such as a tokenizer's output (``model(**batch)``; its ``attention_mask``
            marks real tokens, and an encoder-decoder's ``decoder_attention_mask`` those of its
            decoder layers), or a tuple/list ``(inputs, labels, ...)`` whose first item is
            the inputs: a tensor, a dict, or a tuple of positional inputs (labels ignored).
        layers: patterns as in ``hookscope.select``; each selected module (or output part,
            ``"lstm[0]"``) becomes one store layer. Its output must hold one tensor whose dim 0
            is the batch, or whose layout says where the batch is (``engine.values.layout.TOKEN_AXES``:
            a sequence-first ``nn.MultiheadAttention``, a ``Conv1d``'s ``(batch, channels,
            length)``): rows are stored as ``(batch, seq, ...)``.
        out: the store folder to create, a path or any fsspec URL (``s3://bucket/acts``,
            ``gs://``, ``memory://``, ``file://``; ``hookscope.store.fs`` says how a store keeps
            its guarantees there); its missing parent folders are created too (the
            Python API's rule for ``out=``/``plot=``, as in ``patching_sweep`` and
            ``logit_lens``; the CLI refuses a missing parent unless ``--parents``).
        reduce: ``None`` keeps each row whole: with an attention mask, a ``(batch, seq, ...)``
            output keeps only real tokens (a ragged layer). ``"mean"`` averages over tokens
            (honouring the mask) for ``(batch, seq, d)``, over pixels for ``(batch, c, h, w)``
            and leaves ``(batch, d)`` alone; ``"first"``/``"last"`` take the first/last real
            token of a ``(batch, seq, d)`` output (CLS / last token) and refuse outputs without
            a token axis; a callable maps ``(batch, ...)`` to ``(batch, ...)``
            (``hookscope.reductions``).
        dtype: cast floating rows to this dtype before storing (``torch.float16`` halves disk).
        batch_size: batch size when ``data`` is a ``Dataset``; a DataLoader keeps its own.
        shard_bytes: bytes of rows per shard file at most (the last shard may be smaller).
        shard_seconds: a shard is also closed once this many seconds have passed since it was
            started, so a killed run loses at most about this much work (default 60).
        resume: continue an interrupted run into ``out`` (same arguments and data); a missing
            or empty ``out`` starts afresh (with a warning).
        overwrite: delete the store at ``out`` first: only the files its manifest lists and its
            own temporary files; anything else there makes it refuse (``StoreExistsError``).
        progress: show a progress bar (rows/s, MB/s) on stderr (rank 0 only under torchrun).
        model_spec: how the model was made, kept in the manifest (the CLI's ``MODEL``).
        early_stop: stop each forward once every selected layer has returned (the rest of the
            model does not run; same rows, less time for early layers; see ``capture``).
        engine: ``"local"`` runs in this process (or in each torchrun rank); ``"ray"``, or a
            ``RayEngine`` with options, hands the batches to Ray actors, each holding a copy of
            ``model`` (pickled once, with cloudpickle), which load their own rows of ``data``
            and write whole shards while this process writes the manifest: the store is the one
            this process would write (``hookscope.store.ray_engine``, which says when it is
            byte for byte the same). ``shard_seconds`` does not apply there (shards are sized
            by ``shard_bytes`` alone, so a store is reproducible); a Ctrl-C keeps the shards
            finished in order. ``out`` may be a URL (``s3://``): each actor uploads its own
            shards, with ``storage_options`` sent along; not ``memory://`` (one per process).
        storage_options: for a URL ``out``, fsspec's options (credentials, ``client_kwargs``
            such as an ``endpoint_url``); without them the environment's credentials apply.
            Never written into the store.

    Besides the layers, the store keeps what each row was (``store.ids``, ``store.labels``;
    README, "Store format"): for a DataLoader over a map-style data set, the data-set index of
    each row (or ``dataset.row_id(i)``, a str, when the data set defines it: ``--data FOLDER``
    stores the file path relative to the folder); for ``(inputs, labels, ...)`` batches, the
    labels (a tensor whose dim 0 is the batch, or one str per row). Rows of other iterables are
    known by their row number.

    A first Ctrl-C (SIGINT, main thread) stops the run once the batch in progress is stored,
    writing the rows of the open shard too; a second one stops it at once.

    Returns:
        The finished store, opened (``hookscope.open_store(out)``).

    Raises:
        SelectorError: a pattern matches no module or names a container (before any file).
        StoreExistsError: ``out`` exists and neither ``resume`` nor ``overwrite`` was passed,
            or ``out`` holds a file that is not the store's (named), with either.
        ExtractError: an argument of the wrong kind (named, before anything runs: a model that
            is not an ``nn.Module``, ``out`` that is not a path, ``dtype`` that is not a
            floating ``torch.dtype``, a ``batch_size``/``shard_bytes`` that is not a positive
            int, a flag that is not a bool), a reduce that returns no tensor, an output that is
            not one batch-first tensor, rows whose shape changes between batches, shuffled
            data, or a resume with other arguments; ``out`` a URL whose fsspec file system is not
            installed (``s3fs`` for ``s3://``), or ``storage_options`` that is not a dict or comes
            with a local folder; ``engine="ray"`` with a ``memory://`` ``out``, which the
            actors cannot reach.
        StoreCorruptError: ``resume`` finds a damaged manifest.
        StoreFaultError: ``out`` is at a URL whose bucket does not exist (never created), or
            its object store fails (unreachable, credentials refused, a transient fault on
            every one of its bounded retries: ``hookscope.store.faults``); the message names
            the URL, the endpoint and what to check, and, once rows were written, how many
            the store keeps and that ``resume=True`` continues it.
        PositionError: ``reduce`` is ``"first"``/``"last"``/``"mean"`` and a batch looks padded
            (runs of ``config.pad_token_id``) but has no ``attention_mask`` (nothing written).
        ExtractInterrupted: a Ctrl-C stopped the run gracefully (a ``KeyboardInterrupt``; its
            ``rows`` were written, the open shard's included); ``resume=True`` continues.
    """
    _check_arguments(model, out, dtype, batch_size, shard_bytes, shard_seconds, model_spec,
                     {"resume": resume, "overwrite": overwrite, "progress": progress,
                      "early_stop": early_stop})
    folder = location(out, ExtractError, storage_options)
    targets = resolve(model, as_patterns(layers))
    keys = [t.key for t in targets]
    reducer, source = reduction(reduce), BatchSource(data, batch_size)
    if resume and overwrite:
        raise ExtractError("resume=True continues the store in place and overwrite=True deletes "
                           "it: pass one of them")
    on_ray = as_engine(engine)
    ranks = Ranks.start()
    try:
        if on_ray is not None and ranks.world_size > 1:
            raise ExtractError("engine='ray' runs one driver that hands the batches to Ray "
                               "actors; run it as one process, not under torchrun")
        if on_ray is not None:
            check_reachable(folder)
        config = {"layers": keys, "reduce": reduction_name(reduce), "batches": source.count,
                  "dtype": dtype_name(dtype) if dtype else None, "batch_size": source.batch_size}
        header = {"model": {"spec": model_spec, "class": _class_name(model)}, "extract": config}
        standard = {name: t.key for t in targets for name in t.standard}
        if standard:  # store["resid_post.1"] reads the layer it was extracted by
            header["standard_names"] = standard
        job = _Job(model, keys, reducer, dtype, source, ranks, progress, shard_bytes, shard_seconds,
                   early_stop, on_ray)
        # the stop first: hookscope's own interrupt guards (untouched, capture) stand in for it
        with GracefulStop(_STOP_MESSAGE) as job.stop, untouched(model), torch.no_grad():
            model.eval()  # untouched: once around the loop; restores the mode too
            _extract(job, folder, header, resume=resume, overwrite=overwrite)
    finally:
        ranks.stop()
    return open_store(out, storage_options=storage_options)


def _check_arguments(model: Any, out: Any, dtype: Any, batch_size: Any, shard_bytes: Any,
                     shard_seconds: Any, model_spec: Any, flags: dict[str, Any]) -> None:
    """Raise ``ExtractError`` naming the first argument of the wrong kind (before any run)."""
    floats = sorted(dtype_name(d) for d in _ST_DTYPES if d.is_floating_point)
    checks = [
        ("model", model, isinstance(model, nn.Module), "an nn.Module, e.g. resnet18()"),
        ("out", out, isinstance(out, (str, os.PathLike)), "a folder path, e.g. 'features/'"),
        ("dtype", dtype, dtype is None or (isinstance(dtype, torch.dtype) and dtype in _ST_DTYPES
                                    and dtype.is_floating_point),
         f"None or a floating torch.dtype a store holds ({', '.join(floats)}), e.g. "
         f"torch.float16"),
        ("batch_size", batch_size, type(batch_size) is int and batch_size > 0, "a positive int, e.g. 32"),
        ("shard_bytes", shard_bytes, type(shard_bytes) is int and shard_bytes > 0,
         f"a positive int, e.g. {SHARD_BYTES}"),
        ("shard_seconds", shard_seconds, type(shard_seconds) in (int, float) and shard_seconds > 0,
         f"a positive number of seconds, e.g. {SHARD_SECONDS}"),
        ("model_spec", model_spec, model_spec is None or isinstance(model_spec, str), "None or a str"),
        *((name, value, type(value) is bool, "True or False") for name, value in flags.items()),
    ]
    for name, value, ok, want in checks:
        if not ok:
            raise ExtractError(f"extract({name}={brief(value)}): {name} must be {want}; got "
                               f"{type(value).__name__}")


# ------------------------------------------------------------------------------- the run
@dataclass
class _Job:
    model: nn.Module
    keys: list[str]
    reducer: Reduction | None
    dtype: torch.dtype | None
    source: BatchSource
    ranks: Ranks
    progress: bool
    shard_bytes: int
    shard_seconds: float
    early_stop: bool = False
    engine: RayEngine | None = None  # None: this process writes its shards itself
    shared: Any = None  # on Ray: the reference of the job's copy the actors run (_worker_copy)
    device: torch.device | None = None  # where inputs go (input_device), found once per run
    batch_bytes: int = 0  # bytes of the first batch's rows, to size the staging slabs
    session: Capture | None = None  # the capture open across the batches after the first
    stop: GracefulStop | None = None  # set while the run is on: a Ctrl-C asks it to stop

#: what a first Ctrl-C says (``engine.GracefulStop``): the run ends once the batch is stored
_STOP_MESSAGE = ("\nextract: Ctrl-C: stopping once this batch is stored (Ctrl-C again to stop at "
                 "once, losing the rows of the open shard)")


def _extract(job: _Job, folder: StorePath, header: dict[str, Any], *,
             resume: bool, overwrite: bool) -> None:
    ranks = job.ranks
    prior: dict[str, Any] | None = None
    todo: Iterator[tuple[int, Rows]] = iter(())
    start = 0
    try:  # everything that can fail on bad input fails here, before any file is written
        check_output(folder, resume=resume, overwrite=overwrite)
        if resume and folder.is_dir():
            prior = read_part(folder, ranks.rank, ranks.world_size)
        _check_resume(prior, header)
        if job.engine is not None:
            check_data(job.source.count)
        if not (prior and prior["complete"]):
            start, stop = ranks.batch_range(job.source.count)
            start = _resume_batch(prior, start)
            todo, specs = _first_batch(job, start, stop, prior)
            header["layers"], header["columns"] = _split(specs)
            if job.engine is not None:  # pickled now: a model that cannot be fails here
                job.shared = share(job.engine, _worker_copy(job))
        _say_resumed(job, folder, prior, start)
        error = None
    except Exception as err:  # noqa: BLE001  (shared with the other ranks, then re-raised)
        error = err
    ranks.agree(error)
    header["run"] = ranks.share(prior.get("run") if prior else None, secrets.token_hex(16))
    with writing(folder) if ranks.world_size == 1 else contextlib.nullcontext():
        _write_store(job, folder, header, prior, todo, start, resume=resume, overwrite=overwrite)


def _write_store(job: _Job, folder: StorePath, header: dict[str, Any], prior: dict[str, Any] | None,
                 todo: Iterator[tuple[int, Rows]], start: int, *, resume: bool,
                 overwrite: bool) -> None:
    """Make the folder ready (rank 0), write this rank's rows, join the ranks' parts."""
    ranks = job.ranks
    if ranks.rank == 0:
        prepare_output(folder, resume=resume, overwrite=overwrite)
    ranks.barrier()
    if not (prior and prior["complete"]):
        writer = None
        try:
            writer = StoreWriter(folder, header, rank=ranks.rank, world_size=ranks.world_size,
                                 resume_from=prior)
            if job.engine is not None:
                _write_on_ray(job, job.engine, folder, writer, prior, start)
            else:
                _write_all(job, writer, todo, start)
        except StoreFaultError as err:
            saved = writer.saved if writer is not None else \
                (prior["rows"], len(prior["shards"])) if prior else (0, 0)
            raise _fault_in_run(err, folder, *saved) from err
    ranks.barrier()
    if ranks.rank == 0 and ranks.world_size > 1:
        join_parts(folder, ranks.world_size)
    ranks.barrier()


def _fault_in_run(err: StoreFaultError, folder: StorePath, rows: int,
                  shards: int) -> StoreFaultError:
    """``err``, met while writing, with what the store keeps and how to go on (as a Ctrl-C
    says it: ``_interrupted``)."""
    return StoreFaultError(
        f"{err}\nextract stopped: {rows} rows are kept in {folder} ({shards} shard"
        f"{'s' if shards != 1 else ''} listed by its manifest, each whole); once the store is "
        f"reachable, continue with the same arguments and resume=True (--resume)")


def _first_batch(job: _Job, start: int, stop: int | None, prior: dict[str, Any] | None
                 ) -> tuple[Iterator[tuple[int, Rows]], dict[str, Any]]:
    """Run the first batch (the check that model, data and layers fit) and return an iterator
    over the rows of every batch from ``start`` on, with the layers' row specs."""
    batches = job.source.batches(start, stop)
    first = next(batches, None)
    if first is None:
        if job.ranks.world_size == 1 and prior is None:
            raise ExtractError("data yielded no batch: there is nothing to extract")
        return iter(()), tensor_specs(prior) if prior else {}
    rows = _rows(job, first[1], first[2])
    job.batch_bytes = sum(_nbytes(d) + (_nbytes(c) if c is not None else 0)
                          for d, c in rows.values())
    rest = ((i, _rows(job, b, ids)) for i, b, ids in batches)
    return itertools.chain([(first[0], rows)], rest), _layer_infos(rows, prior)


def _split(specs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Row specs by shard tensor name -> (the manifest's ``layers``, its ``columns``)."""
    layers = {k: v for k, v in specs.items() if not k.startswith(COLUMN_PREFIX)}
    return layers, {k.removeprefix(COLUMN_PREFIX): v for k, v in specs.items()
                    if k.startswith(COLUMN_PREFIX)}


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
            background.put(shard)
        background.close()
        if job.stop is not None and job.stop.asked:
            _interrupted(writer)
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


# ------------------------------------------------------------------------- batch -> rows
def _rows(job: _Job, batch: Any, ids: list[Any] | None) -> Rows:
    """Run one batch; return ``{key: (rows, None)}`` or ``{key: (flat tokens, counts)}`` for
    each layer, then the columns ``@id`` (``ids``) and ``@label`` (the batch's labels)."""
    try:
        args, kwargs = model_inputs(batch)
    except HookscopeError as err:
        raise ExtractError(str(err)) from None
    if job.device is None:  # the model stays where it is during the run: look once
        job.device = input_device(job.model)
    device = job.device
    args, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (args, kwargs))
    mask = kwargs.get("attention_mask")
    n = _batch_rows(args, kwargs)
    if job.session is None:  # the first batch: a capture of its own, which says why a module
        acts = _first_capture(job, args, kwargs)  # did not run, or ran more than once
    else:
        acts = job.session
        acts.clear()
        with acts.forward_boundary():
            job.model(*args, **kwargs)
        acts.check_writes()
        _check_calls(acts, job.keys)
    rows = {key: _layer_rows(key, acts[key], n, acts.tokens(key), job, _axes(acts, key))
            for key in job.keys}
    tokens = mask if job.reducer is None else None  # ragged layers: token labels go ragged too
    # the @token column holds the root's input_ids: only for layers of the root's tokens (not
    # an encoder-decoder's decoder layers, ragged by a mask of their own)
    own = all(acts.tokens(key).mask is mask for key, (_, lengths) in rows.items() if lengths is not None)
    token_ids = _token_ids(kwargs, mask, rows) if own else {}
    if mask is None and job.reducer is None:
        token_ids = _packed_ids(args, kwargs, rows)
    return {**rows, **_columns(batch, ids, n, tokens), **token_ids}


def _packed_ids(args: tuple[Any, ...], kwargs: dict[str, Any], rows: Rows) -> Rows:
    """The ``@token`` column of packed windows: a batch of ``(batch, seq)`` integer token ids
    (``input_ids``, or the one positional input) without an attention mask, every token real,
    when a layer keeps a ``(batch, seq, ...)`` row per window. Stored as ``(seq,)`` rows beside
    the layer, so ``Store.tokens`` flattens the layer's windows and their ids alike."""
    ids = kwargs.get("input_ids")
    if ids is None and len(args) == 1 and not kwargs:
        ids = args[0]
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point() or \
            ids.is_complex() or ids.dtype == torch.bool:
        return {}
    seq = ids.shape[1]
    if not any(lengths is None and data.dim() >= 2 and data.shape[1] == seq
               for data, lengths in rows.values()):
        return {}
    return {COLUMN_PREFIX + "token": (ids.to("cpu", torch.int64), None)}


def _token_ids(kwargs: dict[str, Any], mask: Tensor | None, rows: Rows) -> Rows:
    """The ``@token`` column: when a layer is stored as tokens (ragged, padding dropped by the
    ``attention_mask``) and the batch gives ``input_ids`` of the mask's ``(batch, seq)`` shape,
    the ids of the real tokens, flat, with their counts per row: token ``t`` of row ``i`` of
    the column is the id of token ``t`` of row ``i`` of every ragged layer (``Store.tokens``)."""
    ids = kwargs.get("input_ids")
    if mask is None or not isinstance(ids, Tensor) or ids.shape != mask.shape or \
            ids.is_floating_point() or all(lengths is None for _, lengths in rows.values()):
        return {}
    keep = mask.bool()
    return {COLUMN_PREFIX + "token": (ids[keep].to("cpu", torch.int64),
                                      keep.sum(dim=1).to("cpu", torch.int64))}


def _columns(batch: Any, ids: list[Any] | None, n: int, mask: Tensor | None = None) -> Rows:
    """The ``@id`` and ``@label`` rows of a batch of ``n`` rows: ``ids`` (data-set indices or
    ``row_id`` strings) and, for a ``(inputs, labels, ...)`` batch, its labels (a tensor whose
    dim 0 is the batch, or ``n`` strings). Token labels ``(batch, seq)`` of a padded batch
    whose layers are stored ragged (``mask``: its ``attention_mask``) do not line up with the
    stored tokens: ``MisalignedLabelsWarning`` says so (a store's numeric columns are not
    ragged)."""
    columns: Rows = {}
    if ids is not None:
        columns[COLUMN_PREFIX + "id"] = _column("the data set's row ids", ids, n)
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        labels = batch[1]
        if isinstance(labels, Tensor):
            if labels.dim() == 0 or labels.shape[0] != n or labels.dtype not in _ST_DTYPES:
                raise ExtractError(
                    f"the labels of an (inputs, labels) batch are a {labels.dtype} tensor of "
                    f"shape {tuple(labels.shape)}; a store keeps one label per row: give a "
                    f"tensor whose dim 0 is the batch ({n}) of a dtype a store holds, or yield "
                    f"the inputs alone")
            if (mask is not None and labels.dim() >= 2 and labels.shape[:2] == mask.shape
                    and not bool(mask.bool().all())):
                warn("the labels of this (inputs, labels) batch are token labels "
                     f"{tuple(labels.shape)} of a padded batch (attention_mask), whose layers are "
                     "stored ragged (real tokens only): store.labels keeps each row padded, so "
                     "label j of a row is not the label of its stored token j. The labels of row "
                     "i's stored tokens are labels[i][attention_mask[i].bool()]; or extract "
                     "unpadded (packed) rows, whose labels line up token for token",
                     MisalignedLabelsWarning)
            columns[COLUMN_PREFIX + "label"] = (labels.detach().cpu(), None)
        else:
            columns[COLUMN_PREFIX + "label"] = _column("the labels of an (inputs, labels) batch",
                                                       labels, n)
    return columns


def _column(what: str, values: Any, n: int) -> tuple[Tensor, Tensor | None]:
    """``n`` ints -> ``((n,) int64, None)``; ``n`` strs -> (UTF-8 bytes flat, byte counts)."""
    if isinstance(values, (list, tuple)) and len(values) == n:
        if all(isinstance(v, str) for v in values):
            data = [v.encode("utf-8") for v in values]
            joined = bytearray(b"".join(data))
            flat = torch.frombuffer(joined, dtype=torch.uint8) if joined else \
                torch.empty(0, dtype=torch.uint8)
            return flat, torch.tensor([len(d) for d in data], dtype=torch.int64)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return torch.tensor(values, dtype=torch.int64), None
    raise ExtractError(f"{what} are {type(values).__name__} {values!r:.80}; a store keeps one "
                       f"per row: {n} ints or {n} strs (or a tensor of labels), or yield the "
                       f"inputs alone")


def _first_capture(job: _Job, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Capture:
    """Run the first batch in a capture of its own; refuse, in words for the CLI and Python
    alike, a selected layer that never ran (``SelectorError`` when it is a function address
    that matches nothing in the model, ``ExtractError`` otherwise) or ran more than once."""
    hint = ("'hookscope tree MODEL --input X' lists what runs, with --ops the function "
            "addresses; in Python hookscope.diagnostics.module_tree.tree_of_call(model, lambda: model(x), "
            "ops=True)")
    try:
        acts = capture(job.model, *job.keys, on_unfired="error", early_stop=job.early_stop)
        with acts:
            job.model(*args, **kwargs)
    except HookNeverFiredError as err:
        lines = "".join(f"\n  - {key}: {why}" for key, why in err.unfired.items())
        unmatched: set[str] = getattr(err.capture, "unmatched", set())
        kind = SelectorError if unmatched and set(err.unfired) <= unmatched else ExtractError
        raise kind(f"{len(err.unfired)} selected layer(s) never ran on the first batch, so they "
                   f"cannot become store layers:{lines}\nSelect layers that run on every "
                   f"batch: {hint}") from None
    for key in job.keys:
        if acts.counts.get(key, 1) > 1:
            raise ExtractError(_twice(key, acts.counts[key]))
    return acts


def _twice(key: str, count: int) -> str:
    """Why a layer called ``count`` times per forward cannot be a store layer, and the fix."""
    fix = (f"select one call: '{key}#0' … '{key}#{count - 1}'" if "::" in key and "#" not in key
           else "select a module that runs once per forward pass")
    return (f"'{key}' ran {count} times in one forward pass; a store layer takes one call per "
            f"batch (one row per input): {fix}")

def _axes(acts: Capture, key: str) -> tuple[int, int | None]:
    """The ``(batch, token)`` axes of the tensor ``acts[key]`` (``Records.token_axes``)."""
    value = acts[key]
    return acts.token_axes(key, value.dim()) if isinstance(value, Tensor) else (0, 1)


def _check_calls(acts: Capture, keys: list[str]) -> None:
    """Each selected module runs once per batch (a store keeps one row per input)."""
    counts = acts.counts
    for key in keys:
        if counts.get(key, 1) != 1:
            raise ExtractError(f"'{key}' ran {counts[key]} times on this batch and once on the "
                               f"first; a store layer takes one call per batch: select a module "
                               f"that runs once per forward pass")


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


def _layer_rows(key: str, output: Any, n: int, tokens: Tokens, job: _Job,
                axes: tuple[int, int | None] = (0, 1)) -> tuple[Tensor, Tensor | None]:
    """``(rows, None)`` or ``(flat tokens, lengths)`` of one layer's output, whose ``(batch,
    token)`` axes are ``axes`` (``Records.token_axes``), made in a forward with ``tokens``
    (``Records.tokens``: the mask of the stack that ran it). A value whose kind
    has rows of its own (a nested tensor, a PackedSequence: ``engine.values.kinds``) is stored ragged,
    one row per input in input order, real tokens only."""
    kind = kind_of(output)
    ragged = rows_for(output)
    if kind is not None and ragged is not None:
        if job.reducer is not None:
            raise ExtractError(f"'{key}' returned {kind.what} [kind: {kind.name}]; store it with "
                               f"reduce=None (ragged rows: each input's real tokens)")
        flat, counts = ragged
        if len(counts) != n:
            raise ExtractError(f"'{key}' returned {len(counts)} sequences for a batch of {n}")
        _check_storable(key, flat)
        return flat.detach(), counts
    t = values_for(_one_tensor(key, output), key, "extract", ExtractError)
    t = batch_first(t, axes)  # a sequence-first or length-last output as (batch, seq, ...)
    if t.dim() == 0 or t.shape[0] != n:
        raise ExtractError(f"'{key}' returned shape {tuple(t.shape)}, whose first dimension is "
                           f"not the batch size {n}; a store keeps one row per input, so select "
                           f"a module whose output is batch-first")
    lengths, mask = None, tokens.mask
    if job.reducer in REDUCTIONS.values():
        check_no_unmasked_padding(tokens, f"a reduction over the tokens of '{key}'",
                                  positions=False)
    if axes[1] is None and job.reducer in REDUCTIONS.values():
        raise ExtractError(f"'{key}', shape {tuple(t.shape)} (batch first), has no token axis "
                           f"to reduce: it is one vector per row "
                           f"and layer (an RNN's final state); select the output that holds the "
                           f"tokens, '{key.split('[')[0]}[0]', or store it with reduce=None")
    if job.reducer is not None:
        t = job.reducer(t, mask)  # a function returning no tensor raises there (reductions.py)
        if t.dim() == 0 or t.shape[0] != n:
            raise ExtractError(f"reduce turned the output of '{key}' into shape "
                               f"{tuple(t.shape)}; it must keep dim 0 (the batch, {n})")
    elif mask is not None and axes[1] is not None and t.dim() >= 2 and t.shape[:2] == mask.shape:
        keep = mask.bool()  # (batch, seq): real tokens only, padding is not stored
        lengths, t = keep.sum(dim=1).to("cpu", torch.int64), t[keep]
    if job.dtype is not None and t.is_floating_point():
        t = t.to(job.dtype)
    _check_storable(key, t)
    return t.detach(), lengths


def _check_storable(key: str, t: Tensor) -> None:
    """Raise unless a store can hold ``t``: real data (not a meta tensor or FakeTensor) of a dtype safetensors
    and the manifest know (not complex, float8, uint16..64 or quantized)."""
    values_for(t, key, "extract", ExtractError)
    if t.dtype not in _ST_DTYPES:
        fix = ("store its real and imaginary parts: a model wrapper returning "
               "torch.view_as_real(output)" if t.is_complex() else
               "convert it: dtype=torch.float32 if it is floating, or a wrapper returning "
               "output.to(torch.int64)")
        raise ExtractError(f"'{key}' returned {t.dtype}, which a store cannot hold (it holds "
                           f"{', '.join(dtype_name(d) for d in _ST_DTYPES)}); {fix}")


def _layer_infos(rows: Rows, prior: dict[str, Any] | None) -> dict[str, Any]:
    infos = {key: LayerInfo(key, ((None,) if lengths is not None else ()) +
                            tuple(data.shape[1:]), data.dtype).to_json()
             for key, (data, lengths) in rows.items()}
    if prior is not None and prior["layers"] and tensor_specs(prior) != infos:
        raise ExtractError(f"the layers and columns now give rows {infos}, the interrupted run "
                           f"stored {tensor_specs(prior)}: resume with the same model, data and "
                           f"options, or start over with overwrite=True")
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


def _class_name(model: nn.Module) -> str:
    """``module.qualname`` of the model's class (the same in every run: no object ids)."""
    return f"{type(model).__module__}.{type(model).__qualname__}"


# manifest ``extract`` field -> (the argument of ``extract``, the CLI flag)
_ARGUMENTS = {"layers": ("layers", "--layers"), "reduce": ("reduce", "--reduce"),
              "dtype": ("dtype", "--dtype"), "batch_size": ("batch_size", "--batch-size"),
              "batches": ("data", "--data")}


def _check_resume(prior: dict[str, Any] | None, header: dict[str, Any]) -> None:
    """Raise ``ExtractError`` when the store was extracted from a model of another class (or
    another CLI model spec), or naming each argument whose value differs from the first run's
    (old and new value, and the rerun that fixes it). A field the first run did not record (an
    older store) is not compared."""
    if prior is None:
        return
    run = "the complete store's run" if prior["complete"] else "the interrupted run"
    _check_same_model(prior["model"], header["model"], run)
    was = prior["extract"]
    changed = [k for k, v in header["extract"].items() if k in was and was[k] != v]
    if "batch_size" in changed and "batches" in changed:
        changed.remove("batches")  # another batch size makes another number of batches
    if changed:
        listing = "; ".join(_changed(k, was[k], header["extract"][k], run) for k in changed)
        fixes = " ".join(_flag(k, was[k]) for k in changed if k != "batches")
        rerun = f"rerun with {fixes}" if fixes else "resume over the same data"
        raise ExtractError(f"cannot resume: {listing}. Each must be what {run} used: {rerun}, "
                           f"or start over with overwrite=True (--overwrite), or choose another "
                           f"output folder.")


def _check_same_model(was: dict[str, Any], now: dict[str, Any], run: str) -> None:
    """Raise ``ExtractError`` when ``now`` (this run's manifest ``model``) names another model
    class, or another CLI spec, than ``was`` (the first run's); a spec missing on either side (the
    Python API records none) is not compared."""
    other_spec = None not in (was.get("spec"), now.get("spec")) and was["spec"] != now["spec"]
    if was.get("class") == now.get("class") and not other_spec:
        return
    def named(model: dict[str, Any]) -> str:
        return f"{model['class']}" + (f" ('{model['spec']}')" if model.get("spec") else "")
    raise ExtractError(f"cannot resume: the store was extracted from another model, "
                       f"{named(was)}, and this run's is {named(now)}; {run} can only be "
                       f"continued with its own model. Choose another output folder for this "
                       f"model, or replace the store with overwrite=True (--overwrite).")


def _changed(key: str, old: Any, new: Any, run: str) -> str:
    name, flag = _ARGUMENTS.get(key, (key, f"--{key}"))
    if key == "batches":
        return (f"the data ({flag}) now makes {new} batches, {run}'s made {old}: "
                f"it is not the same data")
    return f"{name} ({flag}) was {old!r}, now {new!r}"


def _flag(key: str, value: Any) -> str:
    """The CLI flag and API argument that give ``value`` again: ``--batch-size 50
    (batch_size=50)``."""
    name, flag = _ARGUMENTS.get(key, (key, f"--{key}"))
    if value is None:
        cli = "no --dtype" if key == "dtype" else f"{flag} none"
    else:
        cli = f"{flag} {' '.join(value) if isinstance(value, list) else value}"
    api = f"torch.{value}" if key == "dtype" and value else repr(value)
    return f"{cli} ({name}={api})"


def _say_resumed(job: _Job, folder: StorePath, prior: dict[str, Any] | None, start: int) -> None:
    """Tell (stderr, where the bar is shown) what a resumed run kept and where it goes on."""
    if prior is None or not (job.progress and job.ranks.rank == 0):
        return
    shards = len(prior["shards"])
    kept = f"{prior['rows']} rows in {shards} shard{'s' if shards != 1 else ''}"
    if prior["complete"]:
        said = f"{folder} is complete ({kept}): nothing to extract"
    elif shards:
        said = f"kept {kept} of {folder} (batches 0 … {start - 1}); extracting from batch {start}"
    else:
        said = f"{folder} holds no finished shard: extracting from batch {start}"
    print(f"extract: resume: {said}", file=sys.stderr, flush=True)


def _resume_batch(prior: dict[str, Any] | None, start: int) -> int:
    if prior is None or not prior["shards"]:
        return start
    return int(prior["shards"][-1]["batches"][1])


