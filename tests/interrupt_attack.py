"""An exception raised asynchronously at a random moment of a block, over every verb (issue 47).

Each run arms an attacker, runs one block of one verb, and checks what the block left: every
hook table of every module of the model (torch's own dicts, compared with those before), torch's
global module hooks, ``copyreg.dispatch_table``, the grad mode, the handler of every signal,
torch's function-mode stack, and a plain forward, which must equal the reference computed
before any block ran.

Attackers (``ATTACKERS``):

- ``"alarm"``: ``signal.setitimer`` fires SIGALRM after the delay and its handler (the user's,
  not hookscope's) raises ``KeyboardInterrupt``: Python runs it in the main thread at the next
  instruction that checks for pending work (a call's entry, a call's return, a loop's jump);
- ``"async"``: a timer thread sets ``KeyboardInterrupt`` in the main thread with
  ``ctypes.pythonapi.PyThreadState_SetAsyncExc``: raised there at the next such instruction,
  no signal involved (so no handler of hookscope's can hold it back).

``cut_each_start`` aims instead of sampling: an exception raised by a profile function at the
"call" event of the k-th Python function the block runs (its first instruction, ``RESUME``, where
the interpreter also raises a pending asynchronous exception), for every k in turn: every
function entry of the verb, or every ``__enter__``/``__exit__`` (``names``).

Delays are uniform over 1.2 times the verb's own duration (measured first), so they land before,
inside and just after the block. Run as a script to count on any checkout::

    PYTHONPATH=src python -m tests.interrupt_attack --runs 200 --attacker alarm
    PYTHONPATH=src python -m tests.interrupt_attack --attacker cut
"""

from __future__ import annotations

import argparse
import copyreg
import ctypes
import dis
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

import hookscope
from tests.models import ReluBlocks

#: every table of torch's module hooks (hooks, flags) on a module and globally
MODULE_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks")
GLOBAL_TABLES = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
                 "_global_backward_hooks", "_global_backward_pre_hooks", "_global_buffer_registration_hooks",
                 "_global_module_registration_hooks", "_global_parameter_registration_hooks")
_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]

VERBS = ("capture", "edit", "steer", "ablate", "patch", "stats", "monitor step", "run", "find_nonfinite")
ATTACKERS = ("alarm", "async")
TALLY = ("runs", "completed", "interrupted", "other error", "hooks left", "copyreg left",
         "grad mode changed", "signal handlers changed", "function modes left", "forward changed",
         "left by one at __exit__'s entry")
#: what an exception raised at the first instruction of a block's ``__exit__`` left (before
#: any of its code ran: beyond Python code; ``engine.interrupts``), counted apart
AT_EXIT_ENTRY = "left by one at __exit__'s entry"


def state(model: nn.Module) -> dict[str, Any]:
    """What a block must leave as it found: hook tables (their keys), copyreg, grad mode,
    signal handlers, the function-mode stack."""
    return {
        "hooks": {(path, table): tuple(getattr(module, table, {}))
                  for path, module in model.named_modules(remove_duplicate=False)
                  for table in MODULE_TABLES}
                 | {("<global>", table): tuple(getattr(torch_module, table, {})) for table in GLOBAL_TABLES},
        "copyreg": dict(copyreg.dispatch_table),
        "grad mode": torch.is_grad_enabled(),
        "signal handlers": {s: signal.getsignal(s) for s in _SIGNALS},
        "function modes": torch._C._len_torch_function_stack(),
    }


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The tally keys of what differs between two ``state`` results."""
    names = {"hooks": "hooks left", "copyreg": "copyreg left", "grad mode": "grad mode changed",
             "signal handlers": "signal handlers changed", "function modes": "function modes left"}
    return [names[key] for key in names if before[key] != after[key]]


def restore(model: nn.Module, before: dict[str, Any]) -> None:
    """Put back what a leaking run left, so one leak is not counted again by the next run."""
    for (path, table), keys in before["hooks"].items():
        owner = torch_module if path == "<global>" else model.get_submodule(path)
        live = getattr(owner, table, {})
        for key in [k for k in live if k not in keys]:
            live.pop(key)
    copyreg.dispatch_table.clear()
    copyreg.dispatch_table.update(before["copyreg"])
    torch.set_grad_enabled(before["grad mode"])
    for signum, handler in before["signal handlers"].items():
        if signal.getsignal(signum) is not handler and handler is not None:
            signal.signal(signum, handler)
    while torch._C._len_torch_function_stack() > before["function modes"]:
        torch._C._pop_torch_function_stack()
    from hookscope.engine import interrupts  # the state of a block whose exit never ran
    from hookscope.engine.door import copies

    for name in ("_open", "_pending"):
        getattr(interrupts, name, {}).clear()
    getattr(interrupts, "_put_back", lambda: None)()
    copies._open = []  # else later blocks see one open and never register copyreg's reducer
    copies._previous = None


def blocks(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """One callable per verb, each running one whole block of it on ``model``."""
    with hookscope.capture(model, "blocks.0") as source:
        model(x.flip(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights never move

    def hooked(make: Callable[[], Any]) -> Callable[[], Any]:
        def go() -> Any:
            with make():
                model(x)
        return go

    def monitored() -> None:
        with hookscope.monitor(model, "blocks.*", every=1, guard="raise"):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return {
        "capture": hooked(lambda: hookscope.capture(model, "blocks.*", "head", "blocks.0::relu")),
        "edit": hooked(lambda: hookscope.edit(model, {"blocks.0": lambda o: o * 2,
                                                      "blocks.1::relu": lambda o: o + 1})),
        "steer": hooked(lambda: hookscope.steer(model, {"blocks.*": torch.ones(8)}, positions=-1)),
        "ablate": hooked(lambda: hookscope.ablate(model, "blocks.1")),
        "patch": hooked(lambda: hookscope.patch(model, source=source, layers="blocks.0")),
        "stats": lambda: hookscope.stats(model, [x, x], ["blocks.*", "blocks.0::relu"]),
        "monitor step": monitored,
        "run": lambda: hookscope.run(model, x, layers=["blocks.*", "head::linear"]),
        "find_nonfinite": lambda: hookscope.find_nonfinite(model, x),  # a function mode
    }


class _Async:
    """Sets ``KeyboardInterrupt`` in the main thread after ``delay`` seconds, unless disarmed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed = False
        self.main = threading.main_thread().ident
        self.timer: threading.Timer | None = None

    def arm(self, delay: float) -> None:
        self.armed = True
        self.timer = threading.Timer(delay, self._fire)
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.armed:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.main),
                                                           ctypes.py_object(KeyboardInterrupt))
                self.armed = False

    def disarm(self) -> None:
        with self.lock:
            self.armed = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
        # One set but not yet raised (the block ended first) is not the block's: replaced by a
        # marker raised and caught here. Not cleared with NULL: CPython 3.11 then leaves the
        # eval breaker set, and a later frame's RESUME under a profile function (cut_each_start)
        # loops on it for ever.
        try:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.main),
                                                       ctypes.py_object(_Drained))
            for _ in range(1000):  # a backward jump checks the eval breaker: raised here
                pass
        except _Drained:
            pass


class _Drained(Exception):
    """The marker ``_Async.disarm`` sets in the main thread and catches at once."""


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextmanager
def _alarm_handler() -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, _raise_interrupt)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def attack(verbs: tuple[str, ...] = VERBS, runs: int = 100, *, attacker: str = "alarm",
           seed: int = 0, rng: random.Random | None = None,
           on_leak: Callable[[str, list[str]], None] | None = None) -> dict[str, dict[str, int]]:
    """Run each verb ``runs`` times with ``attacker`` striking after a random delay; return the
    tally per verb (``TALLY``). ``on_leak(verb, what)`` is told each leaking run."""
    torch.manual_seed(seed)
    rng = rng or random.Random(seed)
    model, x = ReluBlocks(), torch.randn(2, 5, 8)
    with torch.no_grad():
        reference = model(x)
    made = blocks(model, x)
    durations = {}
    for verb in verbs:  # the first call imports lazily; the delays span a later one
        made[verb]()
        start = time.perf_counter()
        for _ in range(3):
            made[verb]()
        durations[verb] = (time.perf_counter() - start) / 3
    counts = {verb: dict.fromkeys(TALLY, 0) for verb in verbs}
    before = state(model)
    striker = _Async()
    with _alarm_handler():
        before = state(model)  # with the attacker's SIGALRM handler in place
        for verb in verbs:
            tally = counts[verb]
            for _ in range(runs):
                tally["runs"] += 1
                delay = max(rng.uniform(0.0, durations[verb] * 1.2), 1e-6)
                outcome, at_exit_entry = _one(made[verb], delay, attacker, striker)
                tally[outcome] += 1
                left = differences(before, state(model))
                if not computes(model, x, reference):
                    left.append("forward changed")
                for what in [AT_EXIT_ENTRY] if left and at_exit_entry else left:
                    tally[what] += 1
                if left:
                    if on_leak is not None:
                        on_leak(verb, left)
                    restore(model, before)
    return counts


def _one(block: Callable[[], Any], delay: float, attacker: str, striker: _Async) -> tuple[str, bool]:
    """Run ``block`` with the attacker armed: 'completed', 'interrupted' or 'other error', and
    whether the interrupt was raised at the first instruction of an ``__exit__``."""
    try:
        try:
            if attacker == "alarm":
                signal.setitimer(signal.ITIMER_REAL, delay)
            else:
                striker.arm(delay)
            block()
        finally:
            if attacker == "alarm":
                signal.setitimer(signal.ITIMER_REAL, 0)
            else:
                striker.disarm()
            _settle()
        return "completed", False
    except KeyboardInterrupt as err:
        return "interrupted", _at_exit_entry(err)
    except BaseException as err:  # noqa: BLE001 - counted and printed
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return "other error", False


def _at_exit_entry(err: BaseException) -> bool:
    """Whether ``err`` was raised in an ``__exit__`` at its first instruction (``RESUME``)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code.co_name != "__exit__":
        return False
    resume = next(i.offset for i in dis.get_instructions(tb.tb_frame.f_code) if i.opname == "RESUME")
    return tb.tb_lasti <= resume


def _settle() -> None:
    """Wait for a signal that hookscope held back during a ``torch.no_grad()`` exit inside a
    verb and sends again a moment later (``engine.interrupts``): it belongs to this run."""
    from hookscope.engine import interrupts

    deadline = time.perf_counter() + 1.0
    while (getattr(interrupts, "_pending", None) or getattr(interrupts, "_scheduled", False)) \
            and time.perf_counter() < deadline:
        time.sleep(0.0002)


def computes(model: nn.Module, x: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether a plain forward of ``model`` returns ``reference`` (a leaked early stop raises)."""
    try:
        with torch.no_grad():
            return torch.equal(model(x), reference)
    except BaseException:  # noqa: BLE001 - a leaked hook's error is a changed forward
        return False


class CutShort(BaseException):
    """What ``cut_each_start`` raises at a function's first instruction."""


def _cut(block: Callable[[], Any], k: int, names: tuple[str, ...] | None) -> tuple[bool, int]:
    """Run ``block`` with ``CutShort`` raised at the call event of the ``k``-th Python function
    (named in ``names``; None: any) it runs; return whether it was cut, and how many ran."""
    seen = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal seen
        if event == "call" and (names is None or frame.f_code.co_name in names):
            if seen == k:
                sys.setprofile(None)
                raise CutShort(frame.f_code.co_qualname)
            seen += 1
    sys.setprofile(profile)
    try:
        block()
        return False, seen
    except CutShort:
        return True, seen
    finally:
        sys.setprofile(None)


def cut_each_start(verbs: tuple[str, ...] = VERBS, *, names: tuple[str, ...] | None = None,
                   sample: int | None = None, rng: random.Random | None = None,
                   seed: int = 0) -> dict[str, tuple[int, list[tuple[int, list[str]]]]]:
    """For each verb: run one block per function entry ``k`` the block makes (``names``: only
    functions of those names; ``sample``: that many entries chosen by ``rng``, else every one),
    each cut at that entry (``_cut``); return ``{verb: (entries, [(k, what it left)])}``."""
    torch.manual_seed(seed)
    model, x = ReluBlocks(), torch.randn(2, 5, 8)
    with torch.no_grad():
        reference = model(x)
    made = blocks(model, x)
    before = state(model)
    found = {}
    for verb in verbs:
        made[verb]()  # lazy imports first
        _, entries = _cut(made[verb], -1, names)
        chosen = range(entries) if sample is None else sorted(
            (rng or random.Random(seed)).sample(range(entries), min(sample, entries)))
        leaks = []
        for k in chosen:
            _cut(made[verb], k, names)
            _settle()
            left = differences(before, state(model))
            if not computes(model, x, reference):
                left.append("forward changed")
            if left:
                leaks.append((k, left))
                restore(model, before)
        found[verb] = (entries, leaks)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="blocks per verb")
    parser.add_argument("--attacker", choices=[*ATTACKERS, "cut"], default="alarm",
                        help="cut: every function entry of each verb in turn (cut_each_start)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbs", nargs="*", default=list(VERBS))
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.attacker == "cut":
        for verb, (entries, leaks) in cut_each_start(tuple(args.verbs), seed=args.seed).items():
            print(f"{verb:14} entries cut={entries} leaking={len(leaks)} {leaks[:3]}")
        return
    counts = attack(tuple(args.verbs), args.runs, attacker=args.attacker, seed=args.seed)
    total = dict.fromkeys(TALLY, 0)
    for verb, tally in counts.items():
        print(f"{verb:14} " + " ".join(f"{k}={v}" for k, v in tally.items() if v))
        for key, value in tally.items():
            total[key] += value
    print(f"{'total':14} " + " ".join(f"{k}={v}" for k, v in total.items()))


if __name__ == "__main__":
    main()
