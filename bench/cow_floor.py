"""The torch floor of copy-on-write capture on an in-place CNN (issue 21).

``python -m bench.cow_floor`` times, on the ResNet-50-layout CNN of ``bench.models`` (in-place
ReLU, ``out += identity``), forward hooks on every computing module that keep each output:

- ``detach()``: the plain hook (wrong values: in-place writes reach 49 of 158 kept tensors);
- ``torch._lazy_clone``: plain torch copy-on-write, no hookscope: the cheapest hook that keeps
  every value right, so the floor for hookscope's default capture;
- ``clone()``: a copy of every output;
- ``hookscope.capture`` (default, copy-on-write), to show the gap to the floor.

It also counts, in one forward under ``torch.no_grad()``, how many hooked outputs had their
copy-on-write storage materialised (``torch._C._is_cow_tensor`` false afterwards) and why: a
write (the version counter moved: in-place ReLU, ``+=``) or no write at all, where a kernel
asked for a writable pointer to an input it only reads (torch 2.13's 1x1 stride-1 ``Conv2d``
takes ``aten::_slow_conv2d_forward``), which copies that tensor as a write would. Those copies
are torch's, paid by any copy-on-write hook, hookscope or not.

The census runs at one thread, where ``torch._C._is_cow_tensor`` tells: on torch 2.13 CPU the
tiny CNN copies 8 of 50 kept outputs without a write. At two threads it reports every original
still shared although 13 were written (values checked right: the kernels then take other paths,
and the flag no longer says which side was copied), so no census is made there.

Rounds interleave the cases (each round starts one case later); times are thread CPU time of
the main thread with ``--threads 1`` (the whole forward runs on it), wall time otherwise
(``torch.set_num_threads``, default 2 as ``python -m bench``); ratios are medians and quartiles
of the per-round ratios to the ``detach()`` hooks.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.models import FULL, TINY, images, resnet

Tensor = torch.Tensor
Keep = Callable[[Tensor], Tensor]


def _computing(model: nn.Module) -> list[nn.Module]:
    """Leaves and modules owning parameters directly (the bench's *every module*)."""
    return [m for _, m in model.named_modules() if m is not model
            and (not list(m.children()) or list(m.parameters(recurse=False)))]


def _hooked(model: nn.Module, x: Tensor, keep: Keep) -> list[Tensor]:
    kept: list[Tensor] = []

    def hook(module: nn.Module, args: Any, output: Tensor) -> None:
        kept.append(keep(output))
    handles = [m.register_forward_hook(hook) for m in _computing(model)]
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return kept


def cases(model: nn.Module, x: Tensor) -> dict[str, Callable[[], object]]:
    """The timed cases: ``{name: run once}``."""
    import hookscope

    def ours() -> object:
        with hookscope.capture(model, *_paths(model), on_unfired="ignore") as acts:
            model(x)
        return acts

    return {"bare forward": lambda: model(x),
            "detach() hooks": lambda: _hooked(model, x, Tensor.detach),
            "torch._lazy_clone hooks (floor)": lambda: _hooked(model, x, torch._lazy_clone),
            "clone() hooks": lambda: _hooked(model, x, Tensor.clone),
            "hookscope.capture": ours}


def _paths(model: nn.Module) -> list[str]:
    chosen = set(map(id, _computing(model)))
    return [name for name, m in model.named_modules() if id(m) in chosen]


def census(model: nn.Module, x: Tensor) -> dict[str, int]:
    """One forward with lazy-clone hooks: how many outputs were copied, and why.

    Returns:
        ``{"kept", "materialised_by_a_write", "materialised_without_a_write", "still_shared"}``.
    """
    seen: list[tuple[Tensor, int]] = []  # (original output, its version when kept)
    kept: list[Tensor] = []

    def hook(module: nn.Module, args: Any, output: Tensor) -> None:
        kept.append(torch._lazy_clone(output))
        seen.append((output, output._version))
    handles = [m.register_forward_hook(hook) for m in _computing(model)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    written = sum(1 for t, v in seen if not torch._C._is_cow_tensor(t) and t._version != v)
    unwritten = sum(1 for t, v in seen if not torch._C._is_cow_tensor(t) and t._version == v)
    return {"kept": len(kept), "materialised_by_a_write": written,
            "materialised_without_a_write": unwritten, "still_shared": len(seen) - written - unwritten}


def measure(model: nn.Module, x: Tensor, runs: int, warmups: int) -> dict[str, dict[str, float]]:
    """``{case: {"ms": median, "x_detach": median per-round ratio, "q1", "q3"}}``, at torch's
    current thread count."""
    named = cases(model, x)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in named}
    order = list(named)
    with torch.inference_mode():
        for index in range(warmups + runs):
            shift = index % len(order)
            for name in order[shift:] + order[:shift]:
                gc.collect()
                gc.disable()
                try:
                    start = clock()
                    kept = named[name]()
                    seconds = clock() - start
                finally:
                    gc.enable()
                del kept
                if index >= warmups:
                    times[name].append(seconds)
    result = {}
    for name, seconds in times.items():
        ratios = sorted(a / b for a, b in zip(seconds, times["detach() hooks"]))
        quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        result[name] = {"ms": statistics.median(seconds) * 1e3, "x_detach": statistics.median(ratios),
                        "q1": quartiles[0], "q3": quartiles[2]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cow_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="the tiny CNN: checks that it runs")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    size = TINY if args.quick else FULL
    model, x = resnet(size), images(size)
    try:
        torch.set_num_threads(1)
        counts = census(model, x)
        torch.set_num_threads(args.threads)
        result = measure(model, x, args.runs, args.warmups)
    finally:
        torch.set_num_threads(threads)
    print(f"cow_floor: ResNet-50 layout, {tuple(x.shape)}, {len(_computing(model))} hooked modules, "
          f"median of {args.runs} rounds ({args.threads} threads, "
          f"{'thread CPU' if args.threads == 1 else 'wall'} time)")
    print(f"  {'case':34s} {'ms':>9s} {'x detach()':>11s} {'q1-q3':>12s}")
    for name, row in result.items():
        print(f"  {name:34s} {row['ms']:9.1f} {row['x_detach']:11.3f} {row['q1']:5.3f}-{row['q3']:.3f}")
    floor, ours = result["torch._lazy_clone hooks (floor)"], result["hookscope.capture"]
    print(f"  gap of hookscope to the torch floor: x{ours['x_detach'] / floor['x_detach']:.3f}")
    print(f"  copy-on-write census, 1 thread (one forward, no_grad): {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
