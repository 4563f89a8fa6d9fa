"""Named reductions of a batch-first output to one row per input: ``"mean"``, ``"first"``, ``"last"``.

``REDUCTIONS`` is the one table of names: ``hookscope.extract`` (``reduce=``), the CLI's
``--reduce`` and ``hookscope.capture`` (``reduce=``) read it, and both pass the attention mask the
model is called with, so one name gives the same rows everywhere. Which axis each one uses:

- ``"mean"``: ``(batch, seq, features)`` tokens -> mean over dim 1 (the tokens; with an attention
  mask only the real ones); ``(batch, channels, height, width, ...)`` feature maps -> mean over
  dims 2 and on (the pixels), giving ``(batch, channels)``; ``(batch, features)`` is kept as is.
- ``"first"`` / ``"last"``: the first / last position of dim 1 of a ``(batch, seq, features)``
  output (the CLS token / the last token; with an attention mask, the first / last *real*
  token). An output without a token axis is refused: ``(batch, features)`` (logits, pooled
  features) and ``(batch, channels, height, width)`` feature maps, whose dim 1 is channels.

A reduction is a function ``(output, attention_mask or None) -> rows``; the output is
``(batch, ...)``, the mask ``(batch, seq)`` of 0/1 or bool, and the rows ``(batch, ...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hookscope.errors import ExtractError
from hookscope.record.positions import take_positions

__all__ = ["NAMES", "REDUCTIONS", "Reduce", "Reduction", "ReductionError", "reduction",
           "reduction_name"]

Tensor = torch.Tensor
Reduce = str | Callable[[Tensor], Tensor] | None
Reduction = Callable[[Tensor, Tensor | None], Tensor]


class ReductionError(ExtractError):
    """A reduction that is not known, or that does not apply to an output's shape (an
    ``ExtractError``, as ``extract`` raised before reductions had their own module)."""


def reduction(reduce: Reduce) -> Reduction | None:
    """Return the reduction that ``reduce`` names (``None`` for none).

    Args:
        reduce: ``None``; one of ``NAMES``; or a function mapping ``(batch, ...)`` to
            ``(batch, ...)`` (it is given the output only, not the mask).

    Raises:
        ReductionError: ``reduce`` is another string or object (checked here, before any run);
            the returned reduction, when a ``reduce`` function returns no tensor.
    """
    if reduce is None:
        return None
    if isinstance(reduce, str):
        if reduce not in REDUCTIONS:
            raise ReductionError(f"reduce={reduce!r} is not a reduction: use one of "
                                 f"{', '.join(repr(n) for n in NAMES)}, None, or a function of "
                                 f"the (batch, ...) output")
        return REDUCTIONS[reduce]
    if not callable(reduce):
        raise ReductionError(f"reduce={reduce!r} is a {type(reduce).__name__}: use one of "
                             f"{', '.join(repr(n) for n in NAMES)}, None, or a function")
    function = reduce

    def reduced(t: Tensor, mask: Tensor | None) -> Tensor:
        rows = function(t)
        if not isinstance(rows, Tensor):
            raise ReductionError(f"reduce function {getattr(function, '__name__', function)} returned "
                                 f"a {type(rows).__name__} for an output of shape "
                                 f"{tuple(t.shape)}; it must return a tensor whose dim 0 is the "
                                 f"batch, e.g. lambda t: t.mean(dim=1)")
        return rows
    return reduced


def reduction_name(reduce: Reduce) -> str | None:
    """The name kept in a store's manifest: the string, or ``module.qualname`` of a function."""
    if callable(reduce):
        return f"{getattr(reduce, '__module__', '?')}.{getattr(reduce, '__qualname__', '?')}"
    return reduce


def _tokens(t: Tensor, mask: Tensor | None) -> bool:
    """True when dim 1 of ``t`` is tokens: the mask says so, or ``t`` is ``(batch, seq, d)``."""
    return (mask is not None and t.dim() >= 2 and t.shape[:2] == mask.shape) or t.dim() == 3


def _mean(t: Tensor, mask: Tensor | None) -> Tensor:
    if t.dim() >= 3 and mask is not None and t.shape[:2] == mask.shape:
        acc = torch.promote_types(t.dtype, torch.float32)
        weight = mask.to(acc).reshape(*mask.shape, *[1] * (t.dim() - 2))  # (batch, seq, 1, ...)
        return ((t.to(acc) * weight).sum(1) / weight.sum(1).clamp(min=1)).to(t.dtype)
    if t.dim() >= 4:
        return t.mean(dim=tuple(range(2, t.dim())))  # (batch, channels, height, width) -> (batch, c)
    return t.mean(dim=1) if t.dim() == 3 else t


def _position(t: Tensor, mask: Tensor | None, last: bool) -> Tensor:
    if not _tokens(t, mask):
        kind = "no token axis" if t.dim() <= 2 else "dim 1 is channels of a feature map"
        raise ReductionError(
            f"reduce='{'last' if last else 'first'}' takes the {'last' if last else 'first'} "
            f"token of a (batch, seq, features) output, but this output is {tuple(t.shape)} "
            f"({kind}); use reduce='mean' (pixels of a feature map) or no reduction")
    known = mask if mask is not None and t.shape[:2] == mask.shape else None
    return take_positions(t, -1 if last else 0, known)  # counted among real tokens


def _first(t: Tensor, mask: Tensor | None) -> Tensor:
    return _position(t, mask, last=False)


def _last(t: Tensor, mask: Tensor | None) -> Tensor:
    return _position(t, mask, last=True)


REDUCTIONS: dict[str, Reduction] = {"mean": _mean, "first": _first, "last": _last}
NAMES = tuple(REDUCTIONS)  # the names, in the order messages and --reduce list them
