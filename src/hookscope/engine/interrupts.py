"""Private: no signal handler's exception lands in a block's entry or exit.

A signal's Python handler runs in the main thread at the next point where the interpreter
checks for pending work (a function's entry, a call's return, a loop's backward jump): anywhere.
Jupyter's interrupt button (SIGINT) raises ``KeyboardInterrupt`` there, and so does any handler a
program sets for another signal (a SIGALRM timeout, a SIGTERM handler). Landing between torch
registering a hook and the block recording it, halfway through removing a block's hooks, or at
the first instruction of ``__exit__`` (before any of its code runs, so no ``try`` in it can
catch it), such an exception would leave hooks, a ``copyreg`` entry or a grad mode behind.

So while a block is open in the main thread (``guard(block)`` on entry, ``unguard(block)`` in
its cleanup), hookscope's handler stands in for the Python handler of every signal that has one
(``SIGINT``'s ``default_int_handler``, a user's function for any other signal). When a signal
arrives:

- while a frame of a context manager's ``__enter__`` or ``__exit__`` (any: hookscope's blocks,
  ``torch.no_grad``'s) or of a function marked ``critical`` is on the interrupted stack, it
  holds the signal back: the block delivers it last in its entry or exit
  (``release_signals``), so it surfaces at the ``with`` statement; a hold that no
  ``release_signals`` ends (one inside ``torch.no_grad().__exit__``) ends a millisecond later,
  when a timer thread marks the signal as arrived again (the handler then delivers it, or
  holds it again). So a ``with`` statement's entry and exit are atomic with respect to signals;
- anywhere else (the body of the block, the model's forward) it hands the signal at once to the
  handler it stands in for, so the user gets exactly the exception their handler raises.

When the last main-thread block closes, each handler is put back (unless the program set another
one meanwhile). The state is one set of open blocks and one table of stood-in handlers, each
changed by single operations, entries recorded before handlers are set; ``unguard`` is
idempotent and runs in the block's cleanup, so no entry outlives its block.

Threads: Python runs signal handlers only in the main thread, and only the main thread may set
one, so a block in a worker thread needs and does nothing here; a main-thread block that a worker
closes leaves the handlers to the next main-thread block, or to the next signal (which finds no
block open, puts them back and delivers). Under ``SIG_IGN``, ``SIG_DFL`` or a handler set outside
Python nothing is stood in for.

Exceptions that are not a signal's (``PyThreadState_SetAsyncExc``, a trace function, a user's
callback) cannot be held back; the blocks tolerate them instead: each writes down what it will
undo before doing it and runs its idempotent cleanup in ``finally``, twice when the first pass is
interrupted (``engine.session``, ``engine.run``). The one moment no code inside ``__exit__`` can
cover is its first instruction (``RESUME``, where the interpreter checks for pending work before
any line runs): an exception there ends the ``with`` statement with the block's exit skipped
(a signal there waits, as above). ``never_skipped`` closes it from outside: a block's
``__exit__`` decorated with it hands the ``with`` statement, when it looks ``__exit__`` up
(before it calls ``__enter__``), a new callable of its own, which the statement holds until it
has called it, and which the block watches by weak reference; when that callable is gone and
the block is still open (its exit was cut, or an exception in ``__enter__`` outran its own
cleanup), the block's cleanup runs then, in the same thread, before the exception leaves the
``with`` statement. So no block's hooks, guard entry or grad mode outlive its ``with``
statement, whatever instruction an exception lands on (``tests/test_interrupts_async.py``).
"""

from __future__ import annotations

import _thread
import functools
import itertools
import opcode
import os
import signal
import sys
import threading
import types
import weakref
from collections.abc import Callable
from types import CodeType, FrameType, TracebackType
from typing import Any, Generic, TypeVar, overload

__all__ = ["guard", "unguard", "release_signals", "critical", "never_skipped", "GracefulStop",
           "exit_at_interrupt"]

_SIGNALS = sorted(s for s in signal.valid_signals()
                  if s not in {getattr(signal, n, None) for n in ("SIGKILL", "SIGSTOP")})
_open: set[int] = set()  # id() of the open main-thread blocks (one set operation per change)
_stood_in: dict[int, Any] = {}  # signal number -> the Python handler hookscope stands in for
_CRITICAL: set[CodeType] = set()  # code during which a signal waits (besides __enter__/__exit__)
_ENTRY_EXIT = frozenset(("__enter__", "__exit__"))
_UNKNOWN: dict[int, Any] = {signal.SIGINT: signal.default_int_handler}  # when none is known
_pending: dict[int, Any] = {}  # signal number -> its handler, for signals held back
_scheduled = False  # a courier is on its way
_RESEND_S = 0.001  # how soon a held-back signal is sent again

F = TypeVar("F", bound=Callable[..., Any])
B = TypeVar("B")
R = TypeVar("R")


def critical(function: F) -> F:
    """Mark ``function`` as cleanup a signal never interrupts (as ``__enter__``/``__exit__``):
    a signal arriving while it runs is delivered once it has returned. Returns it unchanged."""
    _CRITICAL.add(function.__code__)
    return function


def guard(block: object) -> None:
    """From now until ``unguard(block)``, a signal never lands in a context manager's entry or
    exit (module docstring). Main thread only; elsewhere nothing (no signal interrupts it)."""
    if not _in_main_thread():
        return
    _open.add(id(block))  # first: an exception after it leaves an entry unguard removes
    for signum in _SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler) and handler is not _handler:
            _stood_in[signum] = handler  # recorded before it is replaced
            signal.signal(signum, _handler)


def unguard(block: object) -> None:
    """``block`` is closed; the last main-thread block puts every handler back (one replaced
    meanwhile stays). Idempotent; from another thread it only forgets ``block``."""
    _open.discard(id(block))
    if not _open and _in_main_thread():
        _put_back()


def _put_back() -> None:
    for signum, handler in list(_stood_in.items()):
        if signal.getsignal(signum) is _handler:
            signal.signal(signum, handler)
        _stood_in.pop(signum, None)  # after: an exception between leaves it to put back again


def _handler(signum: int, frame: FrameType | None) -> None:
    handler = _stood_in.get(signum, _UNKNOWN.get(signum))
    if _open and _waits(frame):
        _pending[signum] = handler  # one dict write
        _courier()
        return
    if not _open and _in_main_thread():  # the last block was closed by another thread
        _put_back()
    _deliver(signum, handler, frame)


def release_signals() -> None:
    """Deliver the signals held back, unless a frame holding them back is still running
    outside the caller (an outer ``__exit__``): call it last in a block's entry and exit, so
    an interrupt held back there surfaces at the ``with`` statement, from the block itself."""
    if _pending and not _waits(sys._getframe(2)):
        while _pending:  # a handler delivered may hold back another signal (raise_signal)
            try:
                signum, handler = _pending.popitem()
            except KeyError:  # the courier thread (_resend) took the last one meanwhile
                break
            _deliver(signum, handler, sys._getframe(1))


def _deliver(signum: int, handler: Any, frame: FrameType | None) -> None:
    if callable(handler):
        handler(signum, frame)


def _courier() -> None:
    """Mark the held-back signals as arrived again in a moment (from another thread: doing
    it in the handler would run it again at once), for holds that no ``release``
    ends (a ``torch.no_grad()`` exit): the handler then delivers them, or holds them again."""
    global _scheduled
    if not _scheduled:
        _scheduled = True
        timer = threading.Timer(_RESEND_S, _resend)
        timer.daemon = True
        timer.start()


def _resend() -> None:
    """In the timer thread: mark each held-back signal as arrived again, for the main thread's
    Python handler only (``_thread.interrupt_main``: no kernel signal, nothing when the
    program has put back ``SIG_DFL`` or ``SIG_IGN`` meanwhile)."""
    global _scheduled
    _scheduled = False
    for signum in list(_pending):
        if _pending.pop(signum, None) is not None:
            _thread.interrupt_main(signal.Signals(signum))


def _waits(frame: FrameType | None) -> bool:
    """Whether a frame of an ``__enter__``/``__exit__`` or of a ``critical`` function is on the
    stack that ``frame`` (the interrupted one) belongs to."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _ENTRY_EXIT or code in _CRITICAL:
            return True
        frame = frame.f_back
    return False


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# ------------------------------------------------------------ an exit no exception can skip
#: the instructions with which a ``with`` statement looks up ``__exit__`` (3.11-3.13, 3.14)
_WITH_LOOKUPS = frozenset(opcode.opmap[name] for name in ("BEFORE_WITH", "LOAD_SPECIAL")
                          if name in opcode.opmap)
#: key -> weak reference to each ``with`` statement's exit callable not yet run (``_Exit``)
_held_exits: dict[int, weakref.ref[Any]] = {}
Exit = Callable[[B, type[BaseException] | None, BaseException | None, TracebackType | None], R]


def never_skipped(cleanup: Callable[[Any], object], is_open: Callable[[Any], object] = lambda block: False
                  ) -> Callable[[Exit[B, R]], _Exit[B, R]]:
    """Decorate a block's ``__exit__`` so that no exception skips its cleanup: when a ``with``
    statement ends without the block closed (an exception landed on the first instruction of
    ``__exit__``, before any of its code ran, or outran ``__enter__``'s own cleanup),
    ``cleanup(block)`` runs: after the exit (``_watched_exit``), or, when even that was cut, as
    the statement lets go of the exit it looked up (``_released``); in the same thread, before
    the exception leaves the statement (module docstring).

    ``cleanup`` must be idempotent and cheap on a closed block (it also runs after every
    normal exit, finding nothing to do), and remove everything the block may have added:
    ``HookSession._remove``'s kind. Used as
    ``@never_skipped(lambda block: block._active and block._remove())``.

    ``is_open(block)``, asked as the statement looks the exit up (before its ``__enter__``): the
    block is open already, so this statement's ``__enter__`` refuses it and the block is another
    statement's to close; its exit is then not watched (else the refused entry's release would
    run ``cleanup`` on the block that other statement holds open).

    Only a ``with`` statement's lookup is watched (an ``ExitStack``'s, or an explicit
    ``block.__exit__(...)`` call, are not: their callers' own cleanup covers them). Cost: about a
    microsecond per ``with`` statement."""
    def decorate(exit_function: Exit[B, R]) -> _Exit[B, R]:
        return _Exit(exit_function, cleanup, is_open)
    return decorate


class _Exit(Generic[B, R]):
    """The ``__exit__`` descriptor ``never_skipped`` makes. Looked up on a block by a ``with``
    statement (the calling frame runs ``BEFORE_WITH``: it is about to call ``__enter__``, then
    holds the callable on its stack until it calls it, or lets go of it when an exception ends
    the statement), it returns a callable of its own (``_watched_exit``, ``cleanup`` and a key
    bound in), watched by a weak reference whose callback (``_released``) runs ``cleanup``:
    the callable drops the reference once the exit has run, so the callback runs only when
    the statement let go of it uncalled, or cut at its first instruction. Looked up otherwise
    on a block, it is the bound exit; on the class, the plain function."""

    __slots__ = ("exit", "cleanup", "is_open")

    def __init__(self, exit_function: Exit[B, R], cleanup: Callable[[Any], object],
                 is_open: Callable[[Any], object]):
        self.exit, self.cleanup, self.is_open = exit_function, cleanup, is_open

    @overload
    def __get__(self, block: None, owner: type[Any]) -> Exit[B, R]: ...

    @overload
    def __get__(self, block: B, owner: type[Any] | None = None) -> Callable[
        [type[BaseException] | None, BaseException | None, TracebackType | None], R]: ...

    def __get__(self, block: B | None, owner: type[Any] | None = None) -> Any:
        if block is None:
            return self.exit
        frame = sys._getframe(1)
        if frame.f_code.co_code[frame.f_lasti] not in _WITH_LOOKUPS or self.is_open(block):
            return types.MethodType(self.exit, block)  # not a with statement's, or not its block
        key = next(_keys)
        held = functools.partial(_watched_exit, self.exit, self.cleanup, key, block)
        # recorded before the statement holds it; a dead reference would call nothing
        _held_exits[key] = weakref.ref(held, functools.partial(_released, self.cleanup, key, block))
        return held


_keys = itertools.count()


@critical  # a signal waits, as in any __exit__: the exit runs whole first
def _watched_exit(exit_function: Exit[Any, Any], cleanup: Callable[[Any], object], key: int, block: Any,
                  *exc: Any) -> Any:
    """A ``with`` statement's exit of ``block``: ``exit_function``, then ``cleanup`` (nothing on a
    closed block; all of it when an exception cut the exit at its first instruction), then
    nothing more to do when the statement lets go of this callable; a signal that arrived
    meanwhile is delivered last, at the ``with`` statement."""
    try:
        return exit_function(block, *exc)
    finally:
        try:
            cleanup(block)
        finally:
            _held_exits.pop(key, None)
            release_signals()  # one held back here, after the exit's own release, surfaces now


@critical
def _released(cleanup: Callable[[Any], object], key: int, block: Any, ref: weakref.ref[Any]) -> None:
    """A ``with`` statement let go of ``block``'s exit without running it (``__enter__`` raised,
    or an exception landed on ``_watched_exit``'s first instruction): ``cleanup(block)``, twice
    when an exception stops the first pass (as every block's own cleanup). It runs as a weak
    reference's callback: an exception leaving it is printed, not raised."""
    _held_exits.pop(key, None)
    try:
        cleanup(block)
    except BaseException:
        cleanup(block)
        raise


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
