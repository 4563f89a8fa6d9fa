"""Private: the rules that edits apply inside their hooks, and the check that an edit fits.

A rule maps ``(value, target, call)`` to the new value (or ``None`` to keep it): ``value`` is the
selected output part of one call of ``target``. ``edits.py`` builds the sessions; the rules of
``ablate``, ``patch`` and ``steer`` live here, each a small closure over what it needs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.editing.sources import SourceReader
from hookscope.engine import (
    NO_TOKENS,
    Layout,
    MaskWatcher,
    ModuleIndex,
    Target,
    Tokens,
    as_patterns,
    check_flag,
    check_nonempty,
    layout_of,
    resolve,
)
from hookscope.errors import ArgumentTypeError, EditError
from hookscope.record import (
    Heads,
    Over,
    Positions,
    check_over,
    layout_positions,
    resolve_heads,
    selected,
    tokens_first,
)
from hookscope.util import get_part, iter_tensors_with_keys, map_tensors, map_tensors_with_keys

__all__ = ["Where", "at_positions", "check_fits", "is_positional", "layer_pairs", "patch_positions_rule",
           "patch_rule", "reference_rule", "source_targets", "steer_rule", "zero"]

Tensor = torch.Tensor
# (value of the selected output part, or (args, kwargs); its target; call index) -> new value | None
Rule = Callable[[Any, Target, int], Any]


def zero(value: Any, target: Target, call: int) -> Any:
    return map_tensors(torch.zeros_like, value)


def reference_rule(records: SourceReader, how: str) -> Rule:
    pooled: dict[tuple[str, tuple[int | str, ...]], Tensor] = {}  # (record, keys) -> rows

    def rule(value: Any, target: Target, call: int) -> Any:
        def replace(live: Tensor, keys: tuple[int | str, ...]) -> Tensor:
            cached = pooled.get((target.key, keys))
            if cached is None:
                cached = _pool(records, target, keys, how)
                if not cached.requires_grad:  # pooled anew each forward: a graph per backward
                    pooled[(target.key, keys)] = cached
            rows = cached.to(device=live.device, dtype=live.dtype)
            if tuple(rows.shape[int(how == "resample"):]) != tuple(live.shape[1:]):
                raise EditError(
                    f"cannot ablate '{target.key}{_suffix(keys)}' with the reference {how}: "
                    f"reference rows have shape {tuple(cached.shape[int(how == 'resample'):])}, "
                    f"this run's rows {tuple(live.shape[1:])} (output {tuple(live.shape)}); "
                    f"use a reference run with the same shape past the batch dimension")
            if how == "mean":
                return rows.expand(live.shape).contiguous()
            return rows[torch.randint(rows.shape[0], (live.shape[0],), device=rows.device)]
        return map_tensors_with_keys(replace, value)
    return rule


def _pool(records: SourceReader, target: Target, keys: tuple[int | str, ...], how: str) -> Tensor:
    """All reference rows of one tensor position, ``(rows, ...)``, or their mean over rows."""
    calls = records.calls(target, keys)
    if not calls:
        records.leaf(target, 0, keys)  # raises: the reference holds no record of the module
    try:
        rows = torch.cat(calls)  # (rows, ...) over batches and calls; a reference that requires
        # grad gets its gradient through the mean or the drawn rows
    except RuntimeError as err:
        raise EditError(f"the reference calls of '{target.key}' differ in shape past the batch "
                        f"dimension ({', '.join(str(tuple(c.shape)) for c in calls)}), so they "
                        f"cannot be pooled: {err}") from None
    return rows.float().mean(dim=0).to(rows.dtype) if how == "mean" else rows


def steer_rule(vector: Tensor, scale: float) -> Rule:
    """Add ``scale * vector`` to the output; for a vector that requires grad the product is taken
    in each forward, so it gets its gradient from every backward (training a steering vector),
    once otherwise."""
    fixed = None if vector.requires_grad else vector * scale

    def rule(value: Any, target: Target, call: int) -> Any:
        if not isinstance(value, Tensor):
            raise EditError(f"'{target.key}' returns a {type(value).__name__}; steer one tensor "
                            f"in it, e.g. '{target.key}[0]'")
        if not (value.is_floating_point() or value.is_complex()):
            raise EditError(f"cannot steer '{target.key}': it returns {value.dtype}, and a "
                            f"steering vector is added to floating activations (added to "
                            f"integers or bools it would be truncated); select a module that "
                            f"returns floating values (e.g. the embedding after token ids)")
        if not _broadcasts(vector.shape, value.shape):
            raise EditError(f"cannot add a vector of shape {tuple(vector.shape)} to the output of "
                            f"'{target.key}', shape {tuple(value.shape)}: give a vector that "
                            f"broadcasts to its trailing dimensions, e.g. {_example_shape(value)}")
        if vector.is_complex() and not value.is_complex():
            raise EditError(f"cannot add the complex vector ({vector.dtype}) to the output of "
                            f"'{target.key}', which is real ({value.dtype}): its imaginary part "
                            f"would be dropped; give a real vector")
        scaled = fixed if fixed is not None else vector * scale
        if value.dtype in _NO_ARITHMETIC:  # float8: added in float32, rounded back to float8
            return (value.float() + scaled.to(value.device, torch.float32)).to(value.dtype)
        return value + scaled.to(device=value.device, dtype=value.dtype)
    return rule


# dtypes torch stores but has no addition kernel for
_NO_ARITHMETIC = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))


def _example_shape(value: Tensor) -> str:
    """A vector shape that broadcasts to ``value``: per channel for a feature map
    ``(batch, channels, height, width)``, else per feature of the last dimension."""
    if value.dim() == 4:
        return f"({value.shape[1]}, 1, 1) for its channels"
    return f"({value.shape[-1]},)"


def patch_rule(records: SourceReader, source_of: dict[str, Target]) -> Rule:
    def rule(value: Any, target: Target, call: int) -> Any:
        origin = source_of.get(target.key, target)

        def replace(live: Tensor, keys: tuple[int | str, ...]) -> Tensor:
            recorded = records.leaf(origin, call, keys)
            if recorded.shape != live.shape:
                raise EditError(
                    f"cannot patch call {call} of '{target.key}{_suffix(keys)}': the source value "
                    f"has shape {tuple(recorded.shape)}, this run's output {tuple(live.shape)}; "
                    f"patch between runs with the same input shape (batch, sequence length), or "
                    f"give positions=... to patch chosen positions between prompts of any length")
            return recorded.to(device=live.device, dtype=live.dtype)
        return map_tensors_with_keys(replace, value)
    return rule


def patch_positions_rule(records: SourceReader, source_of: dict[str, Target], destination: Positions,
                         origin: Positions, watcher: MaskWatcher, source_mask: Tensor | None,
                         where: Where) -> Rule:
    """Patch rule that writes the source's ``origin`` positions (of the selected heads) into
    this run's ``destination``, each on its value's token axis, each counted by the layout of
    its own run: this forward's (``watcher``) and the source record's (``Records.tokens``: the
    mask its capture saw), unless ``source_mask`` is given."""
    _check_selection(destination, where)
    def rule(value: Any, target: Target, call: int) -> Any:
        def replace(live: Tensor, keys: tuple[int | str, ...]) -> Tensor:
            name = f"{target.key}{_suffix(keys)}"
            origin_target = source_of.get(target.key, target)
            recorded = records.leaf(origin_target, call, keys)
            layout = where.layout(name, target, keys, live.shape, watcher.tokens)
            recorded_tokens = (Tokens(source_mask) if source_mask is not None
                               else records.tokens(origin_target, call))
            source_layout = where.layout(name, origin_target, keys, recorded.shape,
                                         recorded_tokens)
            rows, columns = layout_positions(destination, layout, name, absolute=where.absolute,
                                             over=where.over)
            src_rows, src_columns = layout_positions(origin, source_layout, f"the source's {name}",
                                                     absolute=where.absolute)
            new = live.clone()
            view, source = tokens_first(new, layout), tokens_first(recorded, source_layout)
            if not torch.equal(rows.cpu(), src_rows.cpu()) or source.shape[2:] != view.shape[2:]:
                raise EditError(
                    f"cannot patch call {call} of '{name}' at positions: they select "
                    f"{rows.numel()} tokens in this run (shape {tuple(live.shape)}) and "
                    f"{src_rows.numel()} in the source (shape {tuple(recorded.shape)}); give "
                    f"positions that pick the same number of tokens in each row of both runs, "
                    f"with the same batch size and trailing shape")
            index: tuple[Tensor, ...] = (rows, columns)
            src_index: tuple[Tensor, ...] = (src_rows, src_columns)
            if where.heads is not None:
                chosen = resolve_heads(where.heads, view.shape[2], name)[None]
                index, src_index = (rows[:, None], columns[:, None], chosen), \
                    (src_rows[:, None], src_columns[:, None], chosen)
            view[tuple(i.to(live.device) for i in index)] = source[
                tuple(i.to(recorded.device) for i in src_index)].to(device=live.device,
                                                                     dtype=live.dtype)
            return new
        return map_tensors_with_keys(replace, value)
    return rule


@dataclass(frozen=True)
class Where:
    """Where an edit applies inside each value: ``heads`` (``None``: all), the token axis given
    by ``seq_dim`` (``None``: the value's known layout), positions ``absolute`` or counted
    among real tokens, ``over`` each forward's tokens or the whole sequence so far."""

    heads: Heads = None
    seq_dim: int | None = None
    absolute: bool = False
    over: Over = "forward"

    def __post_init__(self) -> None:
        check_flag("absolute", self.absolute)
        check_over(self.over)
        if self.seq_dim is not None and (not isinstance(self.seq_dim, int) or isinstance(self.seq_dim, bool)):
            raise ArgumentTypeError(f"seq_dim must be an int (the token axis, e.g. seq_dim=2) or "
                                    f"None; got {type(self.seq_dim).__name__} {self.seq_dim!r}")

    def layout(self, name: str, target: Target, keys: tuple[int | str, ...], shape: Sequence[int],
               tokens: Tokens = NO_TOKENS) -> Layout:
        """The layout (``engine.values.layout.layout_of``), with ``seq_dim`` and heads, of the value
        at ``keys`` in what ``target`` selects (its module's ``TOKEN_AXES`` row)."""
        return layout_of(name, target.op, shape, self.seq_dim, heads=self.heads is not None,
                         tokens=tokens, module=target.module, parts=(*target.parts, *keys))


def at_positions(rule: Rule, positions: Positions, watcher: MaskWatcher, where: Where) -> Rule:
    """``rule`` applied at ``positions`` of each value's token axis and at ``where.heads`` of
    its heads axis only, counted by the layout of the running forward (``watcher``); elsewhere
    the output is kept. Empty ``positions``/``heads`` are refused here, at construction
    (``EmptySelectionError``)."""
    _check_selection(positions, where)
    def positioned(value: Any, target: Target, call: int) -> Any:
        new = rule(value, target, call)

        def keep_outside(live: Tensor, keys: tuple[int | str, ...]) -> Tensor:
            name = f"{target.key}{_suffix(keys)}"
            layout = where.layout(name, target, keys, live.shape, watcher.tokens)
            chosen = selected(layout, positions, where.heads, name, absolute=where.absolute,
                              over=where.over)
            return torch.where(chosen.to(live.device), get_part(new, keys) if keys else new, live)
        return map_tensors_with_keys(keep_outside, value)
    _POSITIONAL.add(positioned)
    return positioned


_POSITIONAL: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def is_positional(rule: Rule) -> bool:
    """True for a rule made by ``at_positions`` (it reads a token axis)."""
    return rule in _POSITIONAL


def _check_selection(positions: Positions, where: Where) -> None:
    """The one rule for empty selections (``engine.checks``): ``positions=[]``, ``heads=[]``
    select nothing and are refused, as ``capture(model)`` without a pattern is."""
    check_nonempty("positions", positions, "positions=[-1] (None: every position)")
    check_nonempty("heads", where.heads, "heads=[0] (None: every head)")


def layer_pairs(records: SourceReader, layers: str | Sequence[str] | Mapping[str, str] | None,
                 source_layers: str | Sequence[str] | None) -> list[tuple[str, str | None]]:
    """``[(pattern to patch, source pattern or None for the same)]``."""
    if isinstance(layers, Mapping):
        if source_layers is not None:
            raise EditError("give the source layers once: either layers={pattern: source "
                            "pattern} or source_layers=[...], not both")
        check_nonempty("layers", layers, "layers={'blocks.3': 'blocks.2'}")
        return list(layers.items())
    patterns = records.keys() if layers is None else as_patterns(layers)
    check_nonempty("source", patterns, "source=acts, a capture holding at least one record")
    if source_layers is None:
        return [(p, None) for p in patterns]
    sources = as_patterns(source_layers, "source_layers")
    if len(sources) != len(patterns):
        raise EditError(f"layers has {len(patterns)} patterns and source_layers {len(sources)}; "
                        f"give one source pattern per pattern, in the same order")
    return list(zip(patterns, sources))


def source_targets(model: nn.Module, pairs: list[tuple[str, str | None]],
                   names: ModuleIndex) -> dict[str, Target]:
    """``{record name patched: source target}`` for the pairs whose source is another layer;
    ``names`` is ``index(model)``, built once by the caller."""
    mapped: dict[str, Target] = {}
    for pattern, source_pattern in pairs:
        if source_pattern is None:
            continue
        live, origin = resolve(model, [pattern], names=names), resolve(model, [source_pattern], names=names)
        if len(live) != len(origin):
            raise EditError(f"'{pattern}' selects {len(live)} modules but its source "
                            f"'{source_pattern}' selects {len(origin)}; map one to one, e.g. "
                            f"layers={{'{live[0].key}': '{origin[0].key}'}}")
        mapped.update((t.key, o) for t, o in zip(live, origin))
    return mapped


def check_fits(pattern: str, target: Target, call: int, old: Any, new: Any) -> None:
    """Raise ``EditError`` unless ``new`` has the structure, shapes, dtypes and devices of
    ``old``: the next module expects what this one returns, and would fail far from the edit
    otherwise (a ``meta`` or other-device tensor gives a torch error deep in the next layer)."""
    where = f"the edit of '{pattern}' does not fit call {call} of '{target.key}' " \
            f"({type(target.module).__name__}): the module returned"
    fix = ("An edit must return what the module returns (same structure, shapes, dtypes and "
           "devices: build it with torch.zeros_like(output) or move it with .to(output.device)), "
           "or None to keep it.")
    if _kind(old) != _kind(new):
        raise EditError(f"{where} {_describe(old)}, but the edit returned {_describe(new)}. {fix}")
    old_leaves, new_leaves = dict(iter_tensors_with_keys(old)), dict(iter_tensors_with_keys(new))
    if list(old_leaves) != list(new_leaves):
        raise EditError(f"{where} tensors at {_keys(old_leaves)}, but the edit returned tensors "
                        f"at {_keys(new_leaves)}. {fix}")
    for keys, tensor in old_leaves.items():
        edited = new_leaves[keys]
        if (edited.shape != tensor.shape or edited.dtype != tensor.dtype
                or edited.device != tensor.device):
            at = f" at {_suffix(keys)}" if keys else ""
            raise EditError(f"{where}{at} {_describe(tensor)}, but the edit returned "
                            f"{_describe(edited)}. {_cast(tensor, edited) or fix}")


def _cast(old: Tensor, new: Tensor) -> str | None:
    """The fix for an edit whose tensor has the right shape but another dtype or device (a
    float32 sparse autoencoder spliced into a bfloat16 model), or ``None``."""
    moves = [f"output.{what}" for what in ("dtype", "device")
             if getattr(old, what) != getattr(new, what)]
    if old.shape != new.shape or not moves:
        return None
    wanted = " ".join(str(getattr(old, m.split(".")[1])) for m in moves)
    return (f"Return it as the module's {' and '.join(m.split('.')[1] for m in moves)} "
            f"({wanted}): new.to({', '.join(moves)}), or convert what made it once, e.g. "
            f"sae.to({', '.join(moves)}) for a sparse autoencoder run on the output; or None to "
            f"keep the output.")


def _kind(value: Any) -> str:
    if isinstance(value, Tensor):
        return "Tensor"
    if isinstance(value, (tuple, list)):
        return f"sequence of {len(value)}"
    if isinstance(value, Mapping):
        return f"mapping of {sorted(map(str, value))}"
    return type(value).__qualname__


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a Tensor of shape {tuple(value.shape)}, dtype {value.dtype} on {value.device}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)}"
    return f"a {type(value).__name__}"


def _keys(leaves: Mapping[tuple[int | str, ...], Tensor]) -> str:
    return ", ".join(_suffix(keys) or "the top" for keys in leaves) or "none"


def _broadcasts(shape: torch.Size, onto: torch.Size) -> bool:
    """True if a tensor of ``shape`` adds to one of shape ``onto`` without changing its shape."""
    try:
        return bool(torch.broadcast_shapes(shape, onto) == onto)  # type: ignore[no-untyped-call]
    except RuntimeError:
        return False


def _suffix(keys: tuple[int | str, ...]) -> str:
    return "".join(f"[{k}]" for k in keys)
