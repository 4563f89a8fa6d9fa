"""``python -m bench.train_guard``: the cost of hookscope.monitor on a training step.

For a small MLP (4 ``Linear(256, 256)`` + ReLU and a ``Linear(256, 10)`` head, batch 64: a step
of a few milliseconds, where the monitor's fixed cost shows), a GPT-2-shaped model
(transformers' GPT2LMHeadModel from a config, random weights) and a small CNN, the same
training step (forward, loss, backward, AdamW step) is timed bare, with the guard alone
(``every=0``), with the monitor's defaults (statistics every 100 steps, ``guard="raise"``),
with the defaults but ``guard=None``, and under ``torch.autograd.set_detect_anomaly(True)``.
The variants are interleaved round by round; each round's median step of a variant is divided
by that round's bare median, and the quartiles of these ratios over the rounds are printed
(the spread says how contended the machine was). A monitor opened for each round starts at
step 0, a sampled step: a monitor variant's median is over its other steps, ``sampled step``
is its step 0, and ``amortized`` is (99 x median + sampled step) / 100, the cost of the
defaults over a run. ``gpt2`` is GPT-2-shaped, not GPT-2 small: 4 layers, 256 wide, 4 heads,
vocabulary 8192, batch 4 x 128 tokens.

At one thread (``--threads 1``, the default) steps are timed in the thread's CPU time
(``time.thread_time``: torch runs its kernels in the calling thread), so other processes on
a shared machine do not count; at more threads, in wall time. ``--quick`` uses tiny shapes and
few steps (a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

import hookscope

Build = Callable[[bool], tuple[nn.Module, Callable[[], torch.Tensor]]]
VARIANTS = ("bare", "guard", "defaults", "defaults, guard=None", "set_detect_anomaly")
COLUMNS = ("guard", "defaults", "sampled step", "defaults amortized", "guard=None amortized",
           "set_detect_anomaly")


def mlp(quick: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """4 x ``Linear(256, 256)`` + ReLU, a ``Linear(256, 10)`` head; batch 64 (quick: 32 wide)."""
    width = 32 if quick else 256
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    inputs, labels = torch.randn(64, width), torch.randint(0, 10, (64,))
    return model, lambda: F.cross_entropy(model(inputs), labels)


def gpt2(quick: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = (GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                         bos_token_id=0, eos_token_id=0) if quick
              else GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128,
                         bos_token_id=0, eos_token_id=0))
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (4, 16 if quick else 128))
    return model, lambda: model(input_ids=tokens, labels=tokens).loss


def cnn(quick: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    width = 8 if quick else 32
    model = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.BatchNorm2d(4 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 10))
    images = torch.randn(8 if quick else 32, 3, 32, 32)
    labels = torch.randint(0, 10, (images.shape[0],))
    return model, lambda: F.cross_entropy(model(images), labels)


MODELS: dict[str, Build] = {"mlp": mlp, "gpt2": gpt2, "cnn": cnn}


@contextlib.contextmanager
def variant(name: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The context one variant's steps run in."""
    if name == "bare":
        yield
    elif name == "set_detect_anomaly":
        with torch.autograd.set_detect_anomaly(True):
            yield
    else:
        every = 0 if name == "guard" else 100
        guard = None if name.endswith("guard=None") else "raise"
        with hookscope.monitor(model, every=every, optimizer=optimizer, guard=guard):
            yield


def time_steps(loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, steps: int,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds per step, one number per step."""
    times = []
    for _ in range(steps):
        start = clock()
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
        times.append(clock() - start)
    return times


def measure(build: Build, quick: bool, rounds: int, steps: int,
            clock: Callable[[], float] = time.perf_counter,
            variants: tuple[str, ...] = VARIANTS) -> tuple[float, dict[str, list[float]]]:
    """``(bare median seconds, {column: quartiles of its per-round ratio to bare})``.

    The variants are interleaved: each of ``rounds`` rounds runs ``steps`` steps of every
    variant in turn, and each round's ratio is a variant's median step over the bare median of
    the same round, so slow phases of a shared machine fall on every variant alike (see the
    module docstring for the sampled step and the amortized columns)."""
    torch.manual_seed(0)
    model, loss = build(quick)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    time_steps(loss, optimizer, 5)  # warm-up
    ratios: dict[str, list[float]] = {}
    bares = []
    for _ in range(rounds):
        medians = {}
        for name in variants:
            with variant(name, model, optimizer):
                measured = time_steps(loss, optimizer, steps, clock)
            if name.startswith("defaults"):
                sampled = measured.pop(0)
                if name == "defaults":
                    medians["sampled step"] = sampled
                column = "defaults amortized" if name == "defaults" else "guard=None amortized"
                medians[column] = (99 * statistics.median(measured) + sampled) / 100
            medians[name] = statistics.median(measured)
        bares.append(medians["bare"])
        for name, value in medians.items():
            if name in COLUMNS:
                ratios.setdefault(name, []).append(value / medians["bare"])
    return statistics.median(bares), {name: quartiles(ratios[name]) for name in COLUMNS
                                      if name in ratios}


def quartiles(values: list[float]) -> list[float]:
    """``[q1, median, q3]`` (``statistics.quantiles``, inclusive method)."""
    if len(values) == 1:
        return values * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_guard", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 15, quick 3)")
    parser.add_argument("--steps", type=int, help="steps per variant per round (default 30, quick 3)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    steps = args.steps or (3 if args.quick else 30)
    torch.set_num_threads(args.threads)
    clock, clock_name = ((time.thread_time, "thread CPU time") if args.threads == 1
                         else (time.perf_counter, "wall time"))
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s), {clock_name}, {rounds} "
          f"interleaved rounds x {steps} steps per variant; ratio to the bare step: median "
          f"[q1-q3] over rounds")
    print(f"{'model':<6} {'bare ms':>8} " + " ".join(f"{name:>22}" for name in COLUMNS))
    for label in args.models:
        bare, ratios = measure(MODELS[label], args.quick, rounds, steps, clock)
        cells = " ".join(f"{q[1]:>6.3f} [{q[0]:.3f}-{q[2]:.3f}]" for q in ratios.values())
        print(f"{label:<6} {bare * 1e3:>8.2f} {cells}", flush=True)


if __name__ == "__main__":
    main()
