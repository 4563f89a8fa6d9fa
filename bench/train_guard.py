"""``python -m bench.train_guard``: the cost of hookscope.monitor on a training step.

For a GPT-2-shaped model (transformers' GPT2LMHeadModel from a config, random weights) and a
small CNN, the same training step (forward, loss, backward, AdamW step) is timed bare, with the
guard alone (``every=0``), with the guard and statistics every 100 steps, and under
``torch.autograd.set_detect_anomaly(True)``. The variants are interleaved round by round; each
round's median step of a variant is divided by that round's bare median, and the quartiles of
these ratios over the rounds are printed (the spread says how contended the machine was).
``gpt2`` is GPT-2-shaped, not GPT-2 small: 4 layers, 256 wide, 4 heads, vocabulary 8192,
batch 4 x 128 tokens (GPT-2 small's 12 x 768 with 50257 tokens takes seconds per CPU step).

``--quick`` uses tiny shapes and few steps (a smoke run). Figures depend on the machine: on a
shared CPU, the fixed cost of the guard per step (a few Python calls, one fused norm, one host
sync) is compared with steps of a few milliseconds; on a GPU, with the real step.
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

VARIANTS = ("bare", "guard", "monitor every=100", "set_detect_anomaly")
COLUMNS = ("guard", "monitor every=100", "sampled step", "every=100 amortized", "set_detect_anomaly")


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
        with hookscope.monitor(model, every=every, optimizer=optimizer):
            yield


def time_steps(loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """Seconds per step, one number per step."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def measure(build: Callable[[bool], tuple[nn.Module, Callable[[], torch.Tensor]]], quick: bool,
            rounds: int, steps: int) -> tuple[float, dict[str, list[float]]]:
    """``(bare median seconds, {column: quartiles of its per-round ratio to bare})``.

    The variants are interleaved: each of ``rounds`` rounds runs ``steps`` steps of every
    variant in turn, and each round's ratio is a variant's median step over the bare median of
    the same round, so slow phases of a shared machine fall on every variant alike. A monitor
    opened for each round starts at step 0, a sampled step: the every=100 variant's median is
    over its other steps, ``"sampled step"`` is its step 0, and ``"every=100 amortized"`` is
    (99 * median + sampled step) / 100."""
    torch.manual_seed(0)
    model, loss = build(quick)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    time_steps(loss, optimizer, 3)  # warm-up
    ratios: dict[str, list[float]] = {name: [] for name in COLUMNS}
    bares = []
    for _ in range(rounds):
        medians = {}
        for name in VARIANTS:
            with variant(name, model, optimizer):
                measured = time_steps(loss, optimizer, steps)
            if name == "monitor every=100":
                medians["sampled step"] = measured.pop(0)
            medians[name] = statistics.median(measured)
        medians["every=100 amortized"] = (99 * medians["monitor every=100"] + medians["sampled step"]) / 100
        bares.append(medians["bare"])
        for name in COLUMNS:
            ratios[name].append(medians[name] / medians["bare"])
    return statistics.median(bares), {name: quartiles(values) for name, values in ratios.items()}


def quartiles(values: list[float]) -> list[float]:
    """``[q1, median, q3]`` (``statistics.quantiles``, inclusive method)."""
    return statistics.quantiles(values, n=4, method="inclusive")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_guard", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps")
    args = parser.parse_args(argv)
    rounds, steps = (3, 3) if args.quick else (7, 15)
    torch.set_num_threads(1)  # steadier figures on a shared machine
    print(f"torch {torch.__version__}, CPU, 1 thread, {rounds} interleaved rounds x {steps} steps "
          "per variant; ratio to the bare step: median [q1-q3] over rounds")
    print(f"{'model':<6} {'bare ms':>8} " + " ".join(f"{name:>22}" for name in COLUMNS))
    for label, build in (("gpt2", gpt2), ("cnn", cnn)):
        bare, ratios = measure(build, args.quick, rounds, steps)
        cells = " ".join(f"{q[1]:>6.3f} [{q[0]:.3f}-{q[2]:.3f}]" for q in ratios.values())
        print(f"{label:<6} {bare * 1e3:>8.2f} {cells}")

if __name__ == "__main__":
    main()

