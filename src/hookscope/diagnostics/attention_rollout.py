"""Attention rollout: how much each input token flows into each token through every layer.

Abnar and Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020 (arXiv:2005.00928),
section 3: the residual connection is accounted for by averaging each layer's attention with the
identity, ``A_hat = 0.5 A + 0.5 I`` (rows renormalised to sum to 1), and the layers are chained
by matrix products, ``rollout = A_hat_L @ ... @ A_hat_1``. The heads of a layer are fused first
(their mean in the paper; max or min as in Gildenblat's vit-explain, which also introduced
``discard_ratio``: the weakest fraction of each fused map set to 0, never the attention to the
first token, the class token).

The gradient-weighted variant follows Chefer, Gur and Wolf, "Generic Attention-model
Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021
(arXiv:2103.15679), eq. 5-6: each layer's map is the positive part of the gradient-weighted
attention averaged over heads, ``A_bar = E_h[(dy/dA * A)^+]`` (``y`` the target class's logit),
and the layers are chained with the identity as the residual, ``R <- R + A_bar R`` from ``R = I``
(no renormalisation: the rows do not sum to 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from hookscope.diagnostics.attention_maps import attention, attention_gradients
from hookscope.diagnostics.class_maps import check_class_target, class_scores
from hookscope.engine import check_flag, check_number
from hookscope.errors import AttentionError

__all__ = ["rollout"]

Tensor = torch.Tensor
Fusion = Literal["mean", "max", "min"]


def rollout(model: nn.Module, *args: Any, layers: str | Sequence[str], head_fusion: Fusion = "mean",
            discard_ratio: float = 0.0, gradient: bool = False,
            target: int | Sequence[int] | Tensor | None = None, **kwargs: Any) -> Tensor:
    """Attention rollout of ``model(*args, **kwargs)`` over ``layers`` (Abnar & Zuidema, 2020).

    ```python
    flow = hookscope.rollout(vit, x, layers="vit.layers.*.attention")  # (batch, 17, 17)
    cls = flow[:, 0, 1:].reshape(-1, 4, 4)    # how much each patch flows into the class token
    relevance = hookscope.rollout(vit, x, layers="vit.layers.*.attention", target=3)
    ```

    The probabilities come from ``hookscope.attention`` (one forward, the model left as found).
    With ``gradient=True`` (or a ``target``) each head is weighted by the gradient of the
    target class's logit (Chefer et al., 2021; ``attention_gradients``: one forward, one
    backward; call ``model.eval()`` first) and the chain is ``R <- R + A_bar R``.

    Args:
        model: root module.
        *args, **kwargs: the forward arguments.
        layers: patterns of the attention modules (or blocks), each computing one self-attention
            ``(batch, heads, tokens, tokens)`` per call; chained in ``named_modules()`` order.
        head_fusion: ``"mean"`` (the paper), ``"max"`` or ``"min"`` over the heads.
        discard_ratio: in [0, 1): this fraction of each fused map's entries (per batch row, the
            smallest) is set to 0 before the identity is added; the first column (attention to
            the class token) is never discarded.
        gradient: weight the heads by ``d logit[target] / d A`` and keep the positive part
            (``A_bar = E_h[(dA * A)^+]``); needs ``head_fusion="mean"`` and a model returning
            class scores ``(batch, classes)`` (a tensor or an output with ``.logits``).
        target: the class per batch row (one int for all, or one each); ``None``: the
            predicted class. Giving one implies ``gradient=True``.

    Returns:
        ``(batch, tokens, tokens)`` float32: row ``i`` is how much each input token flows into
        token ``i`` of the last layer; each row sums to 1 (without ``gradient``; with it, row
        ``i`` is ``I`` plus the relevance gathered through the layers, unnormalised).

    Raises:
        SelectorError: a pattern matches no module.
        AttentionError: a module computes no attention or several (see ``attention``); an
            attention is not square (cross-attention); ``head_fusion`` or ``discard_ratio`` is
            not one of the values above; ``gradient`` with a ``head_fusion`` other than
            ``"mean"``; an ``nn.MultiheadAttention`` with ``gradient`` (no gradient reaches its
            returned weights).
        ArgumentTypeError: ``gradient`` is not a bool (``"no"`` is truthy), ``target`` not an
            int, ints or an integer tensor (at the call).
        GradcamError: with ``gradient``, the output is not class scores or ``target`` is out
            of range (the same rule as ``gradcam``).
    """
    if head_fusion not in ("mean", "max", "min"):
        raise AttentionError(f"head_fusion={head_fusion!r}: choose 'mean', 'max' or 'min'")
    check_number("discard_ratio", discard_ratio)
    if not 0.0 <= discard_ratio < 1.0:
        raise AttentionError(f"discard_ratio={discard_ratio} is outside [0, 1): give the fraction "
                             f"of each map to discard, e.g. 0.9")
    check_flag("gradient", gradient)
    check_class_target(target, None)
    if gradient or target is not None:
        return _gradient_rollout(model, args, kwargs, layers, head_fusion, discard_ratio, target)
    steps = [_with_residual(_discarded(_fused(_square(path, probabilities).float(), head_fusion),
                                       discard_ratio))
             for path, probabilities in attention(model, *args, layers=layers, **kwargs).items()]
    flow = steps[0]  # attention() returns at least one map or raises
    for step in steps[1:]:
        flow = step @ flow
    return flow


def _gradient_rollout(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      layers: str | Sequence[str], head_fusion: Fusion, discard_ratio: float,
                      target: int | Sequence[int] | Tensor | None) -> Tensor:
    """Chefer et al. (2021), eq. 5-6: ``R <- R + E_h[(dA * A)^+] R`` from ``R = I``."""
    if head_fusion != "mean":
        raise AttentionError(f"head_fusion={head_fusion!r} with gradient=True: the gradient-"
                             f"weighted rollout averages the heads (Chefer et al., eq. 5); "
                             f"leave head_fusion='mean'")
    maps = attention_gradients(model, *args, layers=layers,
                               score=lambda output: class_scores(output, target), **kwargs)
    relevance: Tensor | None = None
    for path, (probabilities, grads) in maps.items():
        fused = _discarded((grads * _square(path, probabilities)).clamp_min(0).mean(dim=1),
                           discard_ratio)
        relevance = torch.eye(fused.shape[-1], device=fused.device) + fused if relevance is None else (
            relevance + fused @ relevance)
    assert relevance is not None  # attention_gradients returns at least one map or raises
    return relevance


def _square(path: str, probabilities: Tensor) -> Tensor:
    if probabilities.shape[-1] != probabilities.shape[-2]:
        raise AttentionError(f"'{path}' attends {probabilities.shape[-2]} queries to "
                             f"{probabilities.shape[-1]} keys; rollout chains self-attention "
                             f"(tokens x tokens): select self-attention modules only")
    return probabilities


def _fused(probabilities: Tensor, how: Fusion) -> Tensor:
    """``(batch, heads, t, t)`` -> ``(batch, t, t)``."""
    if how == "mean":
        return probabilities.mean(dim=1)
    return probabilities.amax(dim=1) if how == "max" else probabilities.amin(dim=1)


def _discarded(fused: Tensor, ratio: float) -> Tensor:
    """The smallest ``ratio`` of each row's ``t * t`` entries set to 0, column 0 kept."""
    count = int(fused[0].numel() * ratio)
    if count == 0:
        return fused
    flat = fused.flatten(1).clone()
    lowest = flat.topk(count, dim=1, largest=False).indices
    keep = lowest % fused.shape[-1] == 0  # attention to the class token stays
    flat.scatter_(1, lowest, flat.gather(1, lowest) * keep)
    return flat.reshape(fused.shape)


def _with_residual(fused: Tensor) -> Tensor:
    """``0.5 A + 0.5 I``, each row renormalised to sum to 1 (Abnar & Zuidema, eq. in sec. 3)."""
    identity = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    step = 0.5 * fused + 0.5 * identity
    return step / step.sum(dim=-1, keepdim=True)
