"""The readout of a language model as an affine map: its final norm with the scale frozen at one
run's values, then its unembedding (TransformerLens's ``apply_ln_to_stack`` semantics).

A final norm is ``y = P x / s(x) * w + b``: ``P`` centres ``x`` (LayerNorm) or not (RMSNorm),
``s(x)`` is the per-position scale (``sqrt(var + eps)`` or ``sqrt(mean(x^2) + eps)``), ``w`` the
gain (``1 + weight`` in Gemma) and ``b`` an optional bias. With ``s`` frozen at the values of a
run, ``y`` is affine in ``x``, so a sum of parts of the residual stream is read out as the sum of
their readouts plus one constant: ``(P x_c / s * w) . d = x_c . v`` with ``v = P (w * d) / s``
(``P`` is symmetric), the pulled-back direction ``v`` of ``direct_logit``.

The norm's form is not assumed from its class: each known form is computed from the run's own
input and compared with what the norm returned, and the one that matches is kept (``freeze_norm``;
none matching is refused). A linear unembedding's direction ``W_U[a] - W_U[b]`` and constant
``b_U[a] - b_U[b]`` are read by calling it on zeros and differentiating (``unembedding``), so
``nn.Linear``, tied weights and a ``HookedTransformer``'s ``Unembed`` need nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hookscope.errors import EditError

__all__ = ["FrozenNorm", "close", "freeze_norm", "tolerance", "unembedding"]

Tensor = torch.Tensor

# (name, centred, gain offset): LayerNorm, RMSNorm, Gemma's RMSNorm (x * (1 + weight))
FORMS = (("LayerNorm", True, 0.0), ("RMSNorm", False, 0.0), ("RMSNorm with gain 1 + weight", False, 1.0))
EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps")


@dataclass(frozen=True)
class FrozenNorm:
    """A final norm with its scale frozen at one run (module docstring).

    Attributes:
        form: ``"LayerNorm"``, ``"RMSNorm"`` or ``"RMSNorm with gain 1 + weight"``.
        centred: the norm subtracts the mean over ``d_model``.
        gain: ``(d_model,)`` float64, the effective gain ``w``.
        bias: ``(d_model,)`` float64 (zeros when the norm has none).
        scale: ``(batch, seq, 1)`` float64, the run's ``s(x)``.
    """

    form: str
    centred: bool
    gain: Tensor
    bias: Tensor
    scale: Tensor

    def pull_back(self, direction: Tensor) -> Tensor:
        """``v`` ``(batch, seq, d_model)`` float64 with ``frozen(x) . direction = x . v +
        constant``, for ``direction`` ``(batch, d_model)`` read after the norm."""
        weighted = self.gain * direction.double()  # (batch, d_model)
        if self.centred:
            weighted = weighted - weighted.mean(-1, keepdim=True)
        return weighted[:, None, :] / self.scale

    def constant(self, direction: Tensor) -> Tensor:
        """``b . direction`` per row, ``(batch, 1)`` float64: the norm's bias read out."""
        return (self.bias * direction.double()).sum(-1, keepdim=True)


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a check on values a model of ``dtype`` computed."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def close(got: Tensor, expected: Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """``(|got - expected| <= tol * (1 + max |expected|), max difference)``, in float64."""
    difference = float((got.double() - expected.double()).abs().max()) if got.numel() else 0.0
    scale = 1.0 + (float(expected.double().abs().max()) if expected.numel() else 0.0)
    return difference <= tolerance(dtype) * scale, difference


def freeze_norm(norm: nn.Module, path: str, x: Tensor, y: Tensor) -> FrozenNorm:
    """The final norm ``norm`` (at ``path``) frozen at the run where it read ``x`` and returned
    ``y``, both ``(batch, seq, d_model)``: the first form of ``FORMS`` that, computed from ``x``
    with the module's own ``weight``/``w``, ``bias``/``b`` and epsilon, gives ``y``.

    Raises:
        EditError: no form gives ``y`` (another norm, or something between the last block and
            the readout); the message names the smallest difference found.
    """
    gain = _parameter(norm, ("weight", "w"), x.shape[-1])
    bias = _parameter(norm, ("bias", "b"), x.shape[-1])
    eps = _epsilon(norm, y.dtype)
    x64 = x.double()
    found: list[tuple[float, str]] = []
    for form, centred, offset in FORMS:
        moved = x64 - x64.mean(-1, keepdim=True) if centred else x64
        scale = (moved.square().mean(-1, keepdim=True) + eps).sqrt()  # (batch, seq, 1)
        frozen = FrozenNorm(form, centred, (gain if gain is not None else torch.ones(x.shape[-1],
                            dtype=torch.float64)) + offset,
                            bias if bias is not None else torch.zeros(x.shape[-1], dtype=torch.float64),
                            scale)
        ok, difference = close(moved / scale * frozen.gain + frozen.bias, y, y.dtype)
        if ok:
            return frozen
        found.append((difference, form))
    difference, form = min(found)
    raise EditError(f"the final norm '{path}' ({type(norm).__name__}) is none of the forms "
                    f"direct logit attribution reads ({', '.join(f for f, _, _ in FORMS)}): "
                    f"computed from its input, the closest ({form}) differs from its output by "
                    f"{difference:.3g}; it needs a norm of one of these forms applied to the last "
                    f"block's output, with nothing between them")


def _parameter(norm: nn.Module, names: tuple[str, ...], width: int) -> Tensor | None:
    for name in names:
        value = getattr(norm, name, None)
        if isinstance(value, Tensor) and value.shape == (width,):
            return value.detach().double().cpu()
    return None


def _epsilon(norm: nn.Module, dtype: torch.dtype) -> float:
    for name in EPS_NAMES:
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return float(torch.finfo(dtype).eps)  # nn.RMSNorm(eps=None)


def unembedding(unembed: nn.Module, width: int, like: Tensor, a: Tensor,
                b: Tensor) -> tuple[Tensor, Tensor]:
    """``(direction (batch, width), constant (batch, 1))`` float64 on the CPU: ``W_U[a] -
    W_U[b]`` and ``b_U[a] - b_U[b]`` of the linear ``unembed`` for each row's tokens ``a`` and
    ``b`` (``(batch,)`` int64), read by calling it once on a zero vector (dtype and device of
    its first parameter, else of ``like``) and differentiating, one row per distinct token."""
    used = torch.unique(torch.cat([a, b]))
    weight = next(unembed.parameters(), like)  # the unembedding's own device and dtype
    with torch.inference_mode(False), torch.enable_grad():
        zero = torch.zeros(1, width, dtype=weight.dtype, device=weight.device, requires_grad=True)
        out = unembed(zero)[0]  # (vocab,): b_U
        picks = torch.zeros(len(used), out.shape[0], dtype=out.dtype, device=out.device)
        picks[torch.arange(len(used)), used.to(out.device)] = 1
        rows = torch.autograd.grad(out, zero, grad_outputs=picks, is_grads_batched=True)[0]
    where = {int(token): i for i, token in enumerate(used)}
    rows = rows[:, 0].detach().double().cpu()  # (distinct tokens, width): W_U rows
    bias = out.detach().double().cpu()
    ia = torch.tensor([where[int(t)] for t in a])
    ib = torch.tensor([where[int(t)] for t in b])
    return rows[ia] - rows[ib], (bias[a.cpu()] - bias[b.cpu()])[:, None]
