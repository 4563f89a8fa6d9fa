"""The difference between two outputs: ``LayerDiff``, measured over their tensors as float64.

Each output's tensors are taken by their place in it (``_values``), padding dropped where the
forward had a mask (``_real``), matched by place (``_shared``) and compared as one flat float64
vector: largest absolute error, relative error, cosine similarity, closeness within tolerance.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from hookscope.engine import Target, Tokens, comparable
from hookscope.record import padding_dropped
from hookscope.util import Keys, iter_tensors_with_keys

__all__ = ["LayerDiff"]

Tensor = torch.Tensor
Key = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class LayerDiff:
    """How one call of one module differs between run A (the reference) and run B.

    All figures are over every floating-point tensor in the output, in float64.

    Attributes:
        path: qualified name (with output parts if the pattern had them, ``"lstm[0]"``);
            ``""`` for the models' return values.
        call_index: which call of the module (0 for the first).
        shape: shape of its (first) output tensor in run A.
        max_abs: largest ``|a - b|``; ``inf`` where shapes differ or only one side is NaN/Inf.
        rel: ``||a - b|| / ||a||`` (Euclidean norms over all elements).
        cosine: cosine similarity of ``a`` and ``b`` flattened (1.0 when both are all zeros).
        close: every element satisfies ``|a - b| <= atol + rtol * |a|`` (NaN equals NaN).
        shape_b: shapes of the output tensors in run B when they differ from run A's (then
            ``max_abs`` and ``rel`` are ``inf`` and ``cosine`` NaN); ``None`` when they agree.
        structure: how the two outputs differ in structure where they share parts, e.g.
            ``"[1]: a tensor (1, 4, 6, 6) in B, absent (None) in A"`` (an SDPA attention returns
            no weights where an eager one does); the figures are then of the parts both have.
            ``""`` when the structures agree.
    """

    path: str
    call_index: int
    shape: tuple[int, ...]
    max_abs: float
    rel: float
    cosine: float
    close: bool
    shape_b: tuple[tuple[int, ...], ...] | None = None
    structure: str = ""


def _values(key: str, output: Any) -> dict[Keys, Tensor]:
    """The tensors of an output by their place in it (``(1,)``: its second element), as real
    values (``comparable``: quantized dequantized, a DTensor as its global tensor, complex as
    real and imaginary parts); integer and bool ones too.

    Raises:
        HookscopeError: a tensor is a meta tensor or a FakeTensor (no values to compare).
    """
    return {keys: comparable(t, key) for keys, t in iter_tensors_with_keys(output)}


def _real(values: dict[Keys, Tensor], target: Target, tokens: Tokens) -> dict[Keys, Tensor]:
    """Each value's real tokens when the forward had a mask (``record.padding_dropped``): what
    padding holds is not compared."""
    return {keys: padding_dropped(t, target, tokens, keys) for keys, t in values.items()}


def _shared(a: dict[Keys, Tensor], b: dict[Keys, Tensor]) -> tuple[list[Tensor], list[Tensor], str]:
    """The parts to compare of two outputs and how their structures differ (``""``: alike).

    Parts are matched by place; where the two share some places but not all (a tuple with
    attention weights in one run and ``None`` in the other), only the shared ones are
    compared and the rest is named. Outputs sharing no place (a tensor against a tuple) are
    matched in order, as before."""
    common = [k for k in a if k in b]
    if not common or len(common) == len(a) == len(b):
        return list(a.values()), list(b.values()), ""
    notes = [f"{_place(k)}: a tensor {tuple(t.shape)} in {side}, absent in {other}"
             for parts, side, other in ((a, "A", "B"), (b, "B", "A"))
             for k, t in parts.items() if k not in common]
    return [a[k] for k in common], [b[k] for k in common], "; ".join(notes)


def _place(keys: Keys) -> str:
    return "".join(f"[{k!r}]" if isinstance(k, str) else f"[{k}]" for k in keys) or "the output"


def _diff(key: Key, a_values: dict[Keys, Tensor], b_values: dict[Keys, Tensor], atol: float,
          rtol: float) -> LayerDiff:
    a_parts, b_parts, structure = _shared(a_values, b_values)
    shape = tuple(a_parts[0].shape) if a_parts else ()
    if [t.shape for t in a_parts] != [t.shape for t in b_parts]:
        return LayerDiff(key[0], key[1], shape, math.inf, math.inf, math.nan, False,
                         tuple(tuple(t.shape) for t in b_parts))
    device = a_parts[0].device if a_parts and a_parts[0].device.type != "mps" else torch.device("cpu")
    a = torch.cat([t.reshape(-1).to(device, torch.float64) for t in a_parts]) if a_parts else \
        torch.zeros(0, dtype=torch.float64)
    b = torch.cat([t.reshape(-1).to(device, torch.float64) for t in b_parts]) if b_parts else \
        torch.zeros(0, dtype=torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    error = torch.where(same, torch.zeros_like(a), (a - b).abs()).nan_to_num(nan=math.inf, posinf=math.inf)
    max_abs = float(error.max()) if error.numel() else 0.0
    close = bool(torch.isclose(b, a, rtol=rtol, atol=atol, equal_nan=True).all())
    return LayerDiff(key[0], key[1], shape, max_abs, _ratio(float(error.norm()), float(a.norm())),
                     _cosine(a, b), close, structure=structure)


def _ratio(numerator: float, denominator: float) -> float:
    if denominator == 0.0:
        return 0.0 if numerator == 0.0 else math.inf
    return numerator / denominator


def _cosine(a: Tensor, b: Tensor) -> float:
    norm_a, norm_b = float(a.norm()), float(b.norm())
    if norm_a == 0.0 and norm_b == 0.0:
        return 1.0
    if norm_a == 0.0 or norm_b == 0.0:
        return 0.0
    cosine = float(torch.dot(a, b)) / (norm_a * norm_b)
    return cosine if math.isnan(cosine) else max(-1.0, min(1.0, cosine))  # NaN stays NaN
