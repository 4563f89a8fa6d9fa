"""Capture slots: one selected target's record entry, with the pieces of the hooks that fill it.

A ``_Slot`` is a record entry (``entries.Entry``) plus what the session keeps for it while it
records; the functions here build the hooks of a ``captures.Capture`` around slots: grouping
them by module, snapshotting outputs, keeping inputs, reducing, re-watching recomputed outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hookscope.engine import (
    MaskWatcher,
    Target,
    batch_first,
    check_no_unmasked_padding,
    eager_copy,
    keepable,
    lazy_copy,
    token_axes,
)
from hookscope.errors import CaptureError
from hookscope.record.entries import Entry
from hookscope.record.grads import watch_output
from hookscope.record.records import RecordKey
from hookscope.record.reductions import REDUCTIONS, Reduction
from hookscope.util import Keys, get_part, iter_tensors, map_tensors

__all__: list[str] = []

Tensor = torch.Tensor


class _Slot(Entry):
    """One target's record entry, plus the session's state for it: the target, the references
    kept with their versions. One object per selected module (with its hook)."""

    __slots__ = ("target", "versions", "recomputed")

    def __init__(self, target: Target):
        Entry.__init__(self, None, target.module, target.key)
        self.target = target
        self.versions: list[tuple[int, Tensor, int]] = []  # (call, tensor kept by reference, version)
        self.recomputed = 0  # checkpoint recomputes seen (with grads=True)

    def _make_key(self) -> RecordKey:
        return self.target.record_key




def _by_module(slots: list[_Slot]) -> dict[nn.Module, list[_Slot]]:
    """``slots`` grouped by module, in order: one hook per module serves all its records."""
    grouped: dict[nn.Module, list[_Slot]] = {}
    for slot in slots:
        grouped.setdefault(slot.target.module, []).append(slot)
    return grouped


def _snapshot_of(snapshot: Callable[[Any, _Slot], Any], slot: _Slot) -> Callable[[Any], Any]:
    """``snapshot`` for ``slot``'s outputs: what its ``RecordingHook`` keeps of an output."""
    return lambda output: snapshot(output, slot)


def _first_tensor(outputs: list[Any]) -> Tensor | None:
    """The first tensor of a record's first call (a plain tensor output, most often: no walk)."""
    if outputs and type(outputs[0]) is Tensor:
        return outputs[0]
    return next(iter_tensors(outputs[:1]), None)


def _reduced(reduce: Reduction, t: Tensor, watcher: MaskWatcher, target: Target,
             keys: Keys) -> Tensor:
    """``reduce`` of ``t`` (part ``keys`` of what ``target`` selects) seen as ``(batch, seq,
    ...)`` (``engine.values.layout.batch_first``: a sequence-first or length-last output moved so),
    with the attention mask of the running forward (None without one), on ``t``'s device.

    Raises:
        PositionError: ``reduce`` is one of the named token reductions (``"first"``,
            ``"last"``, ``"mean"``) and the input looks padded without a mask
            (``engine.values.layout.check_no_unmasked_padding``), or ``t`` has no token axis (an
            RNN's final state)."""
    module, parts = (target.module if target.op is None else None), (*target.parts, *keys)
    axes = token_axes(module, parts, t.dim())
    if reduce in REDUCTIONS.values():
        check_no_unmasked_padding(watcher.tokens, "a reduction over tokens (reduce='first', "
                                  "'last' or 'mean')", positions=False)
        if axes[1] is None:  # refused, the message names it
            watcher.layout(f"{target.key}{''.join(f'[{k}]' for k in keys)}", target.op, t.shape,
                           module=module, parts=parts)
    t = batch_first(t, axes)
    mask = watcher.mask_for(t.shape)
    return reduce(t, None if mask is None else mask.to(t.device))


def _part(output: Any, slot: _Slot) -> Any:
    parts = slot.target.parts
    if not parts:
        return output
    try:
        return get_part(output, parts)
    except KeyError as err:
        raise CaptureError(f"cannot take {slot.target.key!r}: {err.args[0]}") from None


def _keep_input(t: Tensor, clone: bool | None) -> Tensor:
    """An input as the module received it, safe from later in-place writes
    (``engine.values.copy_on_write``)."""
    t = keepable(t, "an input")
    return eager_copy(t) if clone else lazy_copy(t)


def _regrad(slots: list[_Slot], output: Any,
            convert: Callable[[Target], Callable[[Tensor], Tensor]]) -> None:
    """A checkpoint recompute of a call whose output could not take a gradient (reentrant
    checkpointing runs the first forward under no_grad): watch the recomputed output instead,
    which is what the gradient flows through. Recomputes come in call order within a segment."""
    for slot in slots:
        grads = slot.grads
        if not grads:
            continue
        call = slot.recomputed % len(grads)
        slot.recomputed += 1
        if grads[call].watched == 0:
            grads[call] = watch_output(_part(output, slot), convert(slot.target))


def _inputs_hook(slots: list[_Slot], clone: bool | None
                 ) -> tuple[Callable[..., None], Callable[[Any], None]]:
    """A forward pre-hook keeping each call's inputs as the module receives them, and its
    ``on_kept`` for a call inside a compiled graph (``engine.compile.graph``): ``(args, kwargs)``
    already copied, an argument the graph cannot hand out as ``NotKept``."""
    def keep(t: Tensor) -> Tensor:
        return _keep_input(t, clone)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for slot in slots:
            slot.inputs.append((map_tensors(keep, args), map_tensors(keep, kwargs)))

    def kept(call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        for slot in slots:
            slot.inputs.append((call[0], dict(call[1])))
    return hook, kept


def _call_of(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``pick`` of the inputs pre-hook: the call's arguments and keywords."""
    return args, kwargs

