"""Streaming statistics of module outputs over many batches, without keeping activations.

Each selected module's output updates a ``RunningStats`` inside its forward hook and is then
dropped, so memory stays flat however many batches run. The statistics are combined batch by
batch with the parallel form of Welford's algorithm (Chan, Golub and LeVeque, "Updating
formulae and a pairwise algorithm for computing sample variances", Stanford CS tech. report
STAN-CS-79-773, 1979): for two parts with counts ``n_a, n_b``, means ``m_a, m_b`` and sums of
squared deviations ``M_a, M_b``,

    n = n_a + n_b,  delta = m_b - m_a,
    m = m_a + delta * n_b / n,
    M = M_a + M_b + delta**2 * n_a * n_b / n.

Each batch's own mean and ``M`` come from a two-pass sum in float64, so no accumulated sum of
squares ever cancels catastrophically.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hookscope.diagnostics.histogram import MAX_BINS, Histogram
from hookscope.engine import (
    HookSession,
    MaskWatcher,
    OnUnfired,
    Target,
    Tokens,
    as_patterns,
    asked_names,
    check_flag,
    check_has_values,
    check_int,
    check_iterable,
    check_no_unmasked_padding,
    check_not_transformed,
    keepable,
    kind_of,
    model_inputs,
    untouched,
    unwrap,
    values_for,
)
from hookscope.errors import ArgumentValueError, HookscopeError
from hookscope.record import padding_dropped
from hookscope.util import get_part, iter_tensors

__all__ = ["NamedStats", "RunningStats", "stats"]

Tensor = torch.Tensor

PerChannel = bool | int


class RunningStats:
    """Count, mean, std, min, max, zeros and non-finite values of a stream of tensors.

    Accumulators are float64 (int64 for counts) on the CPU. NaN and +-Inf elements are counted
    in ``count`` and ``nonfinite`` but left out of mean, std, min and max. The standard
    deviation is the population one (``ddof=0``, as ``numpy.std``) of the finite elements.

    Per channel (``channel_dim`` set), every statistic is a float64 tensor of shape
    ``(channels,)`` over all other dimensions; otherwise each is a 0-d tensor.

    Args:
        channel_dim: Dimension of the updates that holds channels, e.g. 1 for
            ``(batch, channels, height, width)`` or -1 for ``(batch, seq, d_model)``;
            ``None`` for one statistic over all elements.
    """

    def __init__(self, channel_dim: int | None = None) -> None:
        self.channel_dim = channel_dim
        self.count = torch.zeros((), dtype=torch.int64)
        self.finite = torch.zeros((), dtype=torch.int64)
        self.zeros = torch.zeros((), dtype=torch.int64)
        self.mean = torch.zeros((), dtype=torch.float64)
        self.m2 = torch.zeros((), dtype=torch.float64)
        self.min = torch.full((), float("inf"), dtype=torch.float64)
        self.max = torch.full((), float("-inf"), dtype=torch.float64)
        self.histogram: Histogram | None = None  # set by stats(..., hist=N)

    @property
    def nonfinite(self) -> Tensor:
        """Number of NaN and +-Inf elements seen, int64."""
        return self.count - self.finite

    def update(self, tensor: Tensor) -> None:
        """Add every element of ``tensor`` (any shape, real dtype) to the statistics.

        Raises:
            HookscopeError: ``tensor`` is complex, lacks ``channel_dim``, or has a different
                number of channels than earlier updates.
        """
        if tensor.is_complex():
            raise HookscopeError(f"cannot take statistics of a complex tensor ({tensor.dtype}); "
                                 "pass its .real or .abs()")
        batch = RunningStats.__new__(RunningStats)  # every field is set by _fill_from
        batch.channel_dim, batch.histogram = self.channel_dim, None
        batch._fill_from(self._rows(tensor))
        if self.count.dim() == 0 and int(self.count) == 0:  # the first update: take it whole
            self._take(batch)
        else:
            self.merge(batch)

    def merge(self, other: RunningStats) -> RunningStats:
        """Fold ``other`` into these statistics (Chan et al. 1979) and return ``self``.

        The result equals one pass over both streams, up to float64 rounding.

        Raises:
            HookscopeError: the two hold different numbers of channels.
        """
        if self.count.dim() == 0 and int(self.count) == 0:  # nothing seen yet: take other's shape
            self._copy_from(other)
            return self
        if other.count.shape != self.count.shape:
            raise HookscopeError(f"cannot merge statistics over {_describe(other.count)} into "
                                 f"statistics over {_describe(self.count)}")
        n_a, n_b = self.finite.double(), other.finite.double()
        n = n_a + n_b
        safe_n = n.clamp(min=1.0)
        delta = other.mean - self.mean
        self.mean = self.mean + delta * n_b / safe_n
        self.m2 = self.m2 + other.m2 + delta * delta * n_a * n_b / safe_n
        self.count = self.count + other.count
        self.finite = self.finite + other.finite
        self.zeros = self.zeros + other.zeros
        self.min = torch.minimum(self.min, other.min)
        self.max = torch.maximum(self.max, other.max)
        return self

    def std(self) -> Tensor:
        """Population standard deviation of the finite elements, float64 (NaN when none)."""
        return (self.m2 / self.finite.double()).sqrt()

    def as_dict(self) -> dict[str, Any]:
        """Return plain numbers: a float or int per statistic, or a list of them per channel.

        Keys: ``count`` (elements seen), ``mean``, ``std`` (the population standard deviation,
        ``ddof=0``: ``torch.std(x, correction=0)``, as the streaming algorithm of Chan, Golub and
        LeVeque 1979 gives), ``min``, ``max`` (of the finite elements; NaN when none),
        ``frac_zeros`` and ``frac_nonfinite`` (fractions of ``count``).
        """
        if self.count.dim() == 0:
            return self._scalar_dict()
        count = self.count.double()
        empty = self.finite == 0
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        values = {
            "count": self.count,
            "mean": torch.where(empty, nan, self.mean),
            "std": self.std(),
            "min": torch.where(empty, nan, self.min),
            "max": torch.where(empty, nan, self.max),
            "frac_zeros": self.zeros.double() / count,
            "frac_nonfinite": self.nonfinite.double() / count,
        }
        return {key: value.tolist() for key, value in values.items()}

    def _scalar_dict(self) -> dict[str, Any]:
        """``as_dict`` of statistics over all elements, in Python floats: the same float64
        operations (IEEE division and square root round alike in torch and Python)."""
        count, finite, zeros = int(self.count), int(self.finite), int(self.zeros)
        nan = math.nan
        return {"count": count,
                "mean": float(self.mean) if finite else nan,
                "std": math.sqrt(float(self.m2) / finite) if finite else nan,
                "min": float(self.min) if finite else nan,
                "max": float(self.max) if finite else nan,
                "frac_zeros": zeros / count if count else nan,
                "frac_nonfinite": (count - finite) / count if count else nan}

    def __repr__(self) -> str:
        d = self.as_dict()
        if self.channel_dim is not None:
            return f"RunningStats(channel_dim={self.channel_dim}, channels={len(d['count'])})"
        return ("RunningStats(" + ", ".join(f"{k}={v:.6g}" for k, v in d.items()) + ")")

    def _rows(self, tensor: Tensor) -> Tensor:
        """Return ``tensor`` as float64 on a device that has it: ``(elements,)`` or
        ``(channels, elements)``."""
        device = tensor.device if tensor.device.type in ("cpu", "cuda") else torch.device("cpu")
        values = tensor.detach().to(device=device, dtype=torch.float64)
        if self.channel_dim is None:
            return values.reshape(-1)
        if values.dim() == 0 or not -values.dim() <= self.channel_dim < values.dim():
            raise ArgumentValueError(
                f"per-channel statistics need dimension {self.channel_dim}, but the output has "
                f"shape {tuple(tensor.shape)}; pass per_channel=<the channel dimension> "
                "(1 for (batch, channels, ...), -1 for (batch, seq, d_model))")
        channels = values.shape[self.channel_dim]  # 0 channels: (0, 0), not reshape's -1 error
        return values.movedim(self.channel_dim, 0).reshape(
            channels, values.numel() // channels if channels else 0)

    def _fill_from(self, rows: Tensor) -> None:
        """Set the statistics of one batch (two-pass, float64): ``rows`` as from ``_rows``.

        A finite float64 sum of each row means every element of it is finite (NaN and +-Inf
        propagate into a sum), and then no element needs masking: the same sums, over the
        same values, without the masks (one host sync for the test). ``rows`` converted from
        a float32 or narrower tensor cannot overflow the float64 sum; an overflow of float64
        input takes the masked path, which is exact for every input."""
        total = rows.sum(dim=-1)
        if rows.shape[-1] > 0 and bool(torch.isfinite(total).all()):
            self._fill_finite(rows, total)
        else:
            self._fill_masked(rows)

    def _fill_finite(self, rows: Tensor, total: Tensor) -> None:
        """``_fill_from`` of non-empty rows whose every element is finite."""
        size = rows.shape[-1]
        mean = total / size
        deviation = rows - mean.unsqueeze(-1)
        self.count = torch.full(total.shape, size, dtype=torch.int64)
        self.finite = self.count.clone()
        self.zeros = (size - torch.count_nonzero(rows, dim=-1)).cpu()
        self.mean = mean.cpu()
        self.m2 = deviation.square().sum(dim=-1).cpu()
        self.min = rows.amin(dim=-1).cpu()
        self.max = rows.amax(dim=-1).cpu()

    def _fill_masked(self, rows: Tensor) -> None:
        """``_fill_from`` of rows that may hold NaN or +-Inf (left out of the sums)."""
        finite = torch.isfinite(rows)
        n = finite.sum(dim=-1)
        zero = torch.zeros((), dtype=torch.float64, device=rows.device)
        kept = torch.where(finite, rows, zero)
        mean = kept.sum(dim=-1) / n.clamp(min=1)
        deviation = torch.where(finite, rows - mean.unsqueeze(-1), zero)
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=rows.device)
        has_any = rows.shape[-1] > 0
        self.count = torch.full_like(n, rows.shape[-1]).cpu()
        self.finite = n.cpu()
        self.zeros = (rows == 0).sum(dim=-1).cpu()
        self.mean = mean.cpu()
        self.m2 = (deviation * deviation).sum(dim=-1).cpu()
        if has_any:
            self.min = torch.where(finite, rows, inf).amin(dim=-1).cpu()
            self.max = torch.where(finite, rows, -inf).amax(dim=-1).cpu()
        else:  # no elements: the identities of min and max
            self.min, self.max = inf.expand_as(mean).cpu(), -inf.expand_as(mean).cpu()

    def _copy_from(self, other: RunningStats) -> None:
        for name in ("count", "finite", "zeros", "mean", "m2", "min", "max"):
            setattr(self, name, getattr(other, name).clone())

    def _take(self, other: RunningStats) -> None:
        """``_copy_from`` a batch no one else holds: its tensors, not copies."""
        for name in ("count", "finite", "zeros", "mean", "m2", "min", "max"):
            setattr(self, name, getattr(other, name))


def stats(model: nn.Module, batches: Iterable[Any], layers: str | list[str] = "**", *,
          per_channel: PerChannel = False, early_stop: bool = False, hist: int | None = None,
          hist_range: tuple[float, float] | None = None) -> NamedStats:
    """Run ``model`` over ``batches`` and return streaming statistics of each selected output
    (count, mean, population std with ``ddof=0``, min, max, fractions of zeros and NaN/Inf).

    Each module's output updates its ``RunningStats`` inside the forward hook and is dropped, so
    memory does not grow with the number of batches. Forwards run under ``torch.no_grad()`` in
    the model's current train/eval mode; hooks are removed on return, also on an error, and the
    model is left as it was found, once around all batches (BatchNorm statistics, spectral
    norm, train/eval flags, ``requires_grad``, ``.grad``, the RNG state:
    ``engine.run.untouched``). A module
    returning a structure (tuple, dict, ...) contributes its first floating-point tensor (e.g.
    ``attn_output`` of MultiheadAttention); a module called several times per forward (a shared
    activation) adds every call. For a batch with an ``attention_mask`` ``(batch, seq)``, each
    output counts only its real tokens, on its token axis (``engine.values.layout``: dim 1 of a module
    output, the queries of ``scaled_dot_product_attention``, dim 0 of a sequence-first
    ``nn.MultiheadAttention``; a function's value of unknown layout is read as ``(batch, seq,
    ...)``), so the numbers do not depend on how sentences were batched and padded; a batch
    that looks padded (``config.pad_token_id``) but has no mask is refused.

    Args:
        model: Root module.
        batches: Iterable of batches as a DataLoader yields them: a tensor is called as
            ``model(batch)``, a dict as ``model(**batch)``, a tuple or list as
            ``(inputs, labels, ...)`` whose first item is the inputs (a tensor, a dict, or a
            tuple of positional inputs); the same meaning as in ``hookscope.extract``.
        layers: Pattern or list of patterns for ``hookscope.select`` (default every module).
        per_channel: ``False``: one statistic per layer over all elements. ``True``: per
            channel, along dimension 1 for outputs of 2, 4 or 5 dims (``(batch, features)``,
            ``(batch, channels, height, width)``) and along the last dimension for 3-dim
            outputs (``(batch, seq, d_model)``, tokens). An ``int``: that dimension for every
            layer, e.g. ``1`` for Conv1d's ``(batch, channels, length)``.
        early_stop: stop each forward once every selected module has returned (the rest of
            the model does not run; see ``capture``).
        hist: also a ``Histogram`` of ``hist`` equal-width bins of each output (over all
            elements, whatever ``per_channel``), in ``RunningStats.histogram``; it equals
            ``torch.histc`` of the same values (``diagnostics.histogram``). Fixed memory.
        hist_range: the histograms' outer edges ``(lo, hi)`` for every layer (values outside
            are counted in ``below``/``above``). ``None``: each layer's ``[min, max]`` from a
            first pass over ``batches`` (the statistics' own pass), then a second pass counts;
            ``batches`` must then be re-iterable (a list, a DataLoader), and the histogram
            equals ``torch.histc(values, hist)`` with its default range.

    Returns:
        A ``NamedStats``, a dict ``{name: RunningStats}`` in ``named_modules()`` order, each
        module by the name asked (``"resid_post.1"`` for a standard name; else its path, with
        output parts: ``"lstm[1][0]"``), its module path in ``.paths[name]``; ``.as_dict()``
        gives plain numbers. A module that never ran keeps
        ``count == 0`` and is named, with the likely cause, in a ``HookNeverFiredWarning``.
        Quantized outputs (``torch.quint8``...) are summarised dequantized (float32).

    Raises:
        SelectorError: a pattern matches no module.
        ArgumentTypeError: ``batches`` is not iterable (``None``), ``per_channel`` is neither a
            bool nor an int (``"yes"``), at the call.
        ArgumentValueError: an output lacks the ``per_channel`` dimension asked for (in the
            forward that meets it).
        HookscopeError: the model is TorchScript, ``batches`` is empty, or an output is complex;
            ``hist`` without ``hist_range`` over a one-pass iterator (a generator).
        PositionError: a batch looks padded (runs of ``config.pad_token_id``) but has no
            ``attention_mask``, so padding would count as tokens.
    """
    patterns = as_patterns(layers)
    check_flag("early_stop", early_stop)
    check_iterable("batches", batches, "a DataLoader or [x]")
    if not isinstance(per_channel, bool):
        check_int("per_channel", per_channel)
    fixed = _fixed_range(hist, hist_range, batches)
    session = _StatsSession(model, patterns, per_channel, early_stop)
    if hist is not None and fixed is not None:
        session.histograms = {t.key: Histogram(hist, *fixed) for t in session.targets}
    with untouched(model), torch.no_grad():
        with session:
            _run_batches(model, session, batches)
        if hist is not None and fixed is None:  # the second pass: edges from the first
            counting = _StatsSession(model, patterns, per_channel, early_stop, "ignore")
            counting.histograms = {key: Histogram.spanning(hist, float(r.min.min()),
                                                           float(r.max.max()))
                                   for key, r in session.results.items()}
            counting.count_stats = False
            with counting:
                _run_batches(model, counting, batches)
            session.histograms = counting.histograms
    for key, histogram in session.histograms.items():
        session.results[key].histogram = histogram
    keys, names = asked_names(session.targets)
    return NamedStats({name: session.results[key] for name, key in zip(names, keys, strict=True)},
                      dict(zip(names, keys, strict=True)))


class NamedStats(dict[str, "RunningStats"]):
    """``stats``' result: a dict ``{name asked: RunningStats}`` (a standard name as given,
    ``"resid_post.1"``; else the record name, a path with its output parts) and ``paths``,
    ``{name: record name}`` (``{"resid_post.1": "transformer.h.1"}``; a path maps to itself)."""

    def __init__(self, results: dict[str, RunningStats], paths: dict[str, str]):
        super().__init__(results)
        self.paths = paths


def _fixed_range(hist: int | None, hist_range: tuple[float, float] | None,
                 batches: Iterable[Any]) -> tuple[float, float] | None:
    """Check ``stats``' histogram arguments (at the call, before any forward); return the
    given ``(lo, hi)`` or None (no histogram, or edges from a first pass)."""
    if hist is None:
        if hist_range is not None:
            raise ArgumentValueError("hist_range= without hist=: pass hist=<number of bins> too")
        return None
    check_int("hist", hist, minimum=1, maximum=MAX_BINS)
    if hist_range is None:
        if iter(batches) is batches:
            raise HookscopeError("hist= without hist_range= takes the bin edges from a first pass "
                                 "over batches, but batches is a one-pass iterator: pass a list "
                                 "or a DataLoader, or hist_range=(lo, hi)")
        return None
    if not (isinstance(hist_range, (tuple, list)) and len(hist_range) == 2):
        raise ArgumentValueError(f"hist_range={hist_range!r}: pass two numbers (lo, hi)")
    Histogram(hist, hist_range[0], hist_range[1])  # checks bins and edges
    return float(hist_range[0]), float(hist_range[1])


def _run_batches(model: nn.Module, session: _StatsSession, batches: Iterable[Any]) -> None:
    """One forward per batch under ``session`` (its hooks do the counting)."""
    count = 0
    for batch in batches:
        args, kwargs = model_inputs(batch)
        with session.forward_boundary():
            model(*args, **kwargs)
        count += 1
    if count == 0:
        raise HookscopeError("batches was empty: pass at least one batch (a tensor, a dict "
                             "of keyword inputs, or a tuple (inputs, labels))")


class _StatsSession(HookSession):
    """Hooks that fold each selected output into its ``RunningStats`` and keep nothing else."""

    _unfired_consequence = "their statistics are empty (count 0)"

    def __init__(self, model: nn.Module, patterns: list[str], per_channel: PerChannel,
                 early_stop: bool, on_unfired: OnUnfired = "warn"):
        super().__init__(model, patterns, on_unfired)
        self._early_stop = early_stop
        self.results = {t.key: RunningStats() for t in self.targets}
        self._per_channel = per_channel
        self.tokens = MaskWatcher(unwrap(model)[0])  # the mask of the batch running now
        self.histograms: dict[str, Histogram] = {}  # the keys whose outputs are also counted
        self.count_stats = True  # False: a second pass that only counts the histograms

    def _register(self) -> None:
        for _, module in self.tokens.modules:  # the root, an encoder-decoder's stacks
            self._hook(module, self.tokens.hook, pre=True, with_kwargs=True)
        for target in self.targets:
            self._hook_output(target, self._updater(target))
        if self._early_stop:
            self._stop_early()

    def _updater(self, target: Target) -> Callable[[nn.Module, Any, Any], None]:
        running, parts, ran = self.results[target.key], target.parts, self._ran
        per_channel = self._per_channel

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            ran.add(target.path)
            part = get_part(output, parts) if parts else output
            if kind_of(part) is not None:  # a tensor, a PackedSequence: as its kind reads it
                if isinstance(part, Tensor):
                    check_not_transformed(part, target.key)
                tensor: Tensor | None = values_for(part, target.key, "stats")
            else:
                tensors = [keepable(t, target.key) for t in iter_tensors(part)]  # quantized: dequantized
                tensor = _summarised(tensors, target.key)
            if tensor is None:
                return
            tensor = _real_tokens(tensor, target, self.tokens.tokens)  # padding dropped
            if target.key in self.histograms:
                self.histograms[target.key].update(tensor)
            if not self.count_stats:
                return
            if int(running.count.sum()) == 0:
                running.channel_dim = _channel_dim_for(tensor, per_channel)
            running.update(tensor)
        return hook


def _real_tokens(tensor: Tensor, target: Target, tokens: Tokens) -> Tensor:
    """The real tokens of ``tensor`` (``record.padding_dropped``), ``tensor`` when the forward
    said nothing about its tokens.

    Raises:
        PositionError: the input looks padded but no mask was given
            (``engine.values.layout.check_no_unmasked_padding``).
    """
    if not tokens.known:
        return tensor
    check_no_unmasked_padding(tokens, f"stats of '{target.key}'", positions=False)
    return padding_dropped(tensor, target, tokens)


def _summarised(tensors: list[Tensor], key: str) -> Tensor | None:
    """The tensor of an output whose statistics are taken: its first floating tensor (the values
    of a ``(values, indices)`` pair), else its first integer or bool tensor (ids, masks: counted,
    not skipped); ``None`` when it holds no tensor.

    Raises:
        HookscopeError: the output's only values are complex, or it is a meta tensor or a
            FakeTensor (no data).
    """
    real = [t for t in tensors if not t.is_complex()]
    tensor = next((t for t in real if t.is_floating_point()), real[0] if real else None)
    if tensor is None and tensors:
        raise HookscopeError(f"'{key}' returned {tensors[0].dtype}: cannot take statistics of a "
                             f"complex tensor; select a module after it that returns its .real "
                             f"or .abs(), or capture it (hookscope.capture) instead")
    if tensor is not None:
        check_has_values(tensor, key, "take statistics of")
    return tensor


def _channel_dim_for(tensor: Tensor, per_channel: PerChannel) -> int | None:
    """Return the channel dimension that ``per_channel`` means for ``tensor`` (see ``stats``)."""
    if per_channel is False:
        return None
    if per_channel is True:
        return -1 if tensor.dim() == 3 else 1
    return int(per_channel)


def _describe(count: Tensor) -> str:
    return "all elements" if count.dim() == 0 else f"{count.shape[0]} channels"
