"""Blocks in any thread, any number at once, on the same or other models (issue 35): a verb in
the main thread or a worker while a partner works in the other one, generated (hypothesis).
Each run counts raw errors (anything but a ``HookscopeError``), silent differences (the verb's
or the partner's result differs from what it computes alone, which ``tests/test_threads.py``
holds equal to plain PyTorch) and leftovers (a hook, a function mode, the SIGINT handler); all
must be 0. The switch interval is cut to 10 µs so the two threads interleave inside blocks."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from tests.test_threads import (
    B,
    D,
    N,
    Net,
    T,
    records,
    run_compare,
    run_edit,
    run_nonfinite,
    run_nonfinite_backward,
    run_stats,
    run_steer,
    run_sweep,
    run_tree,
    same,
)

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="the main thread's part needs the main thread")


def run_capture(model: Net, x: torch.Tensor) -> Any:
    with hookscope.capture(model, "emb", "block", "block::relu") as acts:
        for _ in range(N):
            model(x)
    return records(acts, "emb", "block", "block::relu")


VERBS: dict[str, Callable[[Net, torch.Tensor], Any]] = {
    "capture": run_capture,
    "edit ::relu": lambda m, x: run_edit(m, x, None),  # type: ignore[arg-type]
    "steer positions": lambda m, x: run_steer(m, x, None),  # type: ignore[arg-type]
    "stats": lambda m, x: run_stats(m, x, None),  # type: ignore[arg-type]
    "compare": lambda m, x: run_compare(m, x, None),  # type: ignore[arg-type]
    "find_nonfinite": lambda m, x: run_nonfinite(m, x, None),  # type: ignore[arg-type]
    "find_nonfinite backward": lambda m, x: run_nonfinite_backward(m, x, None),  # type: ignore[arg-type]
    "tree ops": lambda m, x: run_tree(m, x, None),  # type: ignore[arg-type]
    "patching_sweep": lambda m, x: run_sweep(m, x, None),  # type: ignore[arg-type]
}


def _train(model: Net, other: Net, x: torch.Tensor) -> Any:
    """A training thread's step without the update: zero_grad, forward, backward."""
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _forward(model: Net, other: Net, x: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(x)


def _capture_relu_other(model: Net, other: Net, x: torch.Tensor) -> Any:
    with hookscope.capture(other, "block::relu") as acts:
        other(x)
    return acts.calls("block::relu")


def _edit_relu_other(model: Net, other: Net, x: torch.Tensor) -> Any:
    with hookscope.edit(other, {"block::relu": lambda t: t * 2}), torch.no_grad():
        return other(x)


def _capture_same(model: Net, other: Net, x: torch.Tensor) -> Any:
    with hookscope.capture(model, "emb", "block::relu") as acts:
        model(x)
    return records(acts, "emb", "block::relu")


def _stats_same(model: Net, other: Net, x: torch.Tensor) -> Any:
    return {k: float(s.mean) for k, s in hookscope.stats(model, [x], ["block"]).items()}


PARTNERS: dict[str, Callable[[Net, Net, torch.Tensor], Any]] = {
    "plain forward, same model": _forward,
    "training step, same model": _train,
    "capture ::relu, other model": _capture_relu_other,
    "edit ::relu, other model": _edit_relu_other,
    "capture, same model": _capture_same,
    "stats, same model": _stats_same,
}


def _leftovers(*models: nn.Module) -> list[str]:
    found = [f"{h.path}: {h.kind}" for m in models for h in hookscope.hooks(m) if h.source == "hookscope"]
    found += ["a function mode"] * torch._C._len_torch_function_stack()
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        found.append(f"SIGINT handler {signal.getsignal(signal.SIGINT)!r}")
    return found


class Tally:
    def __init__(self) -> None:
        self.tried = self.clean = 0
        self.raw: list[str] = []
        self.silent: list[str] = []
        self.left: list[str] = []


TALLY = Tally()


@pytest.fixture(autouse=True)
def fast_switching() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        signal.signal(signal.SIGINT, previous)


def one_run(verb: str, partner: str, verb_in_main: bool) -> tuple[list[str], list[str], list[str]]:
    """Run ``verb`` in one thread while ``partner`` loops in the other (at least once, until
    the verb is done); return (raw errors, silent differences, leftovers)."""
    torch.manual_seed(0)
    model, other = Net(), Net()
    x = torch.randn(B, T, D)
    y = x.flip(0) + 1
    verb_alone = VERBS[verb](model, x)
    partner_alone = PARTNERS[partner](model, other, y)
    model.zero_grad(set_to_none=True)
    raw: list[str] = []
    silent: list[str] = []
    done = threading.Event()

    def verb_side() -> None:
        try:
            if not same(VERBS[verb](model, x), verb_alone):
                silent.append(f"{verb}: its result changed")
        except hookscope.HookscopeError:
            pass  # a refusal names its reason: not raw
        except BaseException as exc:  # noqa: BLE001 - counted
            raw.append(f"{verb}: {type(exc).__name__}: {exc}")
        finally:
            done.set()

    def partner_side() -> None:
        runs = 0
        while not done.is_set() or runs == 0:
            runs += 1
            try:
                if not same(PARTNERS[partner](model, other, y), partner_alone):
                    silent.append(f"{partner}: its result changed")
                    return
            except hookscope.HookscopeError:
                pass
            except BaseException as exc:  # noqa: BLE001 - counted
                raw.append(f"{partner}: {type(exc).__name__}: {exc}")
                return

    worker = threading.Thread(target=partner_side if verb_in_main else verb_side, daemon=True)
    worker.start()
    (verb_side if verb_in_main else partner_side)()
    worker.join(timeout=60)
    assert not worker.is_alive(), "a thread hung"
    model.zero_grad(set_to_none=True)
    return raw, silent, _leftovers(model, other)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(verb=st.sampled_from(sorted(VERBS)), partner=st.sampled_from(sorted(PARTNERS)),
       verb_in_main=st.booleans())
def test_verbs_and_partners_in_any_thread(verb: str, partner: str, verb_in_main: bool) -> None:
    raw, silent, left = one_run(verb, partner, verb_in_main)
    where = "main" if verb_in_main else "worker"
    assert (raw, silent, left) == ([], [], []), (verb, partner, where)


@pytest.mark.parametrize("handler", ["default", "users", "ignored"])
def test_blocks_racing_in_threads_leave_the_users_sigint_handler(handler: str) -> None:
    """Main-thread blocks and worker blocks at once, on one model and on others: the SIGINT
    handler is the user's own afterwards (exactly: a function, default_int_handler, SIG_IGN),
    no worker ever gets 'signal only works in main thread', and Ctrl-C still reaches the user."""
    got: list[int] = []

    def users(signum: int, frame: Any) -> None:
        got.append(signum)

    wanted = {"default": signal.default_int_handler, "users": users, "ignored": signal.SIG_IGN}[handler]
    signal.signal(signal.SIGINT, wanted)
    shared, x = Net(), torch.randn(B, T, D)
    errors: list[str] = []

    def blocks(model: Net) -> None:
        try:
            for i in range(40):
                with hookscope.capture(model, "emb", "block::relu" if i % 2 else "block"):
                    model(x)
        except BaseException as exc:  # noqa: BLE001 - counted
            errors.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=blocks, args=(m,)) for m in (shared, Net(), copy.deepcopy(shared))]
    for worker in workers:
        worker.start()
    blocks(shared)
    for worker in workers:
        worker.join(timeout=60)
    assert errors == []
    assert signal.getsignal(signal.SIGINT) is wanted
    if handler == "default":
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    elif handler == "users":
        signal.raise_signal(signal.SIGINT)
        assert got == [signal.SIGINT]
    assert _leftovers(shared) == ["SIGINT handler " + repr(wanted)] * (handler != "default")


_FIRST_USE = {
    # a thread's first compile loads torch._dynamo while another thread opens blocks: the
    # module is in sys.modules half made (AttributeError 'partially initialized module')
    "dynamo loading in another thread": """
t = threading.Thread(target=lambda: __import__("torch._dynamo")); t.start()
while t.is_alive():
    run(m0)
""",
    # two threads' first blocks once dynamo is loaded: both defined the hookscope::keep
    # operator ('Library object has been destroyed')
    "two first blocks at once": """
import torch._dynamo
ts = [threading.Thread(target=lambda m=m: [run(m) for _ in range(20)]) for m in (m0, m1)]
[t.start() for t in ts]; [t.join() for t in ts]
""",
}


@pytest.mark.parametrize("race", sorted(_FIRST_USE))
def test_compile_set_up_races_raise_nothing(race: str) -> None:
    """The attack of the merged main (issue 35): 3 of 3 and 3 of 4 runs raised; the set-up
    waits for torch._dynamo's import and runs once, under a lock."""
    code = """
import threading, torch, hookscope
from torch import nn
m0, m1 = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))
x, errors = torch.randn(2, 4), []
def run(m):
    try:
        with hookscope.capture(m, "0") as acts:
            m(x)
        assert torch.equal(acts["0"], m(x))
    except Exception as err:
        errors.append(repr(err))
""" + _FIRST_USE[race] + "\nprint(len(errors), errors[:1])\n"
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(src)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "0", done.stdout
