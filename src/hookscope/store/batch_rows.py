"""A batch's rows: one forward of the batch, each selected layer's output as store rows, the
``@id``/``@label``/``@token`` columns beside them; ``_Job``, an extraction's settings, is what
they are made with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.engine import (
    GracefulStop,
    Tokens,
    batch_first,
    check_no_unmasked_padding,
    input_device,
    kind_of,
    model_inputs,
    rows_for,
    values_for,
)
from hookscope.errors import (
    ExtractError,
    HookNeverFiredError,
    HookscopeError,
    MisalignedLabelsWarning,
    SelectorError,
    warn,
)
from hookscope.record import (
    REDUCTIONS,
    Capture,
    Reduction,
    capture,
)
from hookscope.store.batches import BatchSource
from hookscope.store.layers import _ST_DTYPES, LayerInfo, dtype_name
from hookscope.store.manifest import COLUMN_PREFIX, tensor_specs
from hookscope.store.ranks import Ranks
from hookscope.store.ray_engine import (
    RayEngine,
)
from hookscope.util import describe_keys, iter_tensors, map_tensors

__all__: list[str] = []

Tensor = torch.Tensor
Rows = dict[str, tuple[Tensor, Tensor | None]]  # key -> (rows or flat tokens, token counts)


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
