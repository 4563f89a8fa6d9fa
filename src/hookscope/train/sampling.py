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
        # made at a module's first value: a module that does not run costs no allocation
        self.activations: dict[str, RunningStats] = _StatsByKey()
        self.gradients: dict[str, RunningStats] = _StatsByKey()
        # each parameter once (the root's "**" holds every module's): its value at the start
        self.params = {t.key: list(t.module.parameters()) for t in targets}
        distinct = {id(p): p for params in self.params.values() for p in params}
        self.before = dict(zip(distinct, detached_clones(distinct.values()), strict=True))
        self._distinct = distinct
        self._numbers: dict[str, tuple[float | None, float | None]] | None = None
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
        def observe(output: Any) -> None:
            keys, tensor = next(((k, t) for k, t in iter_tensors_with_keys(get_part(output, target.parts))
                                 if t.is_floating_point()), ((), None))
            if tensor is None:
                return
            tokens = self.tokens.tokens  # this forward's: the backward may come after others
            real = padding_dropped(tensor.detach(), target, tokens, keys)
            self.activations[target.key].update(real)
            if self._hist is not None:
                self._histogram(target.key, real)
            if tensor.requires_grad:
                on_tensor_grad(tensor, lambda g: self.contained(
                    f"statistics of {target.key!r}",
                    lambda: self.gradients[target.key].update(
                        self._true(padding_dropped(g, target, tokens, keys)))))

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.contained(f"statistics of {target.key!r}", lambda: observe(output))
        if target.parts:
            return hook

        def gradient(grad: Tensor) -> None:
            self.contained(f"statistics of {target.key!r}", lambda: self.gradients[target.key].update(
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
        if self._numbers is None:
            self._numbers = self._parameter_numbers()
        grad_norm, update_ratio = self._numbers[target.key]
        # "module": the name asked (a standard name as given, else the path), "path" beside it
        record = {"step": step, "rank": rank, "module": target.name, "path": target.key,
                "activation": _summary(self.activations.get(target.key)),
                "gradient": _summary(self.gradients.get(target.key)),
                "loss_scale": max(self.scales, default=1.0),
                "grad_norm": grad_norm, "update_ratio": update_ratio}
        if self._hist is not None:
            h = self.histograms.get(target.key)
            record["activation_hist"] = h.as_dict() if h is not None else None
        return record

    def _parameter_numbers(self) -> dict[str, tuple[float | None, float | None]]:
        """``{target key: (grad_norm, update_ratio)}`` of every target, each parameter once,
        read with one host sync per device. ``grad_norm``: the gradients' norms by one
        ``torch._foreach_norm`` and a module's the norm of its parameters' norms, as
        ``torch.nn.utils.get_total_norm`` computes them. ``update_ratio``: the starting
        weights' norms, then ``before -= after`` in place (the copies taken at the start: no
        other memory) and their norms, both ``_foreach_norm`` accumulated in float64; the
        difference is in the parameter's dtype, exact wherever a value moved by less than a
        factor of 2 (Sterbenz), else rounded once (2**-24 of it in float32). Called once, at
        the end of the step: the copies are used up."""
        with_grad = [(i, p.grad) for i, p in self._distinct.items() if p.grad is not None]
        grads = [g for _, g in with_grad]
        norms = dict(zip([i for i, _ in with_grad], torch._foreach_norm(grads), strict=True)) \
            if grads else {}
        ids = list(self._distinct)
        before = [self.before[i] for i in ids]
        start = dict(zip(ids, _norms64(before), strict=True))
        if ids:  # none under FSDP's flat parameters (its modules own none): foreach refuses []
            torch._foreach_sub_(before, [self._distinct[i].detach() for i in ids])
        moved = dict(zip(ids, _norms64(before), strict=True))
        slots: dict[str, list[Tensor | None]] = {}
        for key, params in self.params.items():
            own = [norms[id(p)] for p in params if id(p) in norms]
            slots[key] = [
                torch.linalg.vector_norm(torch.stack(own)) if own else None,
                torch.stack([moved[id(p)] for p in params]).square().sum() if params else None,
                torch.stack([start[id(p)] for p in params]).square().sum() if params else None]
        read = _read_all([v for values in slots.values() for v in values if v is not None])
        numbers = {}
        for key, (norm, delta, size) in slots.items():
            ratio = None
            if delta is not None and size is not None:
                d, w = read[id(delta)], read[id(size)]
                ratio = math.sqrt(d) / math.sqrt(w) if w > 0 else math.inf if d > 0 else 0.0
            numbers[key] = (read[id(norm)] if norm is not None else None, ratio)
        return numbers


def _norms64(tensors: list[Tensor]) -> list[Tensor]:
    """The L2 norm of each tensor, its squares summed in float64 (``_foreach_norm``)."""
    if not tensors:
        return []
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float64))
    except RuntimeError:  # a dtype float64 cannot hold without narrowing (complex)
        return [torch.linalg.vector_norm(t).double() for t in tensors]


def _read_all(values: list[Tensor]) -> dict[int, float]:
    """``{id(value): float(value)}`` of 0-d tensors: one stack and one host sync per device."""
    devices: dict[torch.device, list[Tensor]] = {}
    for value in values:
        devices.setdefault(value.device, []).append(value)
    read = {}
    for group in devices.values():
        floats = torch.stack([v.double() for v in group]).tolist()
        read.update({id(v): f for v, f in zip(group, floats, strict=True)})
    return read


class _StatsByKey(dict[str, RunningStats]):
    """``{module key: RunningStats}``, each made when first asked for."""

    def __missing__(self, key: str) -> RunningStats:
        self[key] = stats = RunningStats()
        return stats


def _summary(stats: RunningStats | None) -> dict[str, float] | None:
    """``hookscope.stats``' numbers with ``absmax`` = max(|min|, |max|); None when nothing ran."""
    if stats is None:
        return None
    values = stats.as_dict()
    if values["count"] == 0:
        return None
    values["absmax"] = max(abs(values["min"]), abs(values["max"]))
    return {key: values[key] for key in STATS}


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
