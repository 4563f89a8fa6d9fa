"""Private: turn a tensor a hook sees into one that can be kept after the call.

Two kinds of tensor cannot be kept as they are:

- **quantized** tensors (``torch.quint8``/``qint8``/``qint32`` outputs of eager-mode quantized
  or fused modules, e.g. ``ConvReLU2d`` after ``torch.ao.quantization.convert``): most tensor
  code (``isfinite``, ``.numpy()``, in-place writes, safetensors) does not run on them. hookscope
  keeps ``t.dequantize()`` (float32, ``scale * (int_repr - zero_point)``) and remembers the dtype,
  so capture, save, stats and diff see real numbers.
- tensors wrapped by a **functorch transform** (``torch.func.vmap``'s batched tensors,
  ``torch.func.grad``/``jacrev``/``vjp``'s grad-tracking tensors): they are only valid inside
  the transform; kept past it they are dead wrappers. hookscope refuses them while the model
  runs, before any value is returned, naming the transform and the fix.
"""

from __future__ import annotations

import torch

from hookscope.errors import CaptureError

__all__ = ["keepable", "check_not_transformed", "quantized_note", "requantize_like", "dequantized"]

_functorch = torch._C._functorch


def keepable(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` as a plain tensor: dequantized if quantized; ``where`` names the module.

    Raises:
        CaptureError: ``t`` is a functorch-transformed tensor (see ``check_not_transformed``).
    """
    check_not_transformed(t, where)
    return t.dequantize() if t.is_quantized else t


def check_not_transformed(t: torch.Tensor, where: str) -> None:
    """Raise when ``t`` lives inside a ``torch.func`` transform.

    Raises:
        CaptureError: naming the transform (vmap, or grad/jacrev/vjp) and what to do instead.
    """
    if torch.compiler.is_compiling() or not _functorch.is_functorch_wrapped_tensor(t):
        return  # (dynamo traces hooks: a transform never wraps what it compiles here)
    if _functorch.is_batchedtensor(t):
        transform = "torch.func.vmap"
        fix = ("call the model on the whole batch without vmap inside the capture (a vmapped "
               "model computes the same batch), or capture outside the vmapped function")
    else:
        transform = "a torch.func gradient transform (grad, jacrev, jacfwd, vjp, jvp)"
        fix = ("run a plain forward (and loss.backward() with grads=True for gradients) inside "
               "the capture, or capture outside the transformed function")
    raise CaptureError(
        f"'{where}' ran inside {transform}: its output is a transform-internal tensor that is "
        f"only valid inside the transform, so hookscope will not keep it (it would be a dead "
        f"wrapper afterwards). Fix: {fix}")


def quantized_note(t: torch.Tensor) -> str:
    """``"torch.quint8 (scale 0.0123, zero point 0), kept dequantized as float32"``."""
    if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        detail = f"scale {t.q_scale():.6g}, zero point {t.q_zero_point()}"
    else:
        detail = f"per-channel scales along dim {t.q_per_channel_axis()}"
    return f"{t.dtype} ({detail}), kept dequantized as torch.float32"


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """``t.dequantize()`` for a quantized tensor, ``t`` itself otherwise."""
    return t.dequantize() if t.is_quantized else t


def requantize_like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` (float) quantized with ``old``'s dtype, scheme, scale(s) and zero point(s), so an
    edit computed on dequantized values can be returned to a quantized model."""
    new = new.to(torch.float32)
    if old.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return torch.quantize_per_tensor(new, old.q_scale(), old.q_zero_point(), old.dtype)
    return torch.quantize_per_channel(new, old.q_per_channel_scales(), old.q_per_channel_zero_points(),
                                      old.q_per_channel_axis(), old.dtype)
