"""Attention probabilities of any model, from the one attention computation of each selected module.

A transformer computes its attention probabilities either *eagerly*, with a softmax over the last
dimension of the ``(batch, heads, query, key)`` scores, or in one fused call,
``F.scaled_dot_product_attention`` (SDPA), which never returns them. ``attention`` watches the
forward of each selected module (see ``engine.function_mode``), takes the softmax's output as it is,
and for SDPA recomputes the probabilities from the recorded query, key, mask, scale, causal flag
and GQA flag, following the reference implementation in PyTorch's documentation of
``torch.nn.functional.scaled_dot_product_attention``
(https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from hookscope.engine import (
    FunctionCall,
    Observer,
    Watch,
    as_patterns,
    refuse_uninterceptable,
    resolve,
    untouched,
)
from hookscope.errors import AttentionError
from hookscope.record import gradient_pass

__all__ = ["attention", "attention_gradients", "sdpa_probabilities", "ATTENTION_FUNCTIONS"]

Tensor = torch.Tensor
SDPA = "scaled_dot_product_attention"
MHA = "multi_head_attention_forward"  # nn.MultiheadAttention's function; its softmax is inside
ATTENTION_FUNCTIONS = frozenset({SDPA, "softmax", MHA})
SLICE = "getitem"  # a softmax's output sliced before use is not the map (attention sinks)
T = TypeVar("T")


def sdpa_probabilities(query: Tensor, key: Tensor, attn_mask: Tensor | None = None,
                       is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> Tensor:
    """The attention probabilities that ``F.scaled_dot_product_attention`` uses but never returns.

    ``softmax(query @ key.T * scale + bias)`` as in PyTorch's reference implementation: ``scale``
    defaults to ``1 / sqrt(E)``; a boolean ``attn_mask`` keeps the positions that are True (the
    others get ``-inf``), a float one is added; ``is_causal`` masks keys after the query
    (top-left aligned); ``enable_gqa`` repeats each key head for its group of query heads.
    Dropout is not applied: these are the probabilities before it. A query row with every key
    masked (``-inf``: the padding queries of a left-padded causal batch) holds zeros, as
    ``F.scaled_dot_product_attention`` computes it since torch 2.5 (its ``_safe_softmax``: the
    output there is 0), not the NaN of the documentation's reference code; a NaN in
    ``query``/``key`` still gives NaN. Half-precision inputs are computed in float32.

    Args:
        query: ``(batch, heads, query, E)``, or any leading dims ``(..., query, E)``.
        key: ``(batch, kv_heads, key, E)``; ``kv_heads`` divides ``heads`` with ``enable_gqa``.
        attn_mask: broadcastable to ``(batch, heads, query, key)``; bool or float.
        is_causal: causal masking, as SDPA's flag.
        scale: the factor applied to ``query @ key.T``; ``None`` for ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention, as SDPA's flag.

    Returns:
        ``(batch, heads, query, key)`` probabilities, each row summing to 1; float32 for
        float16/bfloat16 inputs, else the query's dtype.
    """
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    query, key = query.to(dtype), key.to(dtype)
    length, source = query.size(-2), key.size(-2)
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    bias = torch.zeros(length, source, dtype=dtype, device=query.device)
    if is_causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=query.device).tril(diagonal=0)
        bias = bias.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            bias = attn_mask.to(dtype) + bias
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
    scores = query @ key.transpose(-2, -1) * factor  # (batch, heads, query, key)
    attends_nothing = torch.isneginf(bias).all(dim=-1, keepdim=True)  # (..., query, 1)
    return torch.softmax(scores + bias, dim=-1).masked_fill(attends_nothing, 0.0)


def attention(model: nn.Module, *args: Any, layers: str | Sequence[str], **kwargs: Any
              ) -> dict[str, Tensor]:
    """Run ``model(*args, **kwargs)`` once and return the attention probabilities of each module.

    ```python
    probs = hookscope.attention(model, **tokens, layers="encoder.layer.*")
    probs["encoder.layer.2"][:, 3]      # head 3 of layer 2: (batch, query, key)
    ```

    Each selected module must compute exactly one attention per call, in its own forward or in
    its children's: an attention module (``encoder.layer.2.attention.self``) or a whole block
    (``encoder.layer.2``). Attention is either a ``softmax`` over the last dim of a 4-D tensor
    (eager attention: its output is taken as is), ``F.scaled_dot_product_attention`` (the
    probabilities are recomputed, see ``sdpa_probabilities``), or ``nn.MultiheadAttention``'s
    ``F.multi_head_attention_forward`` called with ``need_weights=True,
    average_attn_weights=False`` (the per-head weights it returns). Only the selected modules' forward
    passes are intercepted; the model's output is unchanged. It runs in the model's current
    mode and is left as it was found (BatchNorm statistics, spectral norm, train/eval flags,
    ``requires_grad``, ``.grad``, the RNG state: ``engine.run.untouched``).

    Args:
        model: root module (wrappers looked through, as in ``capture``).
        *args, **kwargs: the forward arguments.
        layers: module patterns as in ``capture`` (paths, globs, ``re:``, ``type:``).

    Returns:
        ``{path: probabilities}`` in ``named_modules()`` order, each ``(batch, heads, query,
        key)`` (float32 for half-precision models), detached; a module that ran ``n > 1`` times
        gives ``path:0`` ... ``path:n-1``.

    Raises:
        SelectorError: a pattern matches no module.
        HookscopeError: the model or a module is TorchScript or torch.compile'd.
        AttentionError: a selected module never ran, or one of its calls computed no attention
            or more than one (the message names the module and the narrower pattern to use).
    """
    with untouched(model):
        found, _ = _watched(model, args, kwargs, layers, _probabilities)
    return {path: taken.detach() for path, taken in found.items()}


def attention_gradients(model: nn.Module, *args: Any, layers: str | Sequence[str],
                        score: Callable[[Any], Tensor], **kwargs: Any
                        ) -> dict[str, tuple[Tensor, Tensor]]:
    """Attention probabilities and their gradients ``d score / d A`` from one forward and one
    backward of ``model(*args, **kwargs)``.

    As ``attention`` (same ``layers``, same keys, the model left as found), with gradients on
    for the pass (under ``torch.no_grad()`` and ``inference_mode()`` too) and every floating
    parameter made to require grad for it (restored after: no ``.grad`` changes, the backward is
    ``torch.autograd.grad``). ``score(output)`` is the scalar to differentiate, e.g. a class's
    logit summed over the batch. An eager softmax's gradient is read directly; SDPA never
    materialises ``A``, so its gradient is ``dO @ V^T`` from the output's gradient ``dO`` and the
    values ``V`` (``O = A V``; exact without dropout: call ``model.eval()``).

    Returns:
        ``{path: (probabilities, gradients)}``, both ``(batch, heads, query, key)`` float32,
        detached; a probability that does not reach the score has zero gradient.

    Raises:
        SelectorError, HookscopeError: as ``attention``.
        AttentionError: as ``attention``; also for ``nn.MultiheadAttention``, whose returned
            weights are a copy the output is not computed from (no gradient reaches them); or
            the model's parameters are inference tensors.
    """
    with untouched(model), gradient_pass(model, AttentionError):
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.requires_grad_(True)
        found, output = _watched(model, args, kwargs, layers, _differentiable)
        wrt = {path: (taken.output if taken.value is not None else taken.probabilities)
               for path, taken in found.items()}
        grads = torch.autograd.grad(score(output), list(wrt.values()), allow_unused=True,
                                    materialize_grads=True)
    return {path: (taken.probabilities.detach().float(), taken.gradient(grad).float())
            for (path, taken), grad in zip(found.items(), grads)}


@dataclass
class _Differentiable:
    """An attention call's probabilities and what its gradient is read from: the probabilities
    themselves (eager), or the output and values of an SDPA call (``dA = dO @ V^T``)."""

    probabilities: Tensor
    output: Tensor
    value: Tensor | None = None

    def detach(self) -> Tensor:
        return self.probabilities.detach()

    def gradient(self, grad: Tensor) -> Tensor:
        if self.value is None:
            return grad.detach()
        value = self.value.detach()
        if value.size(-3) != grad.size(-3):  # grouped-query attention
            value = value.repeat_interleave(grad.size(-3) // value.size(-3), -3)
        return grad.detach().to(value.dtype) @ value.transpose(-2, -1)


def _differentiable(call: FunctionCall) -> _Differentiable | None:
    if call.name == MHA:
        raise AttentionError(
            "an nn.MultiheadAttention computes its attention inside F.multi_head_attention_forward"
            " and returns a copy of the weights that its output is not computed from, so no "
            "gradient reaches them: gradient-weighted rollout needs eager attention (a softmax) "
            "or F.scaled_dot_product_attention; use rollout(..., gradient=False) here")
    probabilities = _probabilities(call)
    if probabilities is None:
        return None
    if call.name == SDPA:
        return _Differentiable(probabilities, call.output, call.named_arguments()["value"])
    return _Differentiable(call.output, call.output)


def _watched(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             layers: str | Sequence[str], take: Callable[[FunctionCall], T | None]
             ) -> tuple[dict[str, T], Any]:
    """Run the model once with each selected module's attention calls watched; ``take`` maps a
    call to what is kept (``None``: not an attention). Returns ``{path: taken}`` and the output.
    The caller holds ``untouched(model)`` around it (and around any backward through the output:
    restoring a BatchNorm's buffers in place before it would fail autograd's version check)."""
    patterns = as_patterns(layers)
    refuse_uninterceptable(model, patterns[0])
    targets = resolve(model, patterns)
    session = Observer(model, targets, explain_unfired=False)  # installs and removes the watch
    found: dict[str, dict[int, list[T]]] = {}  # path -> module call -> what was taken
    watches: dict[str, Watch] = {}
    for target in targets:
        refuse_uninterceptable(target.module, target.path)
        found[target.path] = {}
        watches[target.path] = session.functions.watch(
            target.module, _collector(found[target.path], take), names=ATTENTION_FUNCTIONS | {SLICE},
            deep=True)
    with session:
        output = model(*args, **kwargs)
    result: dict[str, T] = {}
    for path, watch in watches.items():
        result.update(_per_call(path, [found[path].get(call, [])
                                       for call in range(watch.module_calls)]))
    return result, output


def _per_call(path: str, calls: list[list[T]]) -> dict[str, T]:
    """``{path: probabilities}`` for a module that ran once, ``{path:k: ...}`` for several."""
    if not calls:
        raise AttentionError(f"'{path}' never ran in this forward pass, so it has no attention "
                             f"probabilities: select modules that run ('hookscope tree MODEL "
                             f"--input X' shows which ran)")
    values = [_one(path, call, found) for call, found in enumerate(calls)]
    return {path: values[0]} if len(values) == 1 else {f"{path}:{k}": v for k, v in enumerate(values)}


def _collector(calls: dict[int, list[T]], take: Callable[[FunctionCall], T | None]
               ) -> Callable[[FunctionCall], None]:
    softmaxes: list[Any] = []  # the softmax outputs taken, to see them sliced

    def on_call(call: FunctionCall) -> None:
        if call.name == SLICE:
            if call.args and any(call.args[0] is kept for kept in softmaxes):
                raise AttentionError(
                    "the model slices the softmax's output before it weights the values (an "
                    "attention sink's extra column, as GPT-OSS computes it), so the softmax is "
                    "not the map over the keys: select the module with its SDPA attention "
                    "(model.set_attn_implementation('sdpa')) or read the sliced map yourself "
                    "with the function address '...::getitem'")
            return
        taken = take(call)
        if taken is not None:
            calls.setdefault(call.module_call, []).append(taken)
            if call.name == "softmax":
                softmaxes.append(call.output)
    return on_call


def _one(path: str, call: int, found: list[T]) -> T:
    if len(found) == 1:
        return found[0]
    if not found:
        raise AttentionError(
            f"call {call} of '{path}' computed no attention: neither "
            f"F.scaled_dot_product_attention nor a softmax over the last dim of a 4-D tensor ran "
            f"inside it. Select the attention modules themselves or the blocks that hold them "
            f"('hookscope tree MODEL --input X --ops' lists each module's function calls)")
    raise AttentionError(
        f"call {call} of '{path}' computed {len(found)} attentions, so which one to return is "
        f"ambiguous: select a module holding exactly one, e.g. '{path}.*' or '{path}.**' for "
        f"its submodules ('hookscope tree MODEL --input X --ops' shows where each one runs)")


def _probabilities(call: FunctionCall) -> Tensor | None:
    """The ``(batch, heads, query, key)`` probabilities of an attention call, or ``None`` when
    the call is not one (a softmax over another dim, or of a tensor that is not 4-D)."""
    named = call.named_arguments()
    with torch.no_grad():
        if call.name == SDPA:
            return sdpa_probabilities(named["query"].detach(), named["key"].detach(),
                                      _detached(named.get("attn_mask")),
                                      bool(named.get("is_causal", False)), named.get("scale"),
                                      bool(named.get("enable_gqa", False)))
        if call.name == MHA:
            return _mha_weights(call.output, named)
        output = call.output
        dim = named.get("dim")
        if isinstance(output, Tensor) and output.dim() == 4 and dim in (-1, 3):
            return output.detach()
    return None


def _mha_weights(output: Any, named: dict[str, Any]) -> Tensor:
    """The per-head weights ``F.multi_head_attention_forward`` returned, ``(batch, heads, query,
    key)``; it returns them only when asked (``need_weights=True, average_attn_weights=False``)."""
    weights = output[1] if isinstance(output, tuple) and len(output) == 2 else None
    if isinstance(weights, Tensor) and weights.dim() == 4:
        return weights.detach()
    raise AttentionError(
        f"an nn.MultiheadAttention computed its attention inside F.multi_head_attention_forward "
        f"and returned {'no weights' if weights is None else 'weights averaged over heads'} "
        f"(need_weights={named.get('need_weights')}, average_attn_weights="
        f"{named.get('average_attn_weights')}): call it with need_weights=True, "
        f"average_attn_weights=False to get the (batch, heads, query, key) probabilities")


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value
