"""The local replacement model's forward: one forward of the model, through ``edit``, in which
the backward is linear in the residual stream, as circuit-tracer's (Ameisen et al., 2025):

- every attention pattern (a 4-d ``softmax`` inside a module's forward) is detached;
- every norm (``nn.LayerNorm``, ``nn.RMSNorm`` and modules named ``*RMSNorm``) keeps its output
  but differentiates as ``(x - mean x) / sigma * weight`` (RMS: ``x / rms * weight``) with its
  scale ``sigma`` frozen at the forward's value;
- each transcoded MLP's output is replaced by a leaf tensor of the same value, so no gradient
  crosses an MLP, and the gradient at the leaf is the gradient at the residual stream it writes;
- the token embedding's output is a leaf too (the token nodes);
- the inputs of each transcoded MLP and of the unembedding are kept with their graph (where
  feature and logit targets inject their gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookscope.circuits.splicing import module_input
from hookscope.editing import edit
from hookscope.errors import CircuitError

__all__ = ["Linearized", "linearize", "norm_paths"]

Tensor = torch.Tensor


@dataclass
class Linearized:
    """What the frozen forward left: ``mlp_inputs[l]`` ``(1, seq, d)`` (in the graph),
    ``mlp_outputs[l]`` the MLP's real output, ``mlp_leaves[l]`` the leaf that stands for it,
    ``embed`` the token embedding leaf ``(1, seq, d)``, ``final`` the unembedding's input
    ``(1, seq, d)`` (in the graph), ``logits`` ``(seq, vocab)`` detached."""

    mlp_inputs: list[Tensor] = field(default_factory=list)
    mlp_outputs: list[Tensor] = field(default_factory=list)
    mlp_leaves: list[Tensor] = field(default_factory=list)
    embed: Tensor | None = None
    final: Tensor | None = None
    logits: Tensor | None = None
    softmaxes: int = 0


def norm_paths(model: nn.Module) -> list[str]:
    """Paths of the norms whose scale is frozen: ``nn.LayerNorm``, ``nn.RMSNorm`` and any module
    whose class name ends in ``RMSNorm`` (Llama's, Qwen's, Mistral's)."""
    return [path for path, m in model.named_modules()
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("RMSNorm")]


def _frozen_norm(module: nn.Module, path: str, x: Tensor, y: Tensor) -> Tensor:
    """``y`` in value; in gradient, the norm with its scale frozen at this forward's."""
    eps = next((float(e) for e in (getattr(module, "eps", None), getattr(module, "variance_epsilon", None))
                if e is not None), 1e-6)  # a real eps=0 stays 0
    weight = getattr(module, "weight", None)
    xf = x.float()
    if isinstance(module, nn.LayerNorm):
        centered = xf - xf.mean(-1, keepdim=True)
        scale = (centered.pow(2).mean(-1, keepdim=True) + eps).sqrt().detach()
        linear = centered / scale
    else:
        scale = (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt().detach()
        linear = xf / scale
    if weight is not None:
        linear = linear * weight.float()
    bias = getattr(module, "bias", None)
    check = linear.detach() + (bias.float() if isinstance(bias, Tensor) else 0.0)
    tolerance = 1e-3 * (1 + float(y.detach().abs().max()))
    if not torch.allclose(check, y.detach().float(), rtol=1e-3, atol=tolerance):
        raise CircuitError(f"{path!r} ({type(module).__name__}) does not compute (x - mean) / sigma "
                           f"* weight + bias or x / rms * weight (max difference "
                           f"{float((check - y.detach().float()).abs().max()):.3g}), so its scale cannot be "
                           f"frozen: attribution graphs read LayerNorm and RMSNorm models")
    linear = linear.to(y.dtype)
    return y.detach() + (linear - linear.detach())


def linearize(model: nn.Module, input_ids: Tensor, mlp_paths: Sequence[str], embed_path: str,
              unembed_path: str) -> Linearized:
    """Run the frozen forward on ``input_ids`` ``(1, seq)``; see the module docstring. ``model``
    is the model's ``view.frozen_view`` (eval mode, eager attention), or a model already so."""
    out = Linearized()
    norms = norm_paths(model)
    modules = dict(model.named_modules())
    stashed: dict[str, list[Tensor]] = {p: [] for p in [*norms, *mlp_paths, unembed_path]}

    def stash(path: str) -> Any:
        def keep(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            stashed[path].append(module_input(args, kwargs, path))
        return keep

    def norm(path: str) -> Any:
        return lambda y: _frozen_norm(modules[path], path, stashed[path].pop(), y)

    def mlp(path: str) -> Any:
        def cut(y: Tensor) -> Tensor:
            if not isinstance(y, Tensor):
                raise CircuitError(f"{path!r} returned {type(y).__name__}, not a tensor: a transcoder "
                                   f"replaces a module that returns one (a dense MLP; routers that "
                                   f"return tuples are not read)")
            out.mlp_inputs.append(stashed[path].pop())
            out.mlp_outputs.append(y.detach())
            leaf = y.detach().clone().requires_grad_(True)
            out.mlp_leaves.append(leaf)
            return leaf
        return cut

    def embed(y: Tensor) -> Tensor:
        out.embed = y.detach().clone().requires_grad_(True)
        return out.embed

    def unembed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        out.final = module_input(args, kwargs, unembed_path)

    def pattern(p: Tensor) -> Tensor:
        if p.dim() == 4:
            out.softmaxes += 1
            return p.detach()
        return p

    inputs_edits = {p: stash(p) for p in [*norms, *mlp_paths]}
    inputs_edits[unembed_path] = unembed
    outputs_edits: dict[str, Any] = {p: norm(p) for p in norms}
    outputs_edits.update({p: mlp(p) for p in mlp_paths})
    outputs_edits[embed_path] = embed
    outputs_edits["**::softmax"] = pattern
    with torch.enable_grad(), \
            edit(model, inputs_edits, inputs=True, on_unfired="ignore"), \
            edit(model, outputs_edits, on_unfired="ignore"):
        result = model(input_ids)
    if out.softmaxes == 0:
        raise CircuitError("no attention pattern was seen (no 4-d softmax ran inside a module's "
                           "forward): load the model with attn_implementation='eager' so the "
                           "pattern can be frozen")
    if len(out.mlp_inputs) != len(mlp_paths) or out.final is None or out.embed is None:
        raise CircuitError(f"the frozen forward saw {len(out.mlp_inputs)} of {len(mlp_paths)} "
                           f"transcoded MLPs, the embedding {out.embed is not None} and the "
                           f"unembedding {out.final is not None}: each must run once per forward")
    logits = result.logits if hasattr(result, "logits") else result
    out.logits = logits.detach()[0]
    return out
