"""Direct logit attribution: the final residual stream split into what each part of the model
wrote to it, each part read out alone through the final norm (scale frozen) and the unembedding.

In a transformer whose blocks add their branches to the residual stream, the last block's output
is ``resid_pre.0 + sum_l (attn_out.l + mlp_out.l)``, and ``resid_pre.0`` is the token embedding
plus a learned position embedding where the model has one. An attention output is its heads'
results plus the output projection's bias: ``attn_out.l = sum_h J_l z_h + b_O`` (``z_h`` head
``h``'s slice of ``attn.z.l``, ``J_l`` the linear output projection). With the final norm's
scale frozen at the run's own values (``frozen_readout``), the readout is affine, so the logit
difference ``logit[a] - logit[b]`` is exactly

    embed . v + pos_embed . v + sum_{l,h} (J_l z_h) . v + sum_l mlp_out.l . v + bias

with ``v = P (w * (W_U[a] - W_U[b])) / s`` per position and ``bias`` = the output projections'
biases read out, plus the final norm's bias and the unembedding's bias read out. This is
TransformerLens's ``get_full_resid_decomposition`` with ``apply_ln_to_stack`` dotted with the
logit-difference direction (``residual_stack_to_logit_diff``); see Elhage et al., "A
Mathematical Framework for Transformer Circuits" (2021) and Wang et al., "Interpretability in the
Wild" (2022, arXiv:2211.00593), section 3.1. A head's term is ``z_h . (J_l^T v)_h``: one
vector-Jacobian product per block through the output projection alone.

Nothing is assumed unchecked: the embeddings must sum to ``resid_pre.0``, the branches to the last
block's output, the final norm must be one ``frozen_readout`` knows, the model's logits must be
the unembedding's output, and the components must sum to the model's own logit difference; each
check that fails refuses with what it measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.editing.attribution import _once
from hookscope.editing.edges import Found, _plus_zero
from hookscope.editing.edits import edit
from hookscope.editing.frozen_readout import FrozenNorm, close, freeze_norm, unembedding
from hookscope.editing.sweep import _forward, _plain
from hookscope.engine import (
    ModuleIndex,
    blocks_of,
    check_model,
    check_tensor,
    index,
    one_index_per_call,
    resolve_standard,
    untouched,
    warn_if_dropout_trains,
)
from hookscope.errors import ArgumentTypeError, ArgumentValueError, EditError, SelectorError
from hookscope.record import capture, gradient_pass

__all__ = ["LogitAttribution", "direct_logit_attribution"]

Tensor = torch.Tensor
# a learned position embedding outside the blocks: GPT-2, a HookedTransformer, OPT, BERT-likes
POSITIONS = ("wpe", "pos_embed", "embed_positions", "position_embeddings")
# config fields that change the logits after the unembedding (Gemma 2/3, Granite, Cohere, …),
# with their neutral value
AFTER_UNEMBED = (("final_logit_softcapping", None), ("logits_scaling", 1.0), ("logit_scale", 1.0),
                 ("output_multiplier", 1.0))


@dataclass(frozen=True)
class LogitAttribution:
    """``direct_logit_attribution``'s result.

    Attributes:
        components: ``["embed", "pos_embed", "a0.h0", …, "m0", "a1.h0", …, "bias"]``
            (``pos_embed`` only where the model has a learned position embedding).
        values: ``(components, batch, seq)`` float64: each component's share of ``target``;
            summed over components it is ``target`` (to float tolerance).
        target: ``(batch, seq)`` float64, what the model computed: ``logit[a] - logit[b]``
            (``tokens=``), or the final norm's output dotted with ``direction``.
        norm: the final norm's form (``"LayerNorm"``, ``"RMSNorm"``, …).
    """

    components: list[str]
    values: Tensor
    target: Tensor
    norm: str

    def __getitem__(self, component: str) -> Tensor:
        """``(batch, seq)`` float64: one component's values.

        Raises:
            KeyError: no such component; the message lists them.
        """
        if component not in self.components:
            raise KeyError(f"{component!r} is not a component; they are {self.components}")
        return self.values[self.components.index(component)]

    def table(self, k: int = 10, *, row: int = 0, position: int = -1) -> str:
        """The ``k`` components of largest ``|value|`` at batch ``row`` and ``position``
        (``-1``: the last), as aligned text, with the target on the first line."""
        column = self.values[:, row, position]
        order = column.abs().argsort(descending=True)[:k].tolist()
        lines = [f"{'target':10} {float(self.target[row, position]):>10.4f}"]
        lines += [f"{self.components[i]:10} {float(column[i]):>10.4f}" for i in order]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Names:
    """Where the model keeps what the decomposition reads."""

    layers: int
    positions: str | None   # the position embedding's module path
    final_norm: str
    unembed: str
    modules: dict[str, nn.Module]  # the index's path -> module (wrappers seen through)


@one_index_per_call
def direct_logit_attribution(model: nn.Module, inputs: Any, *,
                             tokens: tuple[Any, Any] | None = None,
                             direction: Tensor | None = None) -> LogitAttribution:
    """Split the logit difference (or a readout direction) into the embeddings, every head,
    every MLP and the biases, through the final norm with its scale frozen (module docstring).

    ```python
    dla = hookscope.direct_logit_attribution(gpt2, ids, tokens=(5, 7))
    dla.values.sum(0)          # == dla.target: the model's logit[5] - logit[7], every position
    dla["a1.h2"][:, -1]        # head 2 of block 1, last position, each row
    ```

    One forward with gradients on (the heads' terms are one vector-Jacobian product per block);
    the model is left as it was found (``engine.run.untouched``) and no ``.grad`` changes. Call
    ``model.eval()`` first.

    Args:
        model: a transformer language model whose standard names ``embed``, ``resid_pre.0``,
            ``attn_out.{l}``, ``mlp_out.{l}``, ``attn.z.{l}``, ``resid_post.{l}``, ``final_norm``
            and ``unembed`` resolve, whose blocks add their attention and MLP outputs to the
            residual stream (sequential or parallel: GPT-2, GPT-NeoX, Llama, Mistral, Qwen2,
            Gemma, Phi, a TransformerLens ``HookedTransformer``). Not a model with a norm after
            each branch (Gemma 2, OLMo 2): refused by the check on the residual stream.
        inputs: the model's input (token ids ``(batch, seq)``, a dict, a tuple).
        tokens: ``(a, b)``: decompose ``logit[a] - logit[b]``; each an int, or a ``(batch,)``
            int tensor (a pair per row).
        direction: instead of ``tokens``, a ``(d_model,)`` or ``(batch, d_model)`` float tensor
            read after the final norm, as the unembedding reads it (TransformerLens's
            ``logit_diff_directions``): decompose ``final_norm(x) . direction``.

    Returns:
        A ``LogitAttribution``: ``components``, ``values`` ``(components, batch, seq)`` float64,
        ``target`` ``(batch, seq)`` float64, ``table()``.

    Raises:
        ArgumentTypeError, ArgumentValueError: neither or both of ``tokens`` and ``direction``;
            a token not an int (or int tensor) in the vocabulary; a direction of another shape.
        SelectorError: a standard name does not resolve; with ``tokens``, the model's config
            changes the logits after the unembedding (a softcap or a scale: the field is named).
        EditError: a check failed (module docstring; the message gives the difference); a head
            output or attention output runs more than once per forward.
    """
    check_model(model)
    _check_choice(tokens, direction)
    warn_if_dropout_trains(model, "direct_logit_attribution")
    names = _names(index(model))
    if tokens is not None:
        _refuse_after_unembed(model)
    inputs = _plain(inputs)
    _check_before(names, inputs, tokens, direction)
    with untouched(model):
        found = _attribute(model, names, inputs, tokens, direction)
    return found


def _check_choice(tokens: object, direction: object) -> None:
    if (tokens is None) == (direction is None):
        raise ArgumentTypeError("direct_logit_attribution decomposes one readout: pass tokens=(a, b) "
                                "for logit[a] - logit[b], or direction=vector (d_model,) read after "
                                "the final norm, not " + ("both" if tokens is not None else "neither"))
    if direction is not None:
        check_tensor("direction", direction, "model.lm_head.weight[5] - model.lm_head.weight[7]")
    if tokens is not None and (not isinstance(tokens, tuple) or len(tokens) != 2):
        raise ArgumentTypeError(f"tokens must be a pair (a, b) of token ids (ints or (batch,) int "
                                f"tensors), decomposing logit[a] - logit[b]; got {type(tokens).__name__}"
                                f"{'' if not isinstance(tokens, tuple) else f' of {len(tokens)}'}")


def _check_before(names: _Names, inputs: Any, tokens: tuple[Any, Any] | None,
                  direction: Tensor | None) -> None:
    """``tokens`` and ``direction`` checked before any forward where the unembedding's shape
    (``nn.Linear``, a ``W_U``) and the batch (a tensor, a dict's ``input_ids``, a tuple's first
    tensor) are known; else they are checked after it."""
    unembed = names.modules[names.unembed]
    weight = getattr(unembed, "W_U", None)
    shape = ((unembed.in_features, unembed.out_features) if isinstance(unembed, nn.Linear) else
             tuple(weight.shape) if isinstance(weight, Tensor) and weight.dim() == 2 else None)
    first = inputs.get("input_ids") if isinstance(inputs, dict) else \
        inputs[0] if isinstance(inputs, tuple) and inputs else inputs
    if shape is None or not isinstance(first, Tensor) or first.dim() == 0:
        return
    for name, token in zip("ab", tokens or (), strict=False):
        _token(name, token, first.shape[0], shape[1])
    if direction is not None:
        _direction(direction, first.shape[0], shape[0])


def _names(names: ModuleIndex) -> _Names:
    structure = blocks_of(names, "direct_logit_attribution")
    ((_, final, _, _),) = resolve_standard(names, "final_norm")
    ((_, unembed, _, _),) = resolve_standard(names, "unembed")
    inside = structure.blocks + "."
    found = [path for path in names.modules if path.rsplit(".", 1)[-1] in POSITIONS
             and not path.startswith(inside)]
    return _Names(structure.count, min(found, key=lambda p: p.count(".")) if found else None,
                  final, unembed, dict(names.modules))


def _refuse_after_unembed(model: nn.Module) -> None:
    """Refuse, by the config field's name, a model whose logits are changed after the
    unembedding: they are then not affine in the residual stream."""
    config = getattr(model, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        for field, neutral in AFTER_UNEMBED:
            value = getattr(holder, field, neutral) if holder is not None else neutral
            if value is not None and value != neutral:
                raise SelectorError(
                    f"{type(model).__name__}'s config has {field}={value!r}: its logits are the "
                    f"unembedding's output changed afterwards (a softcap or a scale), not an affine "
                    f"function of the residual stream, so no split into components sums to them. "
                    f"Decompose the readout before it: direction=model.lm_head.weight[a] - "
                    f"model.lm_head.weight[b] (the logit difference before the {field})")


def _attribute(model: nn.Module, names: _Names, inputs: Any, tokens: tuple[Any, Any] | None,
               direction: Tensor | None) -> LogitAttribution:
    """The forward (a zero added to each ``attn.z.{l}`` and ``attn_out.{l}``, so the heads'
    terms are vector-Jacobian products through the output projection), the checks and the
    components."""
    layers = names.layers
    z: list[Found] = [[] for _ in range(layers)]
    attn: list[Found] = [[] for _ in range(layers)]
    edits = {**{f"attn.z.{i}": _plus_zero(z[i]) for i in range(layers)},
             **{f"attn_out.{i}": _plus_zero(attn[i]) for i in range(layers)}}
    keys = ["embed", *([names.positions] if names.positions else []), "resid_pre.0",
            *(f"{kind}.{i}" for kind in ("attn.z", "attn_out", "mlp_out") for i in range(layers)),
            f"resid_post.{layers - 1}", "final_norm", *(["unembed"] if tokens is not None else [])]
    with gradient_pass(model, EditError):
        recording = capture(model, *keys, to="cpu", on_unfired="error")  # checks read on the CPU
        with edit(model, edits, on_unfired="error"), recording as acts:
            output = _forward(model, inputs)
        values = {key: acts[key] for key in keys}
        _check_stream(values, names)
        norm = freeze_norm(names.modules[names.final_norm], names.final_norm,
                           values[f"resid_post.{layers - 1}"], values["final_norm"])
        read, constant, target = _readout(names, values, output, norm, tokens, direction)
        v = norm.pull_back(read)  # (batch, seq, d_model)
        heads = [_head_terms(z[i], attn[i], v, acts.layout(f"attn.z.{i}"), i) for i in range(layers)]
    return _assemble(values, names, v, heads, norm, constant, target)


def _check_stream(values: dict[str, Tensor], names: _Names) -> None:
    """The embeddings sum to ``resid_pre.0``, and ``resid_pre.0`` plus every branch to the last
    block's output (``_check_sum``)."""
    layers = names.layers
    pos = values.get(names.positions) if names.positions else None
    _check_sum("embed" + (f" + '{names.positions}'" if pos is not None else ""),
               [values["embed"], *([pos] if pos is not None else [])], values["resid_pre.0"],
               "resid_pre.0 (the input of the first block)",
               "the block input holds more than the token and position embeddings")
    branches = [values[f"{kind}.{i}"] for kind in ("attn_out", "mlp_out") for i in range(layers)]
    _check_sum("resid_pre.0 + every attn_out and mlp_out", [values["resid_pre.0"], *branches],
               values[f"resid_post.{layers - 1}"], f"resid_post.{layers - 1} (the last block's output)",
               "the blocks add more than their attention and MLP outputs (a norm after each branch, "
               "as in Gemma 2 or OLMo 2)")


def _readout(names: _Names, values: dict[str, Tensor], output: Any,
             norm: FrozenNorm, tokens: tuple[Any, Any] | None,
             direction: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(direction read after the norm (batch, d_model), constant (batch, 1), target (batch,
    seq))`` float64: with ``tokens``, ``W_U[a] - W_U[b]``, the norm's and the unembedding's
    biases read out, and the model's own logit difference (checked to be the unembedding's)."""
    final = values["final_norm"]
    batch, width = final.shape[0], final.shape[-1]
    if direction is not None:
        read = _direction(direction, batch, width)
        return read, norm.constant(read), (final.double() * read[:, None, :]).sum(-1)
    assert tokens is not None
    logits = _logits(output, values["unembed"])
    a, b = (_token(name, t, batch, logits.shape[-1]) for name, t in zip("ab", tokens, strict=True))
    read, unembed_constant = unembedding(names.modules[names.unembed], width, final, a, b)
    rows = torch.arange(batch)
    target = (logits[rows, :, a] - logits[rows, :, b]).double()
    return read, norm.constant(read) + unembed_constant, target


def _logits(output: Any, unembedded: Tensor) -> Tensor:
    """The model's logits ``(batch, seq, vocab)`` on the CPU (``.logits``, the output itself,
    or its first element), checked to equal the unembedding's output.

    Raises:
        EditError: they differ (something runs after the unembedding).
    """
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    elif logits is None:
        logits = output
    if not isinstance(logits, Tensor) or logits.shape != unembedded.shape:
        raise EditError(f"the model's output holds no logits of the unembedding's shape "
                        f"{tuple(unembedded.shape)} (.logits, the output, or its first element); "
                        f"direct logit attribution needs a model returning its logits")
    logits = logits.detach().cpu()
    ok, difference = close(unembedded, logits, logits.dtype)
    if not ok:
        raise EditError(f"the model's logits differ from its unembedding's output by {difference:.3g}: "
                        f"something runs after the unembedding (a softcap, a scale), so the logits "
                        f"are not affine in the residual stream; decompose the readout before it with "
                        f"direction=W_U[a] - W_U[b]")
    return logits


def _token(name: str, token: Any, batch: int, vocab: int) -> Tensor:
    """Token ``a`` or ``b`` as ``(batch,)`` int64 on the CPU.

    Raises:
        ArgumentTypeError: not an int or an integer tensor.
        ArgumentValueError: outside ``[0, vocab)``, or a tensor not of ``(batch,)``.
    """
    if isinstance(token, int) and not isinstance(token, bool):
        ids = torch.full((batch,), token, dtype=torch.int64)
    elif isinstance(token, Tensor) and not token.is_floating_point() and token.dtype != torch.bool:
        ids = token.detach().cpu().to(torch.int64).reshape(-1)
        if token.dim() > 1 or (token.dim() == 1 and len(ids) != batch):
            raise ArgumentValueError(f"tokens[{'ab'.index(name)}] has shape {tuple(token.shape)}; "
                                     f"give an int or a ({batch},) tensor, one token per row")
        ids = ids.expand(batch) if token.dim() == 0 else ids
    else:
        raise ArgumentTypeError(f"tokens[{'ab'.index(name)}] must be a token id (an int or a "
                                f"(batch,) int tensor); got {type(token).__name__}")
    if bool((ids < 0).any()) or bool((ids >= vocab).any()):
        raise ArgumentValueError(f"tokens[{'ab'.index(name)}] holds {ids.tolist()}, outside the "
                                 f"vocabulary 0 … {vocab - 1}: give ids the model's logits have")
    return ids


def _direction(direction: Tensor, batch: int, width: int) -> Tensor:
    """``direction`` as ``(batch, d_model)`` float64 on the CPU.

    Raises:
        ArgumentValueError: not ``(d_model,)`` or ``(batch, d_model)``, or not floating.
    """
    if not direction.is_floating_point() or direction.shape not in ((width,), (batch, width)):
        raise ArgumentValueError(f"direction has shape {tuple(direction.shape)} ({direction.dtype}); "
                                 f"give a float vector ({width},) or ({batch}, {width}), read after "
                                 f"the final norm, e.g. model.lm_head.weight[5] - model.lm_head.weight[7]")
    return direction.detach().double().cpu().expand(batch, width)


def _head_terms(z: Found, attn: Found, v: Tensor, layout: Any, layer: int) -> Tensor:
    """``(heads, batch, seq)`` float64: ``z_h . (J^T v)_h`` of each head of block ``layer``:
    ``J^T v`` is the gradient of ``attn_out . v`` with respect to ``attn.z`` (one
    vector-Jacobian product through the output projection)."""
    z_value, z_zero = _once(z, f"attn.z.{layer}")
    out = _once(attn, f"attn_out.{layer}")[0]
    pulled = torch.autograd.grad(out, z_zero, grad_outputs=v.to(device=out.device, dtype=out.dtype),
                                 retain_graph=True)[0]
    product = z_value.detach().double() * pulled.double()
    order = [layout.heads, layout.batch, layout.seq]
    rest = [axis for axis in range(product.dim()) if axis not in order]
    return product.permute(*order, *rest).flatten(3).sum(-1).cpu()


def _assemble(values: dict[str, Tensor], names: _Names, v: Tensor, heads: list[Tensor],
              norm: FrozenNorm, constant: Tensor, target: Tensor) -> LogitAttribution:
    """The components in order, the bias as the attention outputs' remainders after their
    heads plus ``constant``, and the check that they sum to ``target``."""
    def read(x: Tensor) -> Tensor:  # (batch, seq) float64
        return (x.double().expand_as(v) * v).sum(-1)

    components, rows = ["embed"], [read(values["embed"])]
    if names.positions is not None:
        components.append("pos_embed")
        rows.append(read(values[names.positions]))
    bias = constant.expand_as(target).clone()
    for layer, terms in enumerate(heads):
        components += [f"a{layer}.h{h}" for h in range(len(terms))] + [f"m{layer}"]
        rows += [*terms, read(values[f"mlp_out.{layer}"])]
        bias += read(values[f"attn_out.{layer}"]) - terms.sum(0)
    components.append("bias")
    rows.append(bias)
    stacked = torch.stack(rows)  # (components, batch, seq)
    _check_sum("the components", [stacked.sum(0)], target, "the readout the model computed",
               "the decomposition does not hold for this model", values["final_norm"].dtype)
    return LogitAttribution(components, stacked, target, norm.form)


def _check_sum(what: str, parts: Sequence[Tensor], expected: Tensor, against: str, cause: str,
               dtype: torch.dtype | None = None) -> None:
    """Refuse unless ``parts`` sum to ``expected`` (``frozen_readout.close``, at the tolerance
    of ``dtype``, the model's; default ``expected``'s).

    Raises:
        EditError: naming the sum, the reference, the largest difference and the likely cause.
    """
    total = parts[0].double()
    for part in parts[1:]:
        total = total + part.double()
    ok, difference = close(total.expand_as(expected.double()), expected, dtype or expected.dtype)
    if not ok:
        raise EditError(f"direct logit attribution checks that {what} sums to {against}; it differs "
                        f"by {difference:.3g}: {cause}, so the split would not add up. It reads "
                        f"models whose blocks add attention and MLP outputs to the residual stream "
                        f"and whose logits are the unembedding of the final norm")
