"""What the model applies between its last block and its logits, read from its own computation.

The logit lens reads a residual stream as the last block's output would be read (an
encoder-decoder's: its decoder's last block, the list its ``decoder_hidden_states`` come from). The structural
rule (final norm, then unembedding) is what GPT-2 and Llama do; other models do more: Gemma 2
soft-caps its logits (``30 * tanh(x / 30)``, ``final_logit_softcapping``), Cohere multiplies them
by ``logit_scale``, Granite divides by ``logits_scaling``, OPT projects out of a narrower width
after its final norm, MiniCPM scales the stream before ``lm_head``. Once per model
(``engine.ground_truth``'s probe forward, kept), the readout is found from what ran:

1. the modules called after the last block finished, outermost first, in call order, each kept
   when its input is what the chain gave so far (or that times a scalar, which the readout then
   applies too: an inline scale) and its output keeps the token axis (not BERT's pooler, which
   reads the first token), until one gives the logits' shape;
2. after that module, what turns its output into the logits: nothing, the model's
   ``*softcap*`` config value (``c * tanh(x / c)``), a scalar (``logit_scale``,
   ``1 / logits_scaling``, read as the ratio of the two tensors), or a bias added per token
   (BART's ``final_logits_bias``, read as the difference, the same at every position);
3. the last block's output read through 1 and 2 must give the model's own log-probabilities
   within ``TOLERANCE`` nats; else the lens is refused (``CaptureError``) naming the largest
   difference, the modules read through and the config values that touch the logits.

A model with no probe (no Hugging Face config, no ``output_hidden_states``) or no ``logits`` is
read through the structural final norm and unembedding, unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hookscope.engine import (
    Probe,
    blocks_of,
    decoder_blocks,
    index,
    probe_of,
    resolve_standard,
    same_values,
)
from hookscope.errors import CaptureError, SelectorError

__all__ = ["Readout", "model_readout", "TOLERANCE"]

Tensor = torch.Tensor
TOLERANCE = 1e-4


@dataclass
class Readout:
    """``modules`` applied in order (each after multiplying by its ``scales`` entry), then
    ``post``: the residual stream ``(batch, seq, hidden)`` -> logits ``(batch, seq, vocab)``.
    ``checked`` says whether it was checked against the model's logits (else why not);
    ``width`` is the residual stream's width (``hidden``), when known."""

    modules: list[nn.Module]
    scales: list[float]
    post: Callable[[Tensor], Tensor] = field(default=lambda x: x)
    described: str = ""
    checked: str = ""
    width: int | None = None

    def __call__(self, residual: Tensor) -> Tensor:
        value = residual
        for module, scale in zip(self.modules, self.scales):
            value = module(value * scale if scale != 1.0 else value)
            value = value[0] if isinstance(value, tuple) else value
        return self.post(value)


def model_readout(model: nn.Module, structural: Callable[[], tuple[nn.Module, nn.Module]]) -> Readout:
    """The readout of ``model`` (module docstring), checked once per model; ``structural()``
    gives the structural final norm and unembedding, used when no check can run.

    Raises:
        CaptureError: the model's own log-probabilities differ from every readout tried; or, no
            check can run and ``structural()`` raises it (no final norm or unembedding found).
    """
    names = index(model)
    probe = probe_of(names)
    if not isinstance(probe, Probe) or not isinstance(getattr(probe.output, "logits", None), Tensor):
        return _structural(structural, probe if isinstance(probe, str) else "the model returned no logits")
    if "lens" not in probe.memo:
        probe.memo["lens"] = _find(model, probe)
    found = probe.memo["lens"]
    if found == "no last block that ran once":
        return _structural(structural, found)
    if isinstance(found, str):
        raise CaptureError(found)
    readout: Readout = found
    return readout


def _structural(find: Callable[[], tuple[nn.Module, nn.Module]], why: str) -> Readout:
    norm, unembed = find()
    weight = getattr(unembed, "weight", None)
    width = int(weight.shape[-1]) if isinstance(weight, Tensor) and weight.dim() == 2 else None
    return Readout([norm, unembed], [1.0, 1.0], described="final norm, then unembedding",
                   checked=f"unchecked: {why}", width=width)


def _last_block(model: nn.Module) -> str | None:
    """The last block's path: an encoder-decoder's decoder's (``decoder_blocks``: the list the
    model's own ``decoder_hidden_states`` come from), else ``resid_post.{L-1}``'s."""
    names = index(model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        found = decoder_blocks(names)
        return None if found is None else f"{found[0]}.{found[1] - 1}"
    try:
        structure = blocks_of(names, "resid_post.*")
        return resolve_standard(names, f"resid_post.{structure.count - 1}")[0][1]
    except SelectorError:
        return None


def _find(model: nn.Module, probe: Probe) -> Readout | str:
    names = index(model)
    logits = probe.output.logits.detach().float()
    last = _last_block(model)
    if last is None or probe.once(last) is None:
        return "no last block that ran once"  # the structural readout, unchecked
    end = next(e for path, _, e in probe.calls if path == last)
    after = [(path, begin, e) for path, begin, e in probe.calls if begin > end]
    outer = [(path, begin, e) for path, begin, e in after
             if not any(b < begin and e2 > e for _, b, e2 in after)]
    value = first = probe.once(last)
    assert value is not None and first is not None
    modules, scales, read = [], [], []
    for path, _, _ in sorted(outer, key=lambda item: item[1]):
        given = probe.inputs.get(path, [None])[0]
        scale = _scale(value, given)
        out = probe.once(path)
        if scale is None or out is None or out.shape[:-1] != value.shape[:-1]:
            continue  # not fed by the chain, or not per token (BERT's pooler reads one)
        modules.append(names.modules[path])
        scales.append(scale)
        read.append(path + (f" (input x {scale:.4g})" if scale != 1.0 else ""))
        value = probe.once(path)
        assert value is not None
        if value.shape == logits.shape:
            break
    described = ", ".join(read) or "nothing"
    if value.shape != logits.shape:
        return (f"the logit lens cannot reproduce {type(model).__name__}'s logits: after the last "
                f"block ('{last}') it found {described}, ending at {tuple(value.shape)}, not the "
                f"logits' {tuple(logits.shape)}; the model computes them outside its modules. "
                f"Capture the blocks ('{last.rsplit('.', 1)[0]}.*') and read them out yourself")
    target = torch.log_softmax(logits, dim=-1)
    raw = value.float()
    tried: list[tuple[str, Callable[[Tensor], Tensor]]] = [("", lambda x: x)]
    for cap in _softcaps(model):
        tried.append((f"then {cap:g} * tanh(x / {cap:g}) (softcap)", _softcap(cap)))
    ratio = _scale(raw, logits)
    if ratio is not None and ratio != 1.0:
        tried.append((f"then x {ratio:.6g} (the model's logit scale)", _times(ratio)))
    bias = _bias(raw, logits)
    if bias is not None:
        tried.append(("then + a bias per token (the model's final_logits_bias)", _plus(bias)))
    gaps = []
    for name, post in tried:
        gaps.append(float((torch.log_softmax(post(raw), dim=-1) - target).abs().max()))
        if gaps[-1] <= TOLERANCE:
            return Readout(modules, scales, post, described + (f", {name}" if name else ""),
                           checked="checked against the model's log-probabilities",
                           width=int(first.shape[-1]))
    worst = min(gaps)
    touching = _logit_settings(model)
    return (f"the logit lens's last layer would differ from {type(model).__name__}'s own "
            f"log-probabilities by {worst:.3g} nats: read through {described}"
            f"{' and ' + ', '.join(n for n, _ in tried[1:]) + ' tried' if len(tried) > 1 else ''}, "
            f"the model applies something more after its last block"
            f"{' (its config sets ' + touching + ')' if touching else ''}. Read the blocks "
            f"yourself (capture 'resid_post.*') with the model's own head code, or report the "
            f"architecture")


def _scale(x: Tensor, y: Tensor | None) -> float | None:
    """``a`` with ``y == a * x`` (equal shapes), else None."""
    if y is None or x.shape != y.shape or not y.is_floating_point():
        return None
    if same_values(x, y):
        return 1.0
    xf, yf = x.float().flatten(), y.float().flatten().to(x.device)
    norm = float(xf @ xf)
    if norm == 0.0:
        return None
    ratio = float(xf @ yf) / norm
    return ratio if same_values(xf * ratio, yf, tolerance=1e-4) else None


def _bias(x: Tensor, y: Tensor) -> Tensor | None:
    """``b`` ``(vocab,)`` with ``y == x + b`` at every position (BART's ``final_logits_bias``,
    added after ``lm_head``), when ``x`` and ``y`` have the same shape and at least two
    positions (one position fits any difference); else None."""
    if x.shape != y.shape or x.dim() < 2 or x[..., 0].numel() < 2:
        return None
    difference = (y.float().to(x.device) - x.float()).reshape(-1, x.shape[-1])
    bias = difference[0]
    return bias if same_values(difference, bias.expand_as(difference), tolerance=1e-4) else None


def _plus(bias: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda x: x + bias.to(x.device, x.dtype)


def _softcap(cap: float) -> Callable[[Tensor], Tensor]:
    return lambda x: cap * torch.tanh(x / cap)


def _times(ratio: float) -> Callable[[Tensor], Tensor]:
    return lambda x: x * ratio


def _configs(model: nn.Module) -> list[object]:
    config = getattr(model, "config", None)
    return [c for c in (config, getattr(config, "text_config", None)) if c is not None]


def _softcaps(model: nn.Module) -> list[float]:
    caps = []
    for config in _configs(model):
        for key, value in vars(config).items():
            if "softcap" in key and "attn" not in key and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and value > 0:
                caps.append(float(value))
    return list(dict.fromkeys(caps))


def _logit_settings(model: nn.Module) -> str:
    shown = [f"{key}={value!r}" for config in _configs(model) for key, value in vars(config).items()
             if ("logit" in key or "softcap" in key) and value not in (None, False)]
    return ", ".join(dict.fromkeys(shown))
