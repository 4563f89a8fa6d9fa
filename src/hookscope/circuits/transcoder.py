"""Transcoders: a sparse dictionary that reads a module's input and writes its output (Dunefsky
et al., 2024, "Transcoders find interpretable LLM feature circuits"; Ameisen et al., 2025,
"Circuit Tracing"), in place of an MLP; ``load_transcoder`` reads circuit-tracer's files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hookscope.circuits.dictionary import Activation, Dictionary
from hookscope.errors import CircuitError
from hookscope.util import write_atomic

__all__ = ["Transcoder", "load_transcoder"]

Tensor = torch.Tensor


class Transcoder(Dictionary):
    """A transcoder: ``encode`` the input of a module (an MLP's normalized residual stream,
    ``(..., d_in)``), ``decode`` into its output ``(..., d_out)``.

    ```python
    tc = hookscope.Transcoder(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec)
    with hookscope.splice(model, {"transformer.h.0.mlp": tc}):
        model(ids)          # the MLP's output is tc(its input)
    ```

    Args:
        W_enc: ``(d_in, d_features)``; ``b_enc``: ``(d_features,)``.
        W_dec: ``(d_features, d_out)``; ``b_dec``: ``(d_out,)``.
        activation: ``"relu"`` (default), ``"jumprelu"`` (give ``threshold``, ``(d_features,)``
            or a number) or ``"topk"`` (give ``k``).

    Raises:
        CircuitError: shapes that do not fit, or an activation without its parameter.
    """

    def __init__(self, *, W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor,  # noqa: N803
                 activation: Activation = "relu", threshold: Tensor | float | None = None,
                 k: int | None = None):
        super().__init__(W_enc, b_enc, W_dec, b_dec, activation=activation,
                         threshold=None if threshold is None else torch.as_tensor(threshold), k=k)

    reads = "input"

    def save_circuit_tracer(self, path: str | Path) -> None:
        """Write circuit-tracer's transcoder file (one ``.safetensors``: ``W_enc`` and ``W_dec``
        ``(d_features, d_model)``, ``b_enc``, ``b_dec``, ``activation_function.threshold`` for
        JumpReLU), which its ``load_relu_transcoder`` reads."""
        from safetensors.torch import save_file

        if self.activation == "topk":
            raise CircuitError("circuit-tracer's transcoder files hold ReLU or JumpReLU "
                               "transcoders, not TopK: save the weights with torch.save instead")
        tensors = {"W_enc": self.W_enc.detach().T.contiguous(), "W_dec": self.W_dec.detach().contiguous(),
                   "b_enc": self.b_enc.detach().contiguous(), "b_dec": self.b_dec.detach().contiguous()}
        if self.threshold is not None:
            tensors["activation_function.threshold"] = self.threshold.detach().contiguous()
        write_atomic(path, lambda tmp: save_file(tensors, tmp))  # never half a file


def load_transcoder(path: str | Path) -> Transcoder:
    """Read a transcoder from circuit-tracer's file format (``SingleLayerTranscoder.to_safetensors``,
    the per-layer files of its transcoder sets).

    Args:
        path: a ``.safetensors`` file with ``W_enc`` ``(d_features, d_model)`` (circuit-tracer
            keeps ``F.linear``'s layout: it is transposed here), ``W_dec`` ``(d_features,
            d_model)``, ``b_enc``, ``b_dec`` and, for JumpReLU, ``activation_function.threshold``.

    Returns:
        A ``Transcoder`` in the file's dtype, activation ReLU or JumpReLU.

    Raises:
        CircuitError: the file is missing, lacks one of the four weights, or holds a skip
            connection (``W_skip``), which ``Transcoder`` does not model.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CircuitError(f"no transcoder file at {path}: pass the path of a .safetensors file "
                           f"written by circuit-tracer (SingleLayerTranscoder.to_safetensors)")
    tensors = load_file(str(path))
    missing = [k for k in ("W_enc", "W_dec", "b_enc", "b_dec") if k not in tensors]
    if missing:
        raise CircuitError(f"{path} lacks {missing} (it holds {sorted(tensors)[:8]}): a "
                           f"circuit-tracer transcoder file has W_enc, W_dec, b_enc and b_dec")
    if "W_skip" in tensors:
        raise CircuitError(f"{path} holds a skip connection (W_skip), which hookscope's "
                           f"Transcoder does not model: use a transcoder without one")
    threshold = tensors.get("activation_function.threshold")
    return Transcoder(W_enc=tensors["W_enc"].T, b_enc=tensors["b_enc"], W_dec=tensors["W_dec"],
                      b_dec=tensors["b_dec"], activation="relu" if threshold is None else "jumprelu",
                      threshold=threshold)
