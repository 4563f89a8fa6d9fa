"""Private: a KeyboardInterrupt never leaves a block's hooks behind.

Jupyter's interrupt button (and Ctrl-C) delivers SIGINT, whose Python handler raises
``KeyboardInterrupt`` between any two bytecodes of the main thread: between torch registering a
hook and the block recording its handle, halfway through removing a block's hooks, or on the
first line of ``__exit__`` before it removes anything. Each would leave hooks on the model for
good (a leaked ``steer`` keeps changing every later forward).

So while a block is open in the main thread (``guard`` in its ``__enter__``, ``unguard`` once
its hooks are removed) hookscope's handler stands in for the SIGINT handler:

- inside a ``deferred`` section (adding or removing hooks) it only notes the signal; the end
  of the section delivers it (and runs its ``undo`` when that raises);
- elsewhere in a guarded block's ``__enter__`` or ``__exit__`` (found on the interrupted stack)
  it delivers the signal and, when that raises, removes the block's hooks (the ``cleanup``
  given to ``guard``) before the exception leaves;
- anywhere else (the body of the block, the model's forward) it delivers at once.

Delivering means calling the handler that was there before (``KeyboardInterrupt`` by default),
so the user gets exactly the interrupt they asked for. When the last guarded block closes, the
previous handler is put back (unless the user installed another one meanwhile). Other threads
need nothing: Python runs signal handlers only in the main thread.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["guard", "unguard", "deferred"]

_guarded: dict[int, Callable[[], None]] = {}  # id(block) -> its cleanup, main thread only
_previous: Any = None  # the SIGINT handler before the first guarded block
_busy = 0  # depth of deferred sections running in the main thread
_pending: list[int] = []  # signals noted during a deferred section


def guard(block: object, cleanup: Callable[[], None]) -> None:
    """From now until ``unguard(block)``, an interrupt of ``block``'s ``__enter__`` or
    ``__exit__`` calls ``cleanup()`` (which removes its hooks) before the KeyboardInterrupt.
    Does nothing outside the main thread, when SIGINT is ignored, or when its handler was not
    set from Python (it could not be put back)."""
    global _previous
    if not _in_main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if current is None or current == signal.SIG_IGN:  # set outside Python, or nothing to do
        return
    _guarded[id(block)] = cleanup
    try:
        if current is not _handler:
            _previous = current
            signal.signal(signal.SIGINT, _handler)
    except BaseException:
        unguard(block)
        raise


def unguard(block: object) -> None:
    """``block``'s hooks are gone; the last block to go puts the previous handler back."""
    global _previous
    _guarded.pop(id(block), None)
    if _guarded:
        return
    if signal.getsignal(signal.SIGINT) is _handler:
        signal.signal(signal.SIGINT, _previous)
    _previous = None


@contextmanager
def deferred(undo: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold back SIGINT until the section ends (in a guarded main thread), then deliver it; if
    that raises (a ``KeyboardInterrupt`` by default; it replaces an exception of the section),
    ``undo()`` runs before the exception leaves. Sections nest: the outermost one delivers."""
    global _busy
    if not _guarded or not _in_main_thread():
        yield
        return
    _busy += 1
    try:
        yield
    finally:
        _busy -= 1
        if _pending and not _busy:
            signum = _pending[0]
            _pending.clear()
            try:
                _deliver(signum, sys._getframe())
            except BaseException:
                if undo is not None:
                    undo()
                raise


def _handler(signum: int, frame: FrameType | None) -> None:
    if _busy:
        _pending.append(signum)
        return
    try:
        _deliver(signum, frame)
    except BaseException:  # the KeyboardInterrupt: it must not leave a half-entered block
        cleanup = _interrupted_block(frame)
        if cleanup is not None:
            cleanup()
        raise


def _interrupted_block(frame: FrameType | None) -> Callable[[], None] | None:
    """The cleanup of the guarded block whose ``__enter__``/``__exit__`` is on the stack."""
    while frame is not None:
        if frame.f_code.co_name in ("__enter__", "__exit__"):
            cleanup = _guarded.get(id(frame.f_locals.get("self")))
            if cleanup is not None:
                return cleanup
        frame = frame.f_back
    return None


def _deliver(signum: int, frame: FrameType | None) -> None:
    """Hand the signal to the handler hookscope stood in for (or to the current one)."""
    handler = _previous if signal.getsignal(signal.SIGINT) is _handler else None
    if handler is None:  # not standing in any more: the real handler gets it
        signal.raise_signal(signum)
    elif callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
