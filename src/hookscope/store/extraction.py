"""Extraction: a model run over a data set, its chosen activations streamed into a store.

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
this process lists their shards (``hookscope.store.ray_engine``). The loop over shards is
``hookscope.store.shard_loop``, a batch's rows ``hookscope.store.batch_rows``. Reductions are
``hookscope.reductions``; writing, staging and the writer thread ``hookscope.store.writer``; what
an output folder may hold ``hookscope.store.folder``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hookscope.engine import (
    GracefulStop,
    as_patterns,
    brief,
    one_index_per_call,
    resolve,
    untouched,
)
from hookscope.errors import (
    ExtractError,
    StoreFaultError,
)
from hookscope.record import (
    Reduce,
    reduction,
    reduction_name,
)
from hookscope.store.batch_rows import Rows, _Job, _layer_infos, _rows
from hookscope.store.batches import BatchSource
from hookscope.store.folder import check_output, prepare_output, writing
from hookscope.store.fs import StorePath, location
from hookscope.store.layers import _ST_DTYPES, dtype_name
from hookscope.store.manifest import COLUMN_PREFIX, tensor_specs
from hookscope.store.ranks import Ranks
from hookscope.store.ray_engine import (
    Engine,
    as_engine,
    check_data,
    check_reachable,
    share,
)
from hookscope.store.reader import Store, open_store
from hookscope.store.shard_loop import _nbytes, _worker_copy, _write_all, _write_on_ray
from hookscope.store.writer import (
    StoreWriter,
    join_parts,
    read_part,
)

__all__ = ["Reduce", "check_output", "extract", "SHARD_BYTES", "SHARD_SECONDS"]

Tensor = torch.Tensor
SHARD_BYTES = 256 * 2**20
SHARD_SECONDS = 60.0


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
