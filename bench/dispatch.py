"""Per-call dispatch cost: 200 ``Linear(8, 8)`` layers, hookscope's hook against a bare hook.

``python -m bench.dispatch`` prints, per hooked module call, the microseconds each way of
capturing adds to the forward pass without hooks, and hookscope's cost as a ratio to a bare
``register_forward_hook`` that appends ``output.detach()`` (goals, issue 14: at most 1.15x per
call in steady state, at most 1.3x with set-up and take-down around every forward).

It also prints the whole forward's time, hooks included, hookscope's over the bare hook's: the
reading issue 48 quotes (x1.11-1.28 steady); the per-call ratio of added costs is the stricter.

Two settings:
- steady state: hooks registered once (one ``hookscope.capture`` block), ``forwards`` forward
  passes timed inside it; this is the dispatch cost proper;
- per capture: hooks registered and removed around every forward pass (a ``with capture`` or
  ``hookscope.run`` in a loop), adding each tool's set-up and take-down.

The floor torch sets: hookscope keeps each output as a lazy clone (``torch._lazy_clone``,
copy-on-write, so no later in-place write changes it), which costs more than ``detach()``; the
case *bare hook, lazy clone* is a bare hook keeping exactly that, and hookscope's ratio to it is
what hookscope's own checks (thread, copy, recompute, compile, tensor kind) add.

Rounds interleave the cases (each round starts one case later). Times are CPU time of the
main thread (``time.thread_time``), which other jobs on a shared 2-core machine disturb less than
wall time; these layers are too small for torch's intra-op threads. Costs per call are medians
over rounds of (case - no hooks) / layers, and ratios medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.models import LinearStack

CLOCK = time.thread_time
#: the torch-only floor of a capture whose values stay right: a bare hook keeping a lazy clone
FLOOR = "bare hook, lazy clone, steady"


def _bare_hooks(model: nn.Module, store: list[torch.Tensor], keep: Callable[[torch.Tensor], torch.Tensor]
                = torch.Tensor.detach) -> list[Any]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        store.append(keep(output))
    return [layer.register_forward_hook(hook) for layer in model.layers]


def _timed(body: Callable[[], None]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = CLOCK()
        body()
        return CLOCK() - start
    finally:
        gc.enable()


def _round(model: nn.Module, x: torch.Tensor, forwards: int, shift: int) -> dict[str, float]:
    """One round of every case, starting ``shift`` cases later; seconds per forward pass."""
    import hookscope

    def loop() -> None:
        for _ in range(forwards):
            model(x)

    def no_hooks() -> float:
        return _timed(loop)

    def bare_steady() -> float:
        store: list[torch.Tensor] = []
        handles = _bare_hooks(model, store)
        try:
            return _timed(loop)
        finally:
            for handle in handles:
                handle.remove()

    def floor_steady() -> float:  # torch's price of a value no later in-place write changes
        store: list[torch.Tensor] = []
        handles = _bare_hooks(model, store, torch._lazy_clone)
        try:
            return _timed(loop)
        finally:
            for handle in handles:
                handle.remove()

    def hookscope_steady() -> float:
        with hookscope.capture(model, "layers.*"):
            return _timed(loop)

    def bare_per_capture() -> float:
        def body() -> None:
            for _ in range(forwards):
                store: list[torch.Tensor] = []
                handles = _bare_hooks(model, store)
                model(x)
                for handle in handles:
                    handle.remove()
        return _timed(body)

    def hookscope_per_capture() -> float:
        def body() -> None:
            for _ in range(forwards):
                with hookscope.capture(model, "layers.*"):
                    model(x)
        return _timed(body)

    cases = {"no hooks": no_hooks, "bare hook, steady": bare_steady, FLOOR: floor_steady,
             "hookscope, steady": hookscope_steady, "bare hook, per capture": bare_per_capture,
             "hookscope, per capture": hookscope_per_capture}
    names = list(cases)
    names = names[shift % len(names):] + names[:shift % len(names)]
    seconds = {name: cases[name]() / forwards for name in names}
    return {name: seconds[name] for name in cases}


def measure(layers: int = 200, forwards: int = 100, runs: int = 15, warmups: int = 2,
            grad: str = "inference") -> dict[str, Any]:
    """Run the dispatch benchmark and return its figures.

    Returns:
        ``{"layers", "forwards", "runs", "forward_us": {case: median us per forward},
        "per_call_us": {case: added us per hooked call}, "ratio_steady", "ratio_per_capture"
        (medians of the per-round ratios), "ratios_steady", "ratios_per_capture" (each round's),
        "ratio_steady_q3", "ratio_per_capture_q3" (their upper quartiles)}``.
    """
    model, x = LinearStack(layers).eval(), torch.randn(1, 8)
    rounds: list[dict[str, float]] = []
    with (torch.inference_mode() if grad == "inference" else torch.no_grad()):
        for index in range(warmups + runs):
            result = _round(model, x, forwards, index)
            if index >= warmups:
                rounds.append(result)
    forward_us = {name: statistics.median(r[name] for r in rounds) * 1e6 for name in rounds[0]}
    added = {name: [(r[name] - r["no hooks"]) * 1e6 / layers for r in rounds]
             for name in rounds[0] if name != "no hooks"}

    def ratios(ours: str, theirs: str) -> list[float]:
        return [a / b for a, b in zip(added[ours], added[theirs])]

    steady = ratios("hookscope, steady", "bare hook, steady")
    floor = ratios(FLOOR, "bare hook, steady")
    over_floor = ratios("hookscope, steady", FLOOR)
    per_capture = ratios("hookscope, per capture", "bare hook, per capture")
    # the whole forward's time, hooks included (issue 48 quotes this reading): the same cases
    forward_steady = [r["hookscope, steady"] / r["bare hook, steady"] for r in rounds]
    forward_per_capture = [r["hookscope, per capture"] / r["bare hook, per capture"] for r in rounds]
    return {"layers": layers, "forwards": forwards, "runs": runs, "grad_mode": grad,
            "clock": "thread CPU time", "forward_us": forward_us,
            "per_call_us": {name: statistics.median(values) for name, values in added.items()},
            "ratio_steady": statistics.median(steady), "ratios_steady": steady,
            "ratio_steady_q3": _q3(steady), "ratio_floor": statistics.median(floor),
            "ratio_floor_q3": _q3(floor), "ratio_over_floor": statistics.median(over_floor),
            "ratio_over_floor_q3": _q3(over_floor),
            "ratio_per_capture": statistics.median(per_capture),
            "ratios_per_capture": per_capture, "ratio_per_capture_q3": _q3(per_capture),
            "forward_ratio_steady": statistics.median(forward_steady),
            "forward_ratio_steady_q3": _q3(forward_steady),
            "forward_ratio_per_capture": statistics.median(forward_per_capture),
            "forward_ratio_per_capture_q3": _q3(forward_per_capture)}


def _q3(values: list[float]) -> float:
    """Upper quartile of the per-round ratios (the value itself for one round)."""
    return values[0] if len(values) == 1 else statistics.quantiles(values, n=4, method="inclusive")[2]


def format_result(result: dict[str, Any]) -> str:
    """Return the figures as an aligned text table."""
    lines = [f"dispatch: {result['layers']} x Linear(8, 8), batch 1, {result['forwards']} "
             f"forwards per round, median of {result['runs']} rounds ({result['grad_mode']}, "
             f"{result.get('clock', 'wall time')})",
             f"  {'case':30s} {'us/forward':>11s} {'us/call added':>14s}"]
    for name, us in result["forward_us"].items():
        added = result["per_call_us"].get(name)
        lines.append(f"  {name:30s} {us:11.1f} {'' if added is None else f'{added:14.2f}'}")
    lines.append(f"  hookscope / bare hook per call, median (upper quartile) of per-round ratios: "
                 f"steady {result['ratio_steady']:.2f}x ({result.get('ratio_steady_q3', math.nan):.2f}x; "
                 f"goal <= 1.15x), per capture {result['ratio_per_capture']:.2f}x "
                 f"({result.get('ratio_per_capture_q3', math.nan):.2f}x; goal <= 1.3x)")
    if "forward_ratio_steady" in result:
        lines.append(f"  the whole forward, hooks included, hookscope / bare hook: steady "
                     f"{result['forward_ratio_steady']:.2f}x ({result['forward_ratio_steady_q3']:.2f}x), "
                     f"per capture {result['forward_ratio_per_capture']:.2f}x "
                     f"({result['forward_ratio_per_capture_q3']:.2f}x)")
    if "ratio_floor" in result:
        lines.append(f"  torch's floor (a bare hook keeping torch._lazy_clone instead of detach) / bare "
                     f"hook per call: {result['ratio_floor']:.2f}x ({result['ratio_floor_q3']:.2f}x); "
                     f"hookscope / that floor: {result['ratio_over_floor']:.2f}x "
                     f"({result['ratio_over_floor_q3']:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dispatch", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--forwards", type=int, default=100, help="forward passes per round")
    parser.add_argument("--runs", type=int, default=15, help="timed rounds (median)")
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grad-mode", choices=("inference", "no_grad"), default="inference")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = measure(args.layers, args.forwards, args.runs, args.warmups, args.grad_mode)
    finally:  # leave a calling process (python -m bench --in-process) as it was
        torch.set_num_threads(threads)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
