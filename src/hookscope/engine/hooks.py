"""Private: a session's hook acts only on the calls that belong to its session.

A hook on a module is run by more than the calls its ``with`` block means:

- **copies**: ``copy.copy(model)`` shares the module's hook dictionaries, hooks included (a
  ``deepcopy`` or pickle made inside a block leaves them out: ``copies.py``);
- **threads**: another thread calling the same model (a server running requests in parallel)
  runs the same hooks;
- **recomputation**: activation checkpointing (``torch.utils.checkpoint``, reentrant or not, HF
  ``gradient_checkpointing_enable()``) runs the forward of the checkpointed part again during
  backward. That is not a new call of the module.

``OwnedHook`` wraps a session's hook function and calls it only for the session's own module
object, in the thread that entered the session, outside a backward pass (a forward that runs
while autograd executes a graph task is a recomputation; ``torch._C._current_graph_task_id()``
is -1 outside backward). Other calls are counted (``foreign_calls``, ``recomputes``) so reports
can say why a module looked silent; a call for another module object (a shallow copy sharing
the tables) does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["OwnedHook", "register", "in_recompute", "owns_call"]

_graph_task_id = torch._C._current_graph_task_id
_get_ident = threading.get_ident
_compiling = torch.compiler.is_compiling


class OwnedHook:
    """A forward or forward-pre hook that runs ``function`` only for its session's calls.

    Args:
        function: the hook, called as torch calls hooks: ``(module, args[, kwargs], output)``.
        module: the module it is registered on (copies of it are not the session's).
        in_recompute: also run ``function`` during an activation-checkpointing recompute (edits
            must, so the recomputed forward equals the real one); the call is still counted in
            ``recomputes`` and never as a new call by ``function``'s session.

    Attributes:
        recomputes: forwards re-run during backward that reached this hook.
        foreign_calls: calls from threads other than the session's.
    """

    __slots__ = ("function", "module", "thread", "in_recompute", "recomputes",
                 "foreign_calls")

    def __init__(self, function: Callable[..., Any], module: nn.Module, *, in_recompute: bool = False):
        self.function = function
        self.module = module
        self.thread = threading.get_ident()
        self.in_recompute = in_recompute
        self.recomputes = 0
        self.foreign_calls = 0

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        if owns_call(self, module):
            return self.function(module, *args)
        if _compiling():  # traced into a compiled graph: calls are the model's
            return self.function(module, *args)
        if module is not self.module:  # a shallow copy sharing the hook tables
            return None
        if _get_ident() != self.thread:
            self.foreign_calls += 1
            return None
        self.recomputes += 1  # a forward inside backward: a checkpoint recompute
        return self.function(module, *args) if self.in_recompute else None


def register(module: nn.Module, hook: OwnedHook, *, pre: bool = False, with_kwargs: bool = False,
             prepend: bool = False) -> torch.utils.hooks.RemovableHandle:
    """Register ``hook`` on ``module`` as a forward (or forward-pre) hook; return the handle."""
    if pre:
        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs, prepend=prepend)
    else:
        handle = module.register_forward_hook(hook, with_kwargs=with_kwargs, prepend=prepend)
    return handle


def owns_call(hook: OwnedHook, module: nn.Module) -> bool:
    """True for a call ``hook`` takes as it is, without ``OwnedHook.__call__``'s other branches:
    not traced by torch.compile, its own module, its own thread, not a recompute. Subclasses
    with an inlined hot path test this first and hand every other call to
    ``OwnedHook.__call__``."""
    return (not _compiling() and module is hook.module and _get_ident() == hook.thread
            and _graph_task_id() == -1)  # compiling first: dynamo must not trace the rest


def in_recompute() -> bool:
    """True while autograd runs a backward pass: a forward now is a checkpoint recompute."""
    return not _compiling() and _graph_task_id() != -1

