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
so the user gets exactly the interrupt they asked for.

Threads: Python runs signal handlers only in the main thread, and only the main thread may set
one, so the stand-in belongs to the main thread. Its state (the guarded blocks, the handler it
stands in for) is read and changed under one lock, counted per block (any number of blocks at
once), and the handler is set and put back only from the main thread: a block in a worker
thread never touches ``signal`` (it needs nothing: no signal handler interrupts it), and a
main-thread block that a worker exits leaves the handler to the next main-thread block (the
stand-in only delivers while nothing is guarded). When the last guarded block closes, the
handler that was there before the first one is put back exactly (a user's function,
``default_int_handler``, ``SIG_DFL``), unless the user installed another one meanwhile. Under
``SIG_IGN`` (a background shell's job) or a handler set outside Python nothing is installed:
there is no interrupt to hold back, or no way to put the handler back.

Every other way a block ends (an exception raised at a line by a trace function or a signal
handler, a ``PyThreadState_SetAsyncExc``, an exception of a user's callback) is handled by the
blocks themselves. Their ``__enter__`` and ``__exit__`` are written::

    def __exit__(self, *exc):
        try: return self._close(*exc)  # the first line: `try` and its body on one line
        except BaseException:
            self._remove()  # idempotent: removes what an exception in _close left
            raise

In Python 3.11+ a ``try:`` alone on its line is a no-op outside the protected range, so an
exception raised at its line event would skip the handler; sharing the body's line, the first
line event of the method is inside it. On success no other line of the method runs after the
body returned. So one exception at any line of hookscope's code (``tests/test_interrupts.py``
raises one at every line) still removes everything. An exception at the call itself, before
the method's first line (an async exception at its entry), is beyond any Python code.

The same holds where hookscope's own code enters a block with a ``with`` statement: the exit
runs at the ``with`` line after the body's last line, outside the protected range, so an
exception raised at that line event would skip it. Such a ``with`` keeps its body on its own
line (``with session: run(session)``), or its body is a function called on that line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["guard", "unguard", "deferred", "GracefulStop", "exit_at_interrupt"]

_lock = threading.RLock()  # guards _guarded and _previous (any thread may unguard)
_guarded: dict[int, Callable[[], object]] = {}  # id(block) -> its cleanup (main-thread blocks)
_UNSET: Any = object()
_previous: Any = _UNSET  # the SIGINT handler before the first guarded block
_busy = 0  # depth of deferred sections running in the main thread
_pending: list[int] = []  # signals noted during a deferred section


def guard(block: object, cleanup: Callable[[], object]) -> None:
    """From now until ``unguard(block)``, an interrupt of ``block``'s ``__enter__`` or
    ``__exit__`` calls ``cleanup()`` (which removes its hooks) before the KeyboardInterrupt.
    Does nothing outside the main thread, when SIGINT is ignored, or when its handler was not
    set from Python (it could not be put back)."""
    if _in_main_thread():
        with _lock: _guard(block, cleanup)  # noqa: E701 - one line: see copies._open_block


def _guard(block: object, cleanup: Callable[[], object]) -> None:
    global _previous
    current = signal.getsignal(signal.SIGINT)
    if current is None or current == signal.SIG_IGN:  # set outside Python, or nothing to do
        return
    _guarded[id(block)] = cleanup
    if current is not _handler:
        _previous = current
        signal.signal(signal.SIGINT, _handler)


def unguard(block: object) -> None:
    """``block``'s hooks are gone; the last block to go (in the main thread) puts the previous
    handler back. Idempotent; from another thread it only forgets ``block``."""
    with _lock: _unguard(block)  # noqa: E701 - one line: see copies._open_block


def _unguard(block: object) -> None:
    global _previous
    _guarded.pop(id(block), None)
    if _guarded or not _in_main_thread():
        return
    if _previous is not _UNSET and signal.getsignal(signal.SIGINT) is _handler:
        signal.signal(signal.SIGINT, _previous)
    _previous = _UNSET


@contextmanager
def deferred(undo: Callable[[], object] | None = None) -> Iterator[None]:
    """Hold back SIGINT until the section ends (in a guarded main thread), then deliver it; if
    that raises (a ``KeyboardInterrupt`` by default; it replaces an exception of the section),
    ``undo()`` runs before the exception leaves. Sections nest: the outermost one delivers."""
    global _busy
    if not _in_main_thread() or not _guarded:
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
    if not _guarded:  # every block closed (one exited by a worker thread): just deliver
        _deliver(signum, frame)
        return
    try:
        _deliver(signum, frame)
    except BaseException:  # the KeyboardInterrupt: it must not leave a half-entered block
        cleanup = _interrupted_block(frame)
        if cleanup is not None:
            cleanup()
        raise


def _interrupted_block(frame: FrameType | None) -> Callable[[], object] | None:
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
    if signal.getsignal(signal.SIGINT) is not _handler:  # not standing in: the real one gets it
        signal.raise_signal(signum)
        return
    handler = signal.default_int_handler if _previous is _UNSET else _previous
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# ------------------------------------------------------- the other SIGINT handlers hookscope sets
class GracefulStop:
    """Within the block (main thread, Python's default SIGINT handler in place), the first
    Ctrl-C only sets ``asked`` and prints ``message`` to stderr, so a loop can stop at a point of
    its choosing (``extract``: once the batch in progress is stored, so the rows of the open
    shard are written, not lost); a second Ctrl-C raises ``KeyboardInterrupt`` at once.
    Elsewhere (another thread, a handler of the program's own) it does nothing. A block guarded
    inside it (``guard``) stands in for its handler and hands each signal on to it."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.asked, self.installed = False, False

    def __enter__(self) -> GracefulStop:
        if _in_main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handler)
            self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        # ours is still the handler (== : each access makes a new bound method); another set
        # meanwhile (by the user) stays
        if self.installed and signal.getsignal(signal.SIGINT) == self._handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.asked:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.asked = True
        print(self.message, file=sys.stderr, flush=True)


def exit_at_interrupt(message: str, code: int) -> None:
    """From now on, a Ctrl-C flushes stdout, writes ``message`` to stderr and ends the process
    with exit status ``code`` at once, running no exit handler: for a process that is ending
    (the CLI after its verb returned), one line instead of a traceback from an exit handler.
    Main thread only (Python sets signal handlers there)."""
    def handler(signum: int, frame: Any) -> None:
        sys.stdout.flush()
        print(message, file=sys.stderr, flush=True)
        os._exit(code)
    signal.signal(signal.SIGINT, handler)
