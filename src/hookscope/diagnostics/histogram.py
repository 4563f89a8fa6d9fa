"""Streaming histograms with fixed bin edges: fixed memory however many values stream through.

The edges are fixed before the first value is counted: ``bins`` equal-width bins between
``lo`` and ``hi``, exactly as ``torch.histc(values, bins, min=lo, max=hi)`` lays them out (a
value equal to ``hi`` falls in the last bin). Each update adds ``torch.histc`` of the new values,
computed in their own dtype (float32 values in float32, as ``torch.histc`` on the whole data
would), so the sum over batches equals ``torch.histc`` over all the data concatenated, count for
count. Values outside ``[lo, hi]`` are not dropped silently as ``torch.histc`` drops them: they
are counted in ``below`` and ``above``; NaN and +-Inf are counted in ``nonfinite``.

Where the edges come from (the rule, the same in ``stats`` and the monitor):

- given: ``(lo, hi)``;
- ``Histogram.spanning(bins, lo, hi)``: the range of a first pass (``stats`` makes one over
  the batches; the monitor takes a module's first sampled call), with ``torch.histc``'s own
  rule for a range of one value: ``lo == hi`` becomes ``[lo - 1, hi + 1]``; no finite value at all
  gives ``[-1, 1]`` (``torch.histc`` of an empty tensor).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hookscope.errors import ArgumentTypeError, ArgumentValueError, HookscopeError

__all__ = ["Histogram", "MAX_BINS"]

Tensor = torch.Tensor
CHUNK = 1 << 24  # float32 counts are exact up to 2**24: histc is applied to chunks this long


#: the most bins a histogram may have: 2**20 counts are 8 MiB per layer (``stats(hist=10**11)``
#: asked the allocator for 800 GB)
MAX_BINS = 2**20


def _check_real(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ArgumentTypeError(f"histogram edge {name} must be a real number, e.g. -4.0; got "
                                f"{type(value).__name__} {value!r:.40}")


def _check_tensor(value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"a histogram counts the values of a tensor; got "
                                f"{type(value).__name__}: pass torch.as_tensor(values)")


class Histogram:
    """Counts of a stream of values in ``bins`` equal-width bins between ``lo`` and ``hi``.

    Attributes:
        bins: number of bins (>= 1).
        lo, hi: the outer edges (finite floats, ``lo < hi``).
        counts: int64 tensor ``(bins,)`` on the CPU: values in each bin, as ``torch.histc``.
        below, above: values smaller than ``lo`` / larger than ``hi`` (``torch.histc`` ignores them).
        nonfinite: NaN and +-Inf values seen.

    Raises:
        ArgumentValueError: ``bins`` is not a whole number >= 1, or ``lo``/``hi`` are not
            finite with ``lo < hi``.
    """

    def __init__(self, bins: int, lo: float, hi: float) -> None:
        if not isinstance(bins, int) or isinstance(bins, bool) or not 1 <= bins <= MAX_BINS:
            raise ArgumentValueError(f"bins={bins!r:.20}: pass a whole number of bins from 1 to "
                                     f"{MAX_BINS}, e.g. 50")
        _check_real("lo", lo)
        _check_real("hi", hi)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ArgumentValueError(f"histogram range ({lo!r}, {hi!r}): pass finite edges with "
                                     "lo < hi, e.g. (-4.0, 4.0)")
        self.bins, self.lo, self.hi = bins, float(lo), float(hi)
        self.counts = torch.zeros(bins, dtype=torch.int64)
        self.below = self.above = self.nonfinite = 0

    @classmethod
    def spanning(cls, bins: int, lo: float, hi: float) -> Histogram:
        """A histogram over the range ``[lo, hi]`` seen in a first pass, with ``torch.histc``'s
        rule for a degenerate range (see the module docstring); ``lo``/``hi`` NaN or infinite
        (nothing finite seen) give ``[-1, 1]``."""
        _check_real("lo", lo)
        _check_real("hi", hi)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo = hi = 0.0
        return cls(bins, lo - 1, hi + 1) if lo == hi else cls(bins, lo, hi)

    @classmethod
    def fitting(cls, bins: int, tensor: Tensor) -> Histogram:
        """A histogram spanning the finite values of ``tensor`` (``spanning`` its min and max)."""
        _check_tensor(tensor)
        values = tensor.detach().reshape(-1).double()
        values = values[torch.isfinite(values)]
        if values.numel() == 0:
            return cls.spanning(bins, math.inf, -math.inf)
        return cls.spanning(bins, float(values.min()), float(values.max()))

    @property
    def edges(self) -> Tensor:
        """The ``bins + 1`` edges, float64: ``torch.linspace(lo, hi, bins + 1)``."""
        return torch.linspace(self.lo, self.hi, self.bins + 1, dtype=torch.float64)

    def update(self, tensor: Tensor) -> None:
        """Count every element of ``tensor`` (any shape; integer and bool values as float64,
        float16/bfloat16 as float32, which is exact).

        Raises:
            HookscopeError: ``tensor`` is complex.
        """
        _check_tensor(tensor)
        if tensor.is_complex():
            raise HookscopeError(f"cannot histogram a complex tensor ({tensor.dtype}); pass its "
                                 ".real or .abs()")
        values = tensor.detach().reshape(-1)
        if not values.is_floating_point():
            values = values.double()
        elif values.dtype in (torch.float16, torch.bfloat16):
            values = values.float()
        finite = values[torch.isfinite(values)]
        self.nonfinite += values.numel() - finite.numel()
        self.below += int((finite < self.lo).sum())
        self.above += int((finite > self.hi).sum())
        for start in range(0, finite.numel(), CHUNK):
            chunk = finite[start:start + CHUNK]
            self.counts += torch.histc(chunk, self.bins, self.lo, self.hi).round().long().cpu()

    def merge(self, other: Histogram) -> Histogram:
        """Add ``other``'s counts (same bins and edges) to these; return ``self``.

        Raises:
            HookscopeError: the edges differ.
        """
        if not isinstance(other, Histogram):
            raise ArgumentTypeError(f"merge takes a Histogram; got {type(other).__name__}")
        if (other.bins, other.lo, other.hi) != (self.bins, self.lo, self.hi):
            raise HookscopeError(f"cannot merge a histogram of {other.bins} bins over "
                                 f"[{other.lo}, {other.hi}] into one of {self.bins} bins over "
                                 f"[{self.lo}, {self.hi}]: build both with the same edges")
        self.counts += other.counts
        self.below += other.below
        self.above += other.above
        self.nonfinite += other.nonfinite
        return self

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers: ``{"lo", "hi", "counts" (list of ints), "below", "above",
        "nonfinite"}``."""
        return {"lo": self.lo, "hi": self.hi, "counts": self.counts.tolist(),
                "below": self.below, "above": self.above, "nonfinite": self.nonfinite}

    def sparkline(self) -> str:
        """The counts as one line of block characters (tallest bin: a full block, empty: "_")."""
        blocks = "_▁▂▃▄▅▆▇█"  # "_": an empty bin
        top = int(self.counts.max()) if self.bins else 0
        return "".join(blocks[math.ceil(8 * int(c) / top) if top else 0] for c in self.counts)

    def __repr__(self) -> str:
        return (f"Histogram(bins={self.bins}, lo={self.lo:.6g}, hi={self.hi:.6g}, "
                f"counted={int(self.counts.sum())}, below={self.below}, above={self.above}, "
                f"nonfinite={self.nonfinite})")
