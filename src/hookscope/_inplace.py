"""Private: keep captured values equal to what modules returned, despite later in-place writes.

A later in-place write (``ReLU(inplace=True)``, ``x += y``) changes a tensor kept by reference.
Cloning every output costs x1.54 against x1.31 for references on an all-leaf ResNet-50 capture
(bench/RESULTS.md), so hookscope learns, per module, whether its output is written in place:

- the first capture of a module copies its outputs and keeps the originals with their version
  counters (``Tensor._version``); at the end of that forward pass the module is remembered as
  written-in-place (copied from then on) if a counter moved, else as safe (kept by reference);
- outputs kept by reference are checked again when the capture ends; a value that changed anyway
  (a data-dependent branch) is marked broken, never returned, and the module is copied from then on.

Under ``torch.inference_mode()`` tensors carry no version counter: the first pass then compares
each original with its copy, and later references cannot be checked. A module whose in-place
writer left the values unchanged during that first pass (a ``clamp_`` that clipped nothing) would
go unnoticed there; ``clone=True`` copies always.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

Tensor = torch.Tensor

# module -> True when its output was seen written in place after it returned, False when seen safe.
_WRITTEN_IN_PLACE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


class InPlacePolicy:
    """One capture's view of the learned policy, plus the module outputs on trial.

    Args:
        clone: ``None`` learns (above); ``True`` always copies; ``False`` never copies (values
            overwritten later are still detected where version counters exist).
    """

    def __init__(self, clone: bool | None):
        self._clone = clone
        self.copy: dict[nn.Module, bool | None] = {}  # None while on trial; read by hooks per call
        self._trial: list[tuple[nn.Module, Tensor, int | None, Tensor]] = []

    def watch(self, module: nn.Module) -> None:
        """Give ``module`` its verdict so far (before its hook is registered)."""
        self.copy.setdefault(module, _WRITTEN_IN_PLACE.get(module) if self._clone is None else self._clone)

    def on_trial(self, module: nn.Module, kept: Tensor, copy: Tensor) -> None:
        """Remember an output kept by reference (``kept``) and its ``copy`` until the pass ends."""
        self._trial.append((module, kept, version(kept), copy))

    def end_pass(self) -> None:
        """Decide, for each module on trial, whether its output was written in place."""
        verdict: dict[nn.Module, bool] = {}
        for module, kept, counter, copy in self._trial:
            written = kept._version != counter if counter is not None else not torch.equal(kept, copy)
            verdict[module] = verdict.get(module, False) or written
        for module, written in verdict.items():
            self.mark(module, written)
        self._trial.clear()

    def mark(self, module: nn.Module, written: bool) -> None:
        """Record that ``module``'s output is (or is not) written in place after it returns."""
        _WRITTEN_IN_PLACE[module] = self.copy[module] = written


def version(t: Tensor) -> int | None:
    """``t._version``, or None for inference tensors, which have no version counter."""
    return None if t.is_inference() else t._version


def shares_memory(kept: Tensor, original: Tensor) -> bool:
    """True when ``kept`` (a detached, converted or reduced ``original``) aliases its memory."""
    if kept is original or kept._base is original or kept._base is original._base is not None:
        return True
    try:
        return kept.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without storage (meta, some subclasses)
        return False
