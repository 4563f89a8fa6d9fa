"""A sampled step of ``hookscope.monitor``: hooks on the selected modules, their statistics, one
record per module."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hookscope.diagnostics import Histogram, RunningStats
from hookscope.engine import (
    MaskWatcher,
    Observer,
    OwnedHook,
    Target,
    detached_clones,
    on_tensor_grad,
    output_of,
)
from hookscope.record import padding_dropped
from hookscope.util import get_part, iter_tensors_with_keys

__all__: list[str] = []

Tensor = torch.Tensor
STATS = ("mean", "std", "absmax", "frac_zeros", "frac_nonfinite", "count")


class _Sample:
    """One sampled step: hooks on the selected modules and the weights they started with.

    ``scaler``: the loop's GradScaler (or None): each gradient is divided by its scale in force
    during the backward, so the statistics are of the true gradient. ``contained``: the
    monitor's fault handler, around each hook's work. ``tokens``: the root's ``MaskWatcher``:
    activations and gradients count the real tokens of a batch given with an attention mask
    (``record.padding_dropped``), as ``hookscope.stats`` does."""

    def __init__(self, root: nn.Module, targets: list[Target], scaler: Any,
                 contained: Callable[[str, Callable[[], Any]], Any], tokens: MaskWatcher):
        self.scaler, self.contained, self.tokens = scaler, contained, tokens
        self.scales: set[float] = set()
        self.activations = {t.key: RunningStats() for t in targets}
        self.gradients = {t.key: RunningStats() for t in targets}
        self.before = {t.key: detached_clones(t.module.parameters()) for t in targets}
        self.histograms: dict[str, Histogram] = {}
        self._hist: tuple[int, dict[str, tuple[float, float]]] | None = None
        self.session = Observer(root, targets, forward=self._hook, explain_unfired=False)

    def count_histograms(self, bins: int, ranges: dict[str, tuple[float, float]]) -> None:
        """Also histogram each activation in ``bins`` bins, with the edges in ``ranges``; a
        module not in it gets its first call's finite range, written into ``ranges``."""
        self._hist = (bins, ranges)

    def _histogram(self, key: str, tensor: Tensor) -> None:
        assert self._hist is not None
        bins, ranges = self._hist
        if key not in self.histograms:
            h = Histogram(bins, *ranges[key]) if key in ranges else Histogram.fitting(bins, tensor)
            ranges[key] = (h.lo, h.hi)
            self.histograms[key] = h
        self.histograms[key].update(tensor)

    def _hook(self, target: Target) -> Any:
        activations, gradients = self.activations[target.key], self.gradients[target.key]

        def observe(output: Any) -> None:
            keys, tensor = next(((k, t) for k, t in iter_tensors_with_keys(get_part(output, target.parts))
                                 if t.is_floating_point()), ((), None))
            if tensor is None:
                return
            tokens = self.tokens.tokens  # this forward's: the backward may come after others
            real = padding_dropped(tensor.detach(), target, tokens, keys)
            activations.update(real)
            if self._hist is not None:
                self._histogram(target.key, real)
            if tensor.requires_grad:
                on_tensor_grad(tensor, lambda g: self.contained(
                    f"statistics of {target.key!r}",
                    lambda: gradients.update(self._true(padding_dropped(g, target, tokens, keys)))))

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.contained(f"statistics of {target.key!r}", lambda: observe(output))
        if target.parts:
            return hook

        def gradient(grad: Tensor) -> None:
            self.contained(f"statistics of {target.key!r}", lambda: gradients.update(
                self._true(padding_dropped(grad, target, self.tokens.tokens))))
        # inside a compiled graph: ``hook`` on a copy of the output (detached: no tensor hook),
        # and the gradient that the backward graph hands over (engine.compile.graph)
        return OwnedHook(hook, target.module, pick=output_of, on_gradient=gradient)

    def _true(self, grad: Tensor) -> Tensor:
        """``grad`` with the GradScaler's scale in force divided out (float32, as the scaler's
        own ``unscale_`` does)."""
        if self.scaler is None:
            return grad
        scale = float(self.scaler.get_scale())
        self.scales.add(scale)
        return grad.float() / scale

    def record(self, target: Target, step: int, rank: int) -> dict[str, Any]:
        """The JSON record of ``target`` for this step."""
        params = list(target.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        # "module": the name asked (a standard name as given, else the path), "path" beside it
        record = {"step": step, "rank": rank, "module": target.name, "path": target.key,
                "activation": _summary(self.activations[target.key]),
                "gradient": _summary(self.gradients[target.key]),
                "loss_scale": max(self.scales, default=1.0),
                "grad_norm": float(torch.nn.utils.get_total_norm(grads)) if grads else None,
                "update_ratio": _update_ratio(self.before[target.key], params)}
        if self._hist is not None:
            h = self.histograms.get(target.key)
            record["activation_hist"] = h.as_dict() if h is not None else None
        return record


def _summary(stats: RunningStats) -> dict[str, float] | None:
    """``hookscope.stats``' numbers with ``absmax`` = max(|min|, |max|); None when nothing ran."""
    values = stats.as_dict()
    if values["count"] == 0:
        return None
    values["absmax"] = max(abs(values["min"]), abs(values["max"]))
    return {key: values[key] for key in STATS}


def _update_ratio(before: list[Tensor], params: list[nn.Parameter]) -> float | None:
    """||W_after - W_before|| / ||W_before||, W all of a module's parameters (weight and bias)
    flattened and joined into one vector, float64; ``inf`` when ||W_before|| is 0 and W moved,
    0.0 when nothing moved, ``None`` without parameters."""
    if not params:
        return None
    delta = sum(float((p.detach().double() - b.double()).square().sum())
                for p, b in zip(params, before, strict=True))
    size = sum(float(b.double().square().sum()) for b in before)
    return math.sqrt(delta) / math.sqrt(size) if size > 0 else math.inf if delta > 0 else 0.0


def _to_tensorboard(writer: Any, record: dict[str, Any]) -> bool:
    """Write ``record``'s numbers with ``writer.add_scalar``; return True (``_contained`` gives
    None when it raised)."""
    for kind in ("activation", "gradient"):
        for stat, value in (record[kind] or {}).items():
            writer.add_scalar(f"{record['module']}/{kind}/{stat}", value, record["step"])
    for name in ("grad_norm", "update_ratio"):
        if record[name] is not None:
            writer.add_scalar(f"{record['module']}/{name}", record[name], record["step"])
    return True
