"""Issue 47: the ground-truth probe forward (``engine.ground_truth``: standard names and the lens
check themselves against ``output_hidden_states``) is none of any block's forwards, and silences
no block: blocks open in another thread on the same model go on recording and editing while it
runs, and the probe's result is what it is alone.

Plain PyTorch is the reference: a bare forward hook recording ``transformer.h.1``'s output and
one adding ``V`` to ``transformer.h.0``'s output (what ``steer`` does).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

import hookscope
from hookscope.engine import ground_truth, index, resolve_standard
from tests.models import tiny_gpt2

IDS = torch.tensor([[5, 9, 2, 14, 7, 3]])
STEERED, CAPTURED = "transformer.h.0", "transformer.h.1"
V = torch.linspace(-1.0, 1.0, 32)
WAIT_S = 20.0


def plain(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: the logits of a forward with ``V`` added to ``STEERED``'s output, and
    ``CAPTURED``'s output in it."""
    seen: list[torch.Tensor] = []
    handles = [model.get_submodule(STEERED).register_forward_hook(lambda m, a, o: o + V),
               model.get_submodule(CAPTURED).register_forward_hook(
                   lambda m, a, o: seen.append(o.detach().clone()))]
    try:
        with torch.no_grad():
            logits = model(IDS).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, seen[0]


def blocks_forward(model: torch.nn.Module, opened: threading.Event | None = None,
                   go: threading.Event | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward inside a capture of ``CAPTURED`` and a steer of ``STEERED`` (opened first,
    then, when given, ``opened`` set and ``go`` waited for); the logits and the record."""
    with hookscope.capture(model, CAPTURED) as acts, hookscope.steer(model, {STEERED: V}):
        if opened is not None and go is not None:
            opened.set()
            assert go.wait(WAIT_S)
        with torch.no_grad():
            logits = model(IDS).logits
    return logits, acts[CAPTURED]


def same_probe(a: ground_truth.Probe | str, b: ground_truth.Probe | str) -> bool:
    """Whether two probes hold the same hidden states, module outputs and call order."""
    assert isinstance(a, ground_truth.Probe) and isinstance(b, ground_truth.Probe), (a, b)
    return (len(a.output.hidden_states) == len(b.output.hidden_states)
            and all(torch.equal(x, y) for x, y in zip(a.output.hidden_states, b.output.hidden_states))
            and torch.equal(a.output.logits, b.output.logits)
            and a.outputs.keys() == b.outputs.keys() and a.calls == b.calls
            and all(torch.equal(x, y) for p in a.outputs for x, y in zip(a.outputs[p], b.outputs[p])))


def test_blocks_open_in_another_thread_act_during_the_probe_forward() -> None:
    """The other thread's blocks are open before the probe begins, and its forward runs while
    the probe's forward is halfway (a user's hook holds the probe there until that forward is
    done): its capture holds the plain value, its steer is applied, and the probe equals one
    run alone. (main took hookscope's hooks out of torch's tables for the probe: the forward
    recorded nothing and was not steered.)"""
    model = tiny_gpt2()
    expected_logits, expected_record = plain(model)
    alone = ground_truth._run_probe(index(model), watch=True)
    hooks_before = hookscope.hooks(model)  # transformers' own hidden-state hooks among them
    opened, probing, halfway, done = (threading.Event() for _ in range(4))
    worker: dict[str, Any] = {}

    def hold(module: torch.nn.Module, args: Any, output: Any) -> None:
        if probing.is_set() and threading.get_ident() != worker.get("ident"):  # the probe's call
            halfway.set()
            assert done.wait(WAIT_S)

    def work() -> None:
        worker["ident"] = threading.get_ident()
        try:
            worker["result"] = blocks_forward(model, opened, halfway)
        finally:
            done.set()

    handle = model.get_submodule(CAPTURED).register_forward_hook(hold)
    thread = threading.Thread(target=work)
    try:
        thread.start()
        assert opened.wait(WAIT_S)
        probing.set()
        during = ground_truth._run_probe(index(model), watch=True)
    finally:
        done.set()
        thread.join(WAIT_S)
        handle.remove()
    logits, record = worker["result"]
    assert halfway.is_set()  # the worker's forward ran while the probe's was halfway
    torch.testing.assert_close(record, expected_record, rtol=0, atol=0)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    assert same_probe(during, alone)
    assert hookscope.hooks(model) == hooks_before


def test_captures_and_steers_in_a_loop_beside_probe_forwards_in_another() -> None:
    """One thread captures and steers in a loop; another runs probe forwards on the same model
    and resolves a standard name on fresh shallow copies of it (each a first use: a probe forward
    on the shared modules). Every capture and every steered forward equals plain PyTorch's, and
    every probe equals one run alone."""
    model = tiny_gpt2()
    expected_logits, expected_record = plain(model)
    alone = ground_truth._run_probe(index(model), watch=True)
    structural = resolve_standard(index(model), "resid_post.0")
    hooks_before = hookscope.hooks(model)  # transformers' own hidden-state hooks among them
    counts = {"blocks": 0, "probes": 0}
    failures: list[str] = []

    def enough() -> bool:
        return counts["blocks"] >= 12 and counts["probes"] >= 6

    def blocks_loop() -> None:
        while not enough() and not failures:
            logits, record = blocks_forward(model)
            if not (torch.equal(logits, expected_logits) and torch.equal(record, expected_record)):
                failures.append(f"block {counts['blocks']} differs from plain PyTorch")
            counts["blocks"] += 1

    def probe_loop() -> None:
        while not enough() and not failures:
            if counts["probes"] % 2:
                if not same_probe(ground_truth._run_probe(index(model), watch=True), alone):
                    failures.append(f"probe {counts['probes']} differs from one alone")
            elif resolve_standard(index(copy.copy(model)), "resid_post.0") != structural:
                failures.append(f"resid_post.0 on a fresh copy resolved elsewhere ({counts['probes']})")
            counts["probes"] += 1

    threads = [threading.Thread(target=blocks_loop), threading.Thread(target=probe_loop)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []
    assert enough()
    assert hookscope.hooks(model) == hooks_before


def test_the_probe_thread_is_no_ones_and_counted_as_no_other_threads_call() -> None:
    """A block of this thread whose modules ran only in the probe forward reports them as
    never run (not as run 'in other threads'), and records nothing of it."""
    model = tiny_gpt2()
    with hookscope.capture(model, CAPTURED, on_unfired="ignore") as acts:
        probe = ground_truth._run_probe(index(model), watch=True)
    assert isinstance(probe, ground_truth.Probe)
    assert "no forward pass ran inside the with block" in acts.unfired[CAPTURED]
    assert "other threads" not in acts.unfired[CAPTURED]  # main's set_aside: the same; a thread: not


def test_a_module_swapped_for_another_makes_the_probe_again() -> None:
    """The probe is kept per model while its modules stay the same: a block swapped for one of
    other weights (the module count unchanged) gets a new probe, whose hidden states are the
    model's own now (it was kept by the count of modules, and went stale)."""
    model = tiny_gpt2()
    ground_truth.probe_of(index(model))
    torch.manual_seed(1)
    fresh = copy.deepcopy(model.transformer.h[1])
    for parameter in fresh.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    model.transformer.h[1] = fresh
    probe = ground_truth.probe_of(index(model))
    assert not isinstance(probe, str)
    with torch.no_grad():
        now = model(**probe.feed, output_hidden_states=True).hidden_states
    for got, want in zip(probe.output.hidden_states, now, strict=True):
        assert torch.equal(got, want)
