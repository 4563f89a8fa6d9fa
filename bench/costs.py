"""``python -m bench.costs``: hookscope's fixed costs on this machine, as a markdown table.

One run (about a minute on a 2-core machine) measures, each against its plain-PyTorch baseline
in the same interleaved rounds:

- per hooked module per call, eager (``bench.dispatch``: 200 ``Linear(8, 8)``, batch 1, steady
  state inside one ``capture`` block) and the same with a block's set-up and take-down around
  every forward;
- per captured module per call of a ``torch.compile(fullgraph=True)`` model (8 ``Linear(512,
  512)`` + ReLU blocks, batch 64, inductor; capture of every ``Linear`` against the compiled
  forward without hooks; ``--no-compile`` leaves it out);
- ``hookscope.monitor`` per training step (``bench.train_guard``'s 4 x ``Linear(256, 256)``
  MLP, batch 64, AdamW): the guard alone (``every=0``), a step between sampled ones, a sampled
  step, and the defaults over a run (``every=100``);
- the guard's finiteness check alone on gradients of 1M and 8M float32 elements (its cost per
  million parameters).

Each figure is (case - baseline), from the medians of per-round figures; the table says what
it was measured on and how to apply it. Prints the table only (paste it into
docs/performance.md); the sizes and the machine go in its header lines.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Row = tuple[str, str, str, str]  # cost, unit, measured on, how to apply it


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def eager_rows(runs: int) -> list[Row]:
    """Per hooked module per call, and per module per block (``bench.dispatch``)."""
    from bench import dispatch

    result = dispatch.measure(layers=200, forwards=50, runs=runs, warmups=1)
    per = result["per_call_us"]
    steady, block, bare = per["hookscope, steady"], per["hookscope, per capture"], per["bare hook, steady"]
    on = "200 x `Linear(8, 8)`, batch 1, inference mode"
    return [(f"**{steady:.2f} us**", "per hooked module, per call (eager, steady)", on,
             f"added time per forward ~= modules hooked x {steady:.1f} us "
             f"(a bare hook keeping `detach()`: {bare:.2f} us)"),
            (f"**{block - steady:.2f} us**", "per module, per `with` block (set-up + take-down)", on,
             f"added time per block ~= modules selected x {block - steady:.1f} us, on top of the "
             f"per-call cost")]


class _Blocks(nn.Module):
    def __init__(self, width: int = 512, blocks: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def compiled_rows(runs: int) -> list[Row]:
    """Per captured module per call inside ``torch.compile(fullgraph=True)`` (inductor)."""
    import hookscope

    torch.manual_seed(0)
    model, x = _Blocks().eval(), torch.randn(64, 512)
    compiled = torch.compile(model, fullgraph=True)
    paths = [f"layers.{i}" for i in range(len(model.layers))]

    def captured() -> None:
        with hookscope.capture(compiled, *paths):
            compiled(x)

    forwards = 20
    bare, hooked = [], []
    with torch.no_grad():
        started = time.perf_counter()
        captured()  # the graph with the capture's hooks
        compiled(x)  # and the one without
        compile_s = time.perf_counter() - started
        for _ in range(runs):
            bare.append(_timed(lambda: compiled(x), forwards))
            hooked.append(_timed(captured, forwards))
    per = (_median_us(hooked) - _median_us(bare)) / len(paths)
    bytes_each = 64 * 512 * 4
    return [(f"**{per:.0f} us**", "per captured module, per compiled forward (a `capture` block "
             "around each; `torch.compile(fullgraph=True)`)",
             f"8 x `Linear(512, 512)` + ReLU, batch 64 ({bytes_each // 1024} KiB a value), "
             f"inductor; forward {_median_us(bare):.0f} us; 2 graphs compiled in {compile_s:.0f} s",
             f"added time per compiled forward ~= modules captured x {per:.0f} us, which includes "
             f"writing each value out of the graph (its bytes)")]


#: the clock of the compiled and guard rows: thread CPU time at one torch thread (torch runs its
#: kernels in the calling thread: other processes on a shared machine count less), else wall time
CLOCK: Callable[[], float] = time.thread_time


def _timed(body: Callable[[], Any], repeat: int) -> float:
    """Seconds per call of ``body`` by ``CLOCK``."""
    start = CLOCK()
    for _ in range(repeat):
        body()
    return (CLOCK() - start) / repeat


def monitor_rows(rounds: int) -> list[Row]:
    """The monitor per training step (``bench.train_guard``'s MLP and variants)."""
    from bench import train_guard

    bare_s, ratios = train_guard.measure(train_guard.mlp, False, rounds, 20, time.thread_time)
    bare = bare_s * 1e6

    def added(column: str) -> float:
        return (ratios[column][1] - 1) * bare

    model, _ = train_guard.mlp(False)
    params = sum(p.numel() for p in model.parameters())
    on = (f"4 x `Linear(256, 256)` + ReLU + `Linear(256, 10)` ({params / 1e6:.2f}M parameters), "
          f"batch 64, AdamW; step {bare / 1e3:.2f} ms")
    sampled = added("sampled step")
    return [
        (f"**{added('guard'):.0f} us**", "per training step, the guard alone (`every=0`)", on,
         f"x{ratios['guard'][1]:.3f} of this step; the gradient pass in it scales with the "
         f"parameters (next row)"),
        (f"**{sampled:.0f} us**", "per sampled step (statistics of every module)", on + ", 10 modules",
         f"about {sampled / 10:.0f} us per selected module of this size, once every `every` steps"),
        (f"**{added('defaults amortized'):.0f} us**", "per training step, `monitor` defaults "
         "(guard + statistics every 100 steps)", on,
         f"x{ratios['defaults amortized'][1]:.3f} of this step (q3 "
         f"x{ratios['defaults amortized'][2]:.3f}); ~= guard + sampled step / 100")]


def guard_rows(runs: int) -> list[Row]:
    """The guard's check alone (``gradients_finite``) on 1M and 16M gradient elements."""
    from hookscope.train.guard import gradients_finite

    def params(elements: int) -> list[nn.Parameter]:
        out = []
        for _ in range(8):
            p = nn.Parameter(torch.empty(elements // 8))
            p.grad = torch.randn(elements // 8)
            out.append(p)
        return out

    small, large = params(2**20), params(2**23)
    times: dict[int, list[float]] = {1: [], 8: []}
    for _ in range(runs):  # interleaved
        for n, ps in ((1, small), (8, large)):
            times[n].append(_timed(lambda ps=ps: gradients_finite(ps), 5))  # type: ignore[misc]
    one, eight = _median_us(times[1]), _median_us(times[8])
    per_million = (eight - one) / 7 / 1.048576
    fixed = max(one - per_million * 1.048576, 0.0)
    return [(f"**{per_million:.0f} us**", "per million gradient elements, per step (the guard's "
             "finiteness pass)", "8 float32 gradients of 1M and 8M elements in all",
             f"guard ~= {fixed:.0f} us + parameters (millions) x {per_million:.0f} us per step, "
             f"on the CPU (on a GPU, one fused norm and one host sync)")]


def machine() -> str:
    """One line: CPU, cores, torch, threads, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    clock = "thread CPU time" if CLOCK is time.thread_time else "wall time"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s) ({clock}), load average {load:.1f}")


def table(rows: list[Row]) -> str:
    lines = ["| cost | unit | measured on | how to apply it |", "|---:|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.costs", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="interleaved rounds per figure")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled row")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time if args.threads == 1 else time.perf_counter
    started = time.perf_counter()
    rows = eager_rows(args.runs)
    if not args.no_compile:
        rows += compiled_rows(args.runs)
    rows += monitor_rows(args.runs) + guard_rows(args.runs)
    print(f"Measured by `python -m bench.costs` in {time.perf_counter() - started:.0f} s on "
          f"{machine()}; each cost is a median over {args.runs} interleaved rounds against "
          f"plain PyTorch in the same rounds.\n")
    print(table(rows))


if __name__ == "__main__":
    main()
