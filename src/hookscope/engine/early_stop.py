"""Private: stop a forward pass once every selected module has returned (``early_stop=True``).

The rest of the model is not run: a forward hook, after the last selected module of the pass has
returned, raises ``StopForward``, a ``BaseException`` (as ``GeneratorExit`` is) so that a model's
own ``except Exception`` cannot swallow it. The session that owns the stop catches it at its
boundary: ``HookSession.__exit__`` for a ``with`` block (the block ends there, hooks removed),
``forward_boundary`` around each forward of a loop (``extract``, ``stats``). Nothing of the model
is changed; a pass cut short leaves no state behind except what a normal pass leaves (buffers
of the modules that ran, e.g. BatchNorm statistics in training mode).

The speed-up is in proportion to the part of the model skipped (SAELens #245 calls this "stop at
layer"; nnsight's ``.stop()`` and TransformerLens' ``stop_at_layer`` do the same).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope.engine.door.hooks import register

__all__ = ["EarlyStop", "SKIPPED_BY_STOP", "StopForward", "forward_boundary", "stopped_by", "stops"]

#: why a module selected by another block did not run when a forward was cut short
SKIPPED_BY_STOP = ("skipped: the forward pass was stopped early (early_stop=True) once the "
                   "early-stop block's modules had returned, before this module's turn")

_STOPS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def stops(root: nn.Module) -> int:
    """How many forward passes of ``root`` an early stop has cut short in this process; a block
    that sees this grow knows its silent modules were skipped, not missed."""
    return _STOPS.get(root, 0)


class StopForward(BaseException):
    """Raised from a forward hook to cut the forward pass short; ``owner`` is the ``EarlyStop``."""

    def __init__(self, owner: EarlyStop):
        super().__init__("hookscope early stop: every selected module has returned")
        self.owner = owner


class EarlyStop:
    """Tracks which selected modules have returned in the current forward pass.

    Args:
        root: the module whose forward is a pass (a pre-hook on it starts each pass anew).
        modules: the selected modules (the pass stops once all have returned).
    """

    def __init__(self, root: nn.Module, modules: Iterable[nn.Module]):
        self._root = root
        self._modules = list(dict.fromkeys(modules))
        self._pending = set(map(id, self._modules))
        self.stopped = 0  # passes cut short so far

    def register(self, add: Callable[[RemovableHandle], None]) -> None:
        """Add a pre-hook on the root (a new pass starts) and a forward hook on each module, after
        the hooks already there (so a capture's record is taken before the stop). Both are owned
        (``hooks.register``): another thread's forward, a copy of the model or a checkpoint
        recompute neither resets the pass nor is ever stopped."""
        register(self._root, lambda module, args: self._reset(), pre=True, record=add)
        for module in self._modules:
            register(module, self._returned, record=add)

    def _reset(self) -> None:
        self._pending = set(map(id, self._modules))

    def _returned(self, module: nn.Module, args: Any, output: Any) -> None:
        self._pending.discard(id(module))
        if not self._pending:
            self._reset()
            self.stopped += 1
            _STOPS[self._root] = _STOPS.get(self._root, 0) + 1
            raise StopForward(self)


def stopped_by(exc: BaseException | None, owner: EarlyStop | None) -> bool:
    """True if ``exc`` is the early stop of ``owner`` (which should then swallow it)."""
    return owner is not None and isinstance(exc, StopForward) and exc.owner is owner


@contextmanager
def forward_boundary(owner: EarlyStop | None) -> Iterator[None]:
    """Around one forward pass: swallow ``owner``'s stop, let everything else through."""
    try:
        yield
    except StopForward as exc:
        if exc.owner is not owner:
            raise
