"""Private: torch's function-mode stack, as the engine enters and leaves its own modes.

``entered`` has a mode on this thread's stack for a block and takes it off however the block
ends (``take_off``: also when an interrupt left it held aside by torch); ``each_call`` is such a
mode for a whole block. ``engine.function_mode``'s watcher enters and leaves its mode with these.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Generator, Mapping
from types import GeneratorType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hookscope.engine import interrupts

__all__ = ["entered", "each_call", "take_off"]


class entered:  # noqa: N801 - used as a function: ``with entered(mode):``
    """Have ``mode`` (a ``TorchFunctionMode``) on this thread's torch function-mode stack for
    the block: the one way hookscope enters a mode of its own for a whole block
    (``each_call``). However the block ends (an exception, a KeyboardInterrupt at any
    line, one inside the mode's own ``__torch_function__`` while torch holds it aside), the
    mode is taken off (``take_off``), modes entered after it staying in their order. torch's
    function-mode stack is per thread, so a mode entered here never sees another thread's
    calls."""

    def __init__(self, mode: TorchFunctionMode):
        self.mode = mode
        self.closed = True  # nothing pushed yet: the exit's watch has nothing to take off

    def __enter__(self) -> None:
        self.closed = False  # before the push: a cut entry's cleanup still looks
        try:
            torch._C._push_on_torch_function_stack(self.mode)
        except BaseException:
            take_off(self.mode)
            raise

    @interrupts.never_skipped(lambda block: block.closed or block.close())  # exit cut short
    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        except BaseException:
            self.close()  # idempotent: what an exception halfway left
            raise

    def close(self) -> None:
        """Take the mode off (``take_off``, which searches the whole heap when the mode is not
        on the stack: run once, not again after every normal exit)."""
        take_off(self.mode)
        self.closed = True


OnOutput = Callable[[Callable[..., Any], tuple[Any, ...], Mapping[str, Any] | None, Any], None]


def each_call(on_output: OnOutput) -> entered:
    """A context (``with each_call(f):``) during which, on this thread, every torch function
    runs as usual and then ``on_output(func, args, kwargs, output)`` gets what it returned
    (``find_nonfinite`` notes which call made each value): a ``TorchFunctionMode`` of the engine's
    for a whole block, entered and taken off as ``entered`` does."""
    return entered(_EachCall(on_output))


class _EachCall(TorchFunctionMode):
    """Passes every torch function through, then hands its output to ``on_output``."""

    def __init__(self, on_output: OnOutput):
        super().__init__()
        self.on_output = on_output

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        output = func(*args, **(kwargs or {}))
        self.on_output(func, args, kwargs, output)
        return output


def take_off(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack wherever it is, also when an interrupt
    left it held aside by torch (``_stashes``); nothing when it is not there."""
    if _depth(mode) is None:  # interrupted: torch may hold it aside
        for stash in _stashes(mode):
            stash.close()  # puts it back on the stack now, not when garbage-collected
    _take_off(mode)


def _on_top(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is the innermost torch function mode (so that leaving it pops it)."""
    depth = torch._C._len_torch_function_stack()
    return bool(depth) and torch._C._get_function_stack_at(depth - 1) is mode


def _stashes(mode: TorchFunctionMode) -> list[Generator[Any, None, None]]:
    """The suspended ``torch.overrides._pop_mode_temporarily`` generators holding ``mode``.

    ``handle_torch_function`` takes the innermost mode off the stack around its
    ``__torch_function__`` in such a generator; an interrupt inside its ``__enter__`` or
    ``__exit__`` leaves it suspended, and it pushes the mode back whenever it is
    garbage-collected: long after the block took the mode away for good."""
    if _STASH_CODE is None:
        return []
    return [holder for holder in gc.get_referrers(mode)
            if isinstance(holder, GeneratorType) and holder.gi_code is _STASH_CODE
            and holder.gi_frame is not None and not holder.gi_running]


_STASH_CODE = getattr(getattr(getattr(torch.overrides, "_pop_mode_temporarily", None),
                              "__wrapped__", None), "__code__", None)


def _depth(mode: TorchFunctionMode) -> int | None:
    """Where ``mode`` is on torch's function-mode stack (0: outermost), or None."""
    return next((i for i in range(torch._C._len_torch_function_stack())
                 if torch._C._get_function_stack_at(i) is mode), None)


def _take_off(mode: TorchFunctionMode) -> None:
    """Remove ``mode`` from torch's function-mode stack, if there, keeping the others in order."""
    at = _depth(mode)
    if at is None:
        return
    depth = torch._C._len_torch_function_stack()
    above = [torch._C._pop_torch_function_stack() for _ in range(depth - at)][::-1]
    for other in above:
        if other is not mode:
            torch._C._push_on_torch_function_stack(other)
