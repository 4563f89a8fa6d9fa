"""The zoo's cells for attention maps, activation patching, steering and edge attribution
patching, each checked against the model's own values or the same edit written with plain torch
hooks (``register_forward_hook`` / ``torch.autograd.grad``), never against hookscope itself.

The module a cell edits is the one ``resid_post.0`` resolves to (the names cell checks that it is
the model's own ``hidden_states[1]``); where hookscope refuses that name, the cell is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hookscope
from tests.zoo.cells import TOLERANCE, NotApplicable, _first, _same

STREAM = "resid_post.0"


def _corrupted(feed: dict[str, Any]) -> dict[str, Any]:
    """``feed`` with other token ids (or pixels) of the same shape; the rest as it was."""
    generator = torch.Generator().manual_seed(7)
    other = dict(feed)
    if "input_ids" in feed:
        ids = feed["input_ids"]
        low = int(ids.min())
        other["input_ids"] = torch.randint(low, int(ids.max()) + 1, ids.shape, generator=generator)
    else:
        other["pixel_values"] = torch.randn(feed["pixel_values"].shape, generator=generator)
    return other


def _output(model: nn.Module, feed: dict[str, Any]) -> torch.Tensor:
    """The first tensor of the model's output (its logits, else its last hidden state)."""
    with torch.no_grad():
        found = _first(model(**feed))
    if found is None:
        raise NotApplicable("the model returns no tensor")
    return found


def _stream(model: nn.Module) -> nn.Module:
    """The module of ``resid_post.0`` (a HookscopeError where hookscope refuses the name)."""
    (target,) = hookscope.engine.resolve(model, [STREAM])
    assert target.op is None and not target.parts, target  # a block's output, by structure
    return target.module


def _runs(model: nn.Module, feed: dict[str, Any]) -> None:
    try:
        _output(model, feed)
        _output(model, _corrupted(feed))
    except NotApplicable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise NotApplicable(f"the model's own forward raised {type(exc).__name__}") from exc


def _attention(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
    # the model's own maps: output_attentions of the same weights with eager attention (SDPA
    # returns none); hookscope reads the model as it is (recomputed from SDPA's arguments)
    eager = copy.deepcopy(model)
    try:
        if getattr(model.config, "_attn_implementation", None) not in (None, "eager"):
            eager.set_attn_implementation("eager")  # type: ignore[operator]
        with torch.no_grad():
            output = eager(**feed, output_attentions=True, return_dict=True)
    except Exception as exc:  # noqa: BLE001
        raise NotApplicable(f"output_attentions=True with eager attention raised "
                            f"{type(exc).__name__}") from exc
    # the stack of the first block: an encoder-decoder's encoder_attentions or decoder_attentions
    (block,) = hookscope.select(model, STREAM)
    stack = next((f"{side}_attentions" for side in ("encoder", "decoder")
                  if f"{side}." in f"{block}." or block.startswith(side)), "attentions")
    maps = getattr(output, stack, None) or getattr(output, "attentions", None)
    if not isinstance(maps, (tuple, list)) or not maps or not isinstance(maps[0], torch.Tensor):
        raise NotApplicable(f"the model returns no tensor {stack} (output_attentions)")
    own = maps[0].float()
    if float(own.min()) < 0.0 or float(own.max()) > 1.0:  # scores, not probabilities:
        own = torch.softmax(own, dim=-1)  # ProphetNet returns them, before its softmax
    probabilities = hookscope.attention(model, **feed, layers=STREAM)
    if len(probabilities) != 1:
        return False
    (value,) = probabilities.values()
    return _same(value, own)


def _patch(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
    _runs(model, feed)
    module, corrupted = _stream(model), _corrupted(feed)
    clean: list[Any] = []
    # copies as the module returned them (RWKV's blocks write the state they return in place later)
    handle = module.register_forward_hook(lambda m, a, out: clean.append(_cloned(out)))
    try:
        _output(model, feed)
    finally:
        handle.remove()
    calls = iter(clean)
    handle = module.register_forward_hook(lambda m, a, out: next(calls))
    try:
        want = _output(model, corrupted)
    finally:
        handle.remove()
    with hookscope.capture(model, STREAM) as source, torch.no_grad():
        model(**feed)
    with hookscope.patch(model, source=source, layers=STREAM):
        got = _output(model, corrupted)
    return _same(got, want)


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(item) for item in value)
    return value


def _steer(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
    _runs(model, feed)
    module = _stream(model)
    seen: list[Any] = []
    handle = module.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        _output(model, feed)
    finally:
        handle.remove()
    value = _first(seen[0]) if seen else None
    if value is None or not value.is_floating_point():
        raise NotApplicable(f"{STREAM} gives no float tensor")
    vector = torch.randn(value.shape[-1], generator=torch.Generator().manual_seed(3))

    def add(m: nn.Module, a: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out + vector
        return (out[0] + vector, *out[1:])
    if not isinstance(seen[0], (torch.Tensor, tuple)):
        raise NotApplicable(f"{STREAM} returns {type(seen[0]).__name__}")
    handle = module.register_forward_hook(add)
    try:
        want = _output(model, feed)
    finally:
        handle.remove()
    name = STREAM if isinstance(seen[0], torch.Tensor) else STREAM + "[0]"
    with hookscope.steer(model, {name: vector}):
        got = _output(model, feed)
    return _same(got, want)


def _metric(output: Any) -> torch.Tensor:
    logits = output.logits
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


def _eap(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
    if kind != "causal" or "input_ids" not in feed:
        raise NotApplicable("edge attribution patching scores a causal LM's logits here")
    _runs(model, feed)
    clean, corrupted = feed, _corrupted(feed)
    edges = hookscope.edge_attribution_patching(model, clean, corrupted, _metric)
    names = hookscope.engine.index(model)
    structure = hookscope.engine.blocks_of(names, "eap")
    _, mlp_norm = hookscope.engine.branch_norms(names, 0, structure)
    ((_, final, _, _),) = hookscope.engine.resolve_standard(names, "final_norm")
    ((_, mlp, mlp_parts, _),) = hookscope.engine.resolve_standard(names, "mlp_out.0")
    if mlp_parts:
        raise NotApplicable("mlp_out.0 is a part of its module's output")
    modules = dict(model.named_modules())
    # the changes: the model's own hidden_states[0] and the MLP's output, clean minus corrupted
    deltas = []
    for getter in (_embedded, _module_output(modules[mlp])):
        deltas.append(getter(model, clean).double() - getter(model, corrupted).double())
    # the gradients at the inputs of the final norm and block 0's MLP norm, corrupted run
    grads = _input_gradients(model, corrupted, [modules[final], modules[mlp_norm]])
    want = {("input", "logits"): deltas[0] * grads[0], ("m0", "logits"): deltas[1] * grads[0],
            ("input", "m0"): deltas[0] * grads[1]}
    for (up, down), product in want.items():
        got = float(edges.scores[edges.upstream.index(up), edges.downstream.index(down)])
        expected = float(product.sum())
        if abs(got - expected) > TOLERANCE * max(1.0, abs(expected)):
            return False
    return True


def _embedded(model: nn.Module, feed: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        states = model(**feed, output_hidden_states=True, return_dict=True).hidden_states
    return _first(states[0])  # type: ignore[return-value]


def _module_output(module: nn.Module) -> Callable[[nn.Module, dict[str, Any]], torch.Tensor]:
    def get(model: nn.Module, feed: dict[str, Any]) -> torch.Tensor:
        seen: list[Any] = []
        handle = module.register_forward_hook(lambda m, a, out: seen.append(_first(out)))
        try:
            _output(model, feed)
        finally:
            handle.remove()
        return seen[0]
    return get


def _input_gradients(model: nn.Module, feed: dict[str, Any],
                     modules: list[nn.Module]) -> list[torch.Tensor]:
    entered: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Callable[..., Any]:
        # a copy that only this module reads: its gradient is the branch's alone, not the
        # residual stream's (which also flows on past a pre-norm block's norm)
        def hook(m: nn.Module, args: Any, kwargs: Any) -> Any:
            if i in entered or not args:
                raise NotApplicable("a norm called more than once, or with keywords only")
            entered[i] = args[0].clone()
            return (entered[i], *args[1:]), kwargs
        return hook
    handles = [m.register_forward_pre_hook(keep(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        value = _metric(model(**feed))
    finally:
        for handle in handles:
            handle.remove()
    found = torch.autograd.grad(value, [entered[i] for i in range(len(modules))])
    return [g.double() for g in found]


EDIT_CHECKS: dict[str, Callable[[nn.Module, str, dict[str, Any]], bool]] = {
    "attention": _attention, "patch": _patch, "steer": _steer, "eap": _eap,
}
