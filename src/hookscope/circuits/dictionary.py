"""A sparse dictionary: ``encode`` a vector into non-negative feature activations, ``decode``
them back; the part that sparse autoencoders (``sae.SAE``) and transcoders
(``transcoder.Transcoder``) share.

Shapes and conventions are SAELens's and circuit-tracer's: ``W_enc`` ``(d_in, d_features)``,
``b_enc`` ``(d_features,)``, ``W_dec`` ``(d_features, d_out)``, ``b_dec`` ``(d_out,)``;
pre-activations ``x @ W_enc + b_enc``; the activation is ReLU, JumpReLU (``relu(pre) * (pre >
threshold)``, Rajamanoharan et al., 2024) or TopK (the ``k`` largest pre-activations of each
vector, then ReLU; Gao et al., 2024).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from hookscope.errors import CircuitError

__all__ = ["Activation", "Dictionary"]

Tensor = torch.Tensor
Activation = Literal["relu", "jumprelu", "topk"]


class Dictionary(nn.Module):
    """Weights ``W_enc``, ``b_enc``, ``W_dec``, ``b_dec`` (``nn.Parameter``, trainable) and an
    activation; ``encode``, ``decode`` and ``forward`` (decode of encode).

    Raises:
        CircuitError: shapes that do not fit (``W_enc`` ``(d_in, d_features)`` and ``W_dec``
            ``(d_features, d_out)``), a ``threshold`` without ``"jumprelu"``, ``k`` without
            ``"topk"``, or an unknown activation.
    """

    def __init__(self, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor, *,  # noqa: N803
                 activation: Activation = "relu", threshold: Tensor | None = None,
                 k: int | None = None):
        super().__init__()
        _check_shapes(type(self).__name__, W_enc, b_enc, W_dec, b_dec)
        if activation not in ("relu", "jumprelu", "topk"):
            raise CircuitError(f"activation={activation!r:.40} is not one of 'relu', 'jumprelu', "
                               f"'topk'")
        if (threshold is not None) != (activation == "jumprelu"):
            raise CircuitError("a threshold goes with activation='jumprelu' and only with it: pass "
                               "both or neither")
        if (k is not None) != (activation == "topk"):
            raise CircuitError("k goes with activation='topk' and only with it: pass both or neither")
        self.W_enc = nn.Parameter(W_enc.detach().clone())
        self.b_enc = nn.Parameter(b_enc.detach().clone())
        self.W_dec = nn.Parameter(W_dec.detach().clone())
        self.b_dec = nn.Parameter(b_dec.detach().clone())
        self.activation: Activation = activation
        self.k = k
        self.threshold: Tensor | None
        self.register_buffer("threshold", None if threshold is None else
                             threshold.detach().clone().to(W_enc.dtype).expand(W_enc.shape[1]).clone())

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_features(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        return int(self.W_dec.shape[1])

    def pre_activations(self, x: Tensor) -> Tensor:
        """``(..., d_in)`` -> ``(..., d_features)``: ``x @ W_enc + b_enc`` (in ``W_enc``'s dtype)."""
        return x.to(self.W_enc.dtype) @ self.W_enc + self.b_enc

    def activate(self, pre: Tensor) -> Tensor:
        """The activation of pre-activations ``pre`` ``(..., d_features)``."""
        if self.activation == "jumprelu":
            assert self.threshold is not None
            return torch.relu(pre) * (pre > self.threshold)
        if self.activation == "topk":
            assert self.k is not None
            top = pre.topk(self.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
        return torch.relu(pre)

    def encode(self, x: Tensor) -> Tensor:
        """Feature activations ``(..., d_features)`` of ``x`` ``(..., d_in)``, all >= 0."""
        return self.activate(self.pre_activations(x))

    def decode(self, features: Tensor) -> Tensor:
        """``(..., d_features)`` -> ``(..., d_out)``: ``features @ W_dec + b_dec``."""
        return features @ self.W_dec + self.b_dec

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction ``decode(encode(x))``, ``(..., d_out)``."""
        return self.decode(self.encode(x))

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_features={self.d_features}, d_out={self.d_out}, {self.activation}"


def _check_shapes(kind: str, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor) -> None:  # noqa: N803
    for name, value in (("W_enc", W_enc), ("b_enc", b_enc), ("W_dec", W_dec), ("b_dec", b_dec)):
        if not isinstance(value, Tensor):
            raise CircuitError(f"{kind}({name}=...) takes a tensor, not {type(value).__name__}")
    if W_enc.dim() != 2 or W_dec.dim() != 2 or b_enc.dim() != 1 or b_dec.dim() != 1:
        raise CircuitError(f"{kind} takes W_enc (d_in, d_features), b_enc (d_features,), W_dec "
                           f"(d_features, d_out), b_dec (d_out,); got {tuple(W_enc.shape)}, "
                           f"{tuple(b_enc.shape)}, {tuple(W_dec.shape)}, {tuple(b_dec.shape)}")
    d_in, d_features = W_enc.shape
    if b_enc.shape[0] != d_features or W_dec.shape[0] != d_features or b_dec.shape[0] != W_dec.shape[1]:
        hint = (" (W_dec looks transposed: pass W_dec.T)" if W_dec.shape[1] == d_features else "")
        raise CircuitError(f"{kind}: W_enc {tuple(W_enc.shape)} has {d_features} features, but b_enc "
                           f"{tuple(b_enc.shape)}, W_dec {tuple(W_dec.shape)} and b_dec "
                           f"{tuple(b_dec.shape)} do not fit it{hint}: W_dec is (d_features, d_out)")
