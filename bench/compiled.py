"""Capture inside ``torch.compile(model, fullgraph=True)``: every module, against the compiled
forward without hooks (issue 32: goal at most 1.05x).

``python -m bench.compiled`` compiles the GPT-2-small-sized model and the ResNet-50-sized CNN of
``bench.models`` (random weights, from a config) with ``fullgraph=True``, warms both graphs (with
the capture's hooks, without them), then times, in interleaved rounds, the compiled forward
without hooks and the same forward inside ``hookscope.capture(compiled, *every module)``. The
ratio is the median of the per-round ratios (each round measures both cases), so it is against
the baseline measured in the same run. Wall time (``time.perf_counter``): inductor's kernels run
on torch's intra-op threads. It also prints how many graphs dynamo compiled (goal: 2 per model).

Each round also times the **floor**: the same modules hooked by plain forward hooks that dynamo
traces whole, each appending a clone of its module's output to a list (``_FloorHook``), so that
every value leaves the graph as a graph output and inductor writes it once, fused into the
kernel that computes it (the clone is what an in-place ReLU after the module leaves intact).
That is what any capture of every module inside a compiled graph must pay at least: the bytes
of every module's output written to memory, which the bare graph, fusing, never writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench import models

#: per-model goal of the every-module capture, as a ratio to the compiled forward
GOAL = 1.05


def _time(body: Callable[[], Any]) -> float:
    start = time.perf_counter()
    body()
    return time.perf_counter() - start


_FLOOR_VALUES: list[Any] = []  # one list for every floor hook: dynamo guards it once


class _FloorHook:
    """A plain forward hook dynamo traces: the module's output, cloned, appended to a list."""

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        _FLOOR_VALUES.append(torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().clone(), output))


def _floor(compiled: Any, modules: list[nn.Module], example: tuple[Any, ...]) -> int:
    """One compiled forward with ``_FloorHook`` on every module of ``modules``; returns the bytes
    the hooks were handed."""
    handles = [m.register_forward_hook(_FloorHook()) for m in modules]
    try:
        compiled(*example)
        leaves = torch.utils._pytree.tree_leaves(_FLOOR_VALUES)
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    finally:
        for handle in handles:
            handle.remove()
        _FLOOR_VALUES.clear()


def measure(name: str, model: nn.Module, example: tuple[Any, ...], *, backend: str,
            runs: int) -> dict[str, Any]:
    """Time the compiled forward of ``model`` on ``example`` without hooks and inside an
    every-module capture; return the figures (seconds, ratio, graphs compiled, modules)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    import hookscope

    torch._dynamo.reset()
    torch._dynamo.config.skip_nnmodule_hook_guards = False  # the floor's hooks come after compiling
    paths = models.computing_modules(model, *example)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    def captured() -> Any:
        with hookscope.capture(compiled, *paths) as acts:
            compiled(*example)
        return acts

    with torch.no_grad():
        started = time.perf_counter()
        acts = captured()  # compiles the graph with the hooks
        compiled(*example)  # and the one without
        compile_s = time.perf_counter() - started
        assert all(acts.counts[p] >= 1 for p in paths), "a module was not captured"
        graphs = counter.frame_count
        modules = [model.get_submodule(p) for p in paths]
        floor_bytes = _floor(compiled, modules, example)  # compiles the floor's graph
        compiled_before = counter.frame_count
        bare, hooked, floor = [], [], []
        for _ in range(runs):
            bare.append(_time(lambda: compiled(*example)))
            hooked.append(_time(captured))
            floor.append(_time(lambda: _floor(compiled, modules, example)))
        assert counter.frame_count == compiled_before, "a timed round compiled again"
    ratios = [h / b for h, b in zip(hooked, bare)]
    floors = [f / b for f, b in zip(floor, bare)]
    return {"workload": name, "modules": len(paths), "graphs": graphs,
            "compile_s": compile_s, "bare_ms": 1e3 * statistics.median(bare),
            "capture_ms": 1e3 * statistics.median(hooked), "ratio": statistics.median(ratios),
            "ratios": ratios, "floor_ms": 1e3 * statistics.median(floor),
            "floor_ratio": statistics.median(floors), "floors": floors,
            "floor_mib": floor_bytes / 2**20}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.compiled", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (checks that it runs)")
    parser.add_argument("--runs", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--only", nargs="+", choices=("gpt2", "resnet"), default=["gpt2", "resnet"])
    parser.add_argument("--json", help="also write the settings and rows to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = models.TINY if args.quick else models.FULL
    built = {"gpt2": lambda: (models.gpt2(size), (models.tokens(size),)),
             "resnet": lambda: (models.resnet(size), (models.images(size),))}
    rows = []
    settings = (f"backend {args.backend}, fullgraph=True, {args.threads} threads, {args.runs} rounds, "
                f"{'tiny models' if args.quick else 'full-size models'}; goal <= {GOAL}x")
    print(settings)
    for name in args.only:
        model, example = built[name]()
        row = measure(name, model.eval(), example, backend=args.backend, runs=args.runs)
        rows.append(row)
        print(f"{name}: compiled forward {row['bare_ms']:.1f} ms, every-module capture "
              f"({row['modules']} modules) {row['capture_ms']:.1f} ms: x{row['ratio']:.3f} "
              f"({'meets' if row['ratio'] <= GOAL else 'misses'} the goal); graphs compiled "
              f"{row['graphs']}, compile {row['compile_s']:.0f} s; the floor (plain traced "
              f"hooks, {row['floor_mib']:.0f} MiB out of the graph) {row['floor_ms']:.1f} ms: "
              f"x{row['floor_ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
