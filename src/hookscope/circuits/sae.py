"""Sparse autoencoders: a sparse dictionary that reads and writes the same activation (a module's
output, the residual stream); ``load_sae`` reads SAELens's saved folder.

SAELens's folder (``SAE.save_model``, the format of its pretrained releases): ``cfg.json``
(``d_in``, ``d_sae``, ``architecture`` ``"standard"`` | ``"jumprelu"`` | ``"topk"``,
``apply_b_dec_to_input``, ``normalize_activations``, ``k`` for TopK, ``hook_name`` at the top
or under ``meta``) and ``sae_weights.safetensors`` (``W_enc`` ``(d_in, d_sae)``, ``b_enc``,
``W_dec`` ``(d_sae, d_in)``, ``b_dec``, and ``threshold`` for JumpReLU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hookscope.circuits.dictionary import Activation, Dictionary
from hookscope.errors import CircuitError

__all__ = ["SAE", "load_sae"]

Tensor = torch.Tensor
_ARCHITECTURES: dict[str, Activation] = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}


class SAE(Dictionary):
    """A sparse autoencoder ``(..., d_in) -> (..., d_features) -> (..., d_in)``.

    ``encode(x) = act((x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc)``, SAELens's
    ``encode``; ``decode(f) = f @ W_dec + b_dec``. ``hook_name`` is the point it was trained on,
    as SAELens named it (kept for reference; ``splice`` takes the module path).

    Raises:
        CircuitError: shapes that do not fit, ``d_out != d_in``, or an activation without its
            parameter.
    """

    reads = "output"

    def __init__(self, *, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor,  # noqa: N803
                 activation: Activation = "relu", threshold: Tensor | float | None = None,
                 k: int | None = None, apply_b_dec_to_input: bool = True,
                 hook_name: str | None = None):
        super().__init__(W_enc, b_enc, W_dec, b_dec, activation=activation,
                         threshold=None if threshold is None else torch.as_tensor(threshold), k=k)
        if self.d_out != self.d_in:
            raise CircuitError(f"an SAE writes what it reads, but W_enc reads {self.d_in} and W_dec "
                               f"writes {self.d_out}: use Transcoder for different spaces")
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.hook_name = hook_name

    def pre_activations(self, x: Tensor) -> Tensor:
        x = x.to(self.W_enc.dtype)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc


def load_sae(folder: str | Path) -> SAE:
    """Read an SAE that SAELens saved (``cfg.json`` and ``sae_weights.safetensors`` in ``folder``).

    Args:
        folder: the folder ``SAE.save_model(path)`` wrote (or one of SAELens's releases, downloaded).

    Returns:
        An ``SAE`` in the weights' dtype; ``sae.hook_name`` is the config's ``hook_name``.

    Raises:
        CircuitError: a file is missing, the architecture is not ``standard``, ``jumprelu`` or
            ``topk``, activations are normalized at run time (``normalize_activations`` other
            than ``"none"``: fold the factor into the weights first, SAELens's
            ``fold_activation_norm_scaling_factor``), or the weights do not fit the config.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path, weights_path = folder / "cfg.json", folder / "sae_weights.safetensors"
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise CircuitError(f"{folder} has no {path.name}: an SAELens folder holds cfg.json and "
                               f"sae_weights.safetensors (SAE.save_model writes both)")
    cfg: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8"))
    architecture = str(cfg.get("architecture", "standard"))
    if architecture not in _ARCHITECTURES:
        raise CircuitError(f"{cfg_path}: architecture {architecture!r:.40} is not one hookscope "
                           f"reads ({', '.join(_ARCHITECTURES)})")
    if cfg.get("normalize_activations", "none") not in ("none", None):
        raise CircuitError(f"{cfg_path}: normalize_activations={cfg['normalize_activations']!r:.40} "
                           f"rescales inputs at run time; fold it into the weights first (SAELens's "
                           f"fold_activation_norm_scaling_factor) and save again")
    weights = load_file(str(weights_path))
    if not {"W_enc", "b_enc", "W_dec", "b_dec"} <= set(weights):
        raise CircuitError(f"{weights_path} holds {sorted(weights)[:8]}, not SAELens's W_enc, "
                           f"b_enc, W_dec, b_dec")
    d_sae = int(cfg.get("d_sae", weights["W_enc"].shape[1]))
    if tuple(weights["W_enc"].shape) != (int(cfg.get("d_in", -1)), d_sae):
        raise CircuitError(f"{weights_path}: W_enc is {tuple(weights['W_enc'].shape)}, but cfg.json "
                           f"says d_in={cfg.get('d_in')}, d_sae={cfg.get('d_sae')}")
    activation = _ARCHITECTURES[architecture]
    meta: dict[str, Any] = cfg["meta"] if isinstance(cfg.get("meta"), dict) else {}
    return SAE(W_enc=weights["W_enc"], b_enc=weights["b_enc"], W_dec=weights["W_dec"],
               b_dec=weights["b_dec"], activation=activation,
               threshold=weights.get("threshold") if activation == "jumprelu" else None,
               k=int(cfg["k"]) if activation == "topk" else None,
               apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
               hook_name=cfg.get("hook_name") or meta.get("hook_name"))
