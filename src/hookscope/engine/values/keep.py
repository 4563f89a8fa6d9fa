"""Private: turn a tensor a hook sees into one that can be kept after the call.

The helpers below are what rows of the kinds table (``engine.values.kinds.KINDS``, read by every verb)
call; capture's hot path uses ``special``/``keepable`` directly. These tensors are not kept as
they are:

- **quantized** tensors (``torch.quint8``/``qint8``/``qint32`` outputs of eager-mode quantized
  or fused modules, e.g. ``ConvReLU2d`` after ``torch.ao.quantization.convert``): most tensor
  code (``isfinite``, ``.numpy()``, in-place writes, safetensors) does not run on them. hookscope
  keeps ``t.dequantize()`` (float32, ``scale * (int_repr - zero_point)``) and remembers the dtype,
  so capture, save, stats and diff see real numbers.
- tensors wrapped by a **functorch transform** (``torch.func.vmap``'s batched tensors,
  ``torch.func.grad``/``jacrev``/``vjp``'s grad-tracking tensors): they are only valid inside
  the transform; kept past it they are dead wrappers. hookscope refuses them while the model
  runs, before any value is returned, naming the transform and the fix.
- **DTensors** (outputs of tensor-parallel modules with ``use_local_output=False``): they mix
  with no plain tensor (compare, steering vectors) and safetensors cannot write them. hookscope
  keeps the *global* tensor (``full_tensor()``, a plain tensor on every rank) and notes the
  placements; an edit is computed on the global tensor and put back on the output's mesh and
  placements (``restore_like``).
- **inference tensors** (made under ``torch.inference_mode()``) are kept as they are, at no cost;
  read outside inference mode they are turned into normal tensors (``outside_inference``: a
  copy-on-write clone, so nothing is copied until someone writes), which autograd and in-place
  ops accept (a probe can be trained on them).
- **meta tensors and FakeTensors** (a model on ``torch.device("meta")``, ``FakeTensorMode``,
  ``torch.export`` tracing) hold shapes but no values: every verb that needs values refuses them
  with one message (``check_has_values``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from hookscope.errors import CaptureError, HookscopeError
from hookscope.util import iter_tensors, map_tensors

__all__ = ["keepable", "special", "kept_note", "check_not_transformed", "quantized_note",
           "requantize_like", "plain", "restore_like", "outside_inference", "is_dtensor",
           "holds_no_values", "check_has_values", "no_values_reason", "NO_VALUES_FIX"]

Tensor = torch.Tensor
_functorch = torch._C._functorch
_is_transformed = _functorch.is_functorch_wrapped_tensor
_lazy_clone = torch._lazy_clone


def is_dtensor(t: Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (none exists until that module is loaded,
    so this imports nothing)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def special(t: Tensor) -> bool:
    """A tensor not kept as it is: quantized, a DTensor, or wrapped by a functorch transform.
    (While dynamo traces a hook there is no transform, and the C check would break the graph.)"""
    if t.is_quantized or (type(t) is not Tensor and is_dtensor(t)):
        return True
    return not torch.compiler.is_dynamo_compiling() and bool(_is_transformed(t))


def keepable(t: Tensor, where: str) -> Tensor:
    """``t`` as a plain tensor (see ``plain``); ``where`` names the module.

    Raises:
        CaptureError: ``t`` is a functorch-transformed tensor (see ``check_not_transformed``).
    """
    check_not_transformed(t, where)
    return plain(t)


def plain(t: Tensor) -> Tensor:
    """``t``'s values as a plain tensor: ``t.dequantize()`` for a quantized tensor (float32),
    ``t.full_tensor()`` for a DTensor (its global shape; differentiable; a collective on every
    rank of its mesh), else ``t`` itself."""
    if t.is_quantized:
        return t.dequantize()
    if type(t) is not Tensor and is_dtensor(t):
        full: Tensor = t.full_tensor()  # type: ignore[attr-defined]
        return full
    return t


def restore_like(new: Tensor, old: Tensor) -> Tensor:
    """``new``, computed on ``plain(old)``, in ``old``'s form: quantized with ``old``'s
    parameters, or a DTensor on ``old``'s mesh and placements (differentiably: replicated from
    ``new``, which every rank computed alike, then redistributed); else ``new`` itself."""
    if old.is_quantized:
        return requantize_like(new, old)
    if type(old) is not Tensor and is_dtensor(old):
        from torch.distributed.tensor import DTensor, Replicate
        mesh, placements = old.device_mesh, old.placements  # type: ignore[attr-defined]
        replicated = DTensor.from_local(new, mesh, [Replicate()] * mesh.ndim, run_check=False)
        restored: Tensor = replicated.redistribute(mesh, placements)
        return restored
    return new


def kept_note(t: Tensor) -> str | None:
    """How ``keepable`` keeps ``t`` when not as it is (for ``Records.notes``), else None."""
    if t.is_quantized:
        return quantized_note(t)
    if type(t) is not Tensor and is_dtensor(t):
        placements = ", ".join(map(repr, t.placements))  # type: ignore[attr-defined]
        devices = t.device_mesh.size()  # type: ignore[attr-defined]
        local = tuple(t.to_local().shape)  # type: ignore[attr-defined]
        return (f"DTensor ({placements} on a mesh of {devices} device(s), local shape {local}), "
                f"kept as its global tensor {tuple(t.shape)} (full_tensor())")
    return None


def outside_inference(value: Any) -> Any:
    """``value`` with each inference tensor replaced, outside ``torch.inference_mode()``, by a
    normal tensor sharing its memory copy-on-write (nothing is copied until a write), so autograd
    (``probe(x).sum().backward()``) and in-place ops accept it; ``value`` itself when it holds
    none or inference mode is on. Callers keep the result: the conversion is made once."""
    if torch.is_inference_mode_enabled() or not any(t.is_inference() for t in iter_tensors(value)):
        return value
    return map_tensors(_normal, value)


def _normal(t: Tensor) -> Tensor:
    if not t.is_inference():
        return t
    try:
        return _lazy_clone(t)
    except (NotImplementedError, RuntimeError):  # sparse, nested: no copy-on-write storage
        return t.clone()


def holds_no_values(t: Tensor) -> bool:
    """True for a meta tensor or a FakeTensor: a shape and dtype without data."""
    if type(t) is Tensor:  # not a subclass, so no FakeTensor
        return bool(t.is_meta)
    return bool(t.is_meta or is_fake(t))


NO_VALUES_FIX = ("run the model on a real device with real tensors, outside FakeTensorMode and "
                 "torch.export/torch.compile tracing (for a model built on the meta device: "
                 "model.to_empty(device='cpu'), then load its weights)")


def no_values_reason(t: Tensor) -> str:
    """``"a FakeTensor (...)"`` or ``"a meta tensor (...)"``: why ``t`` has no data."""
    if is_fake(t):
        return ("a FakeTensor (the model ran under FakeTensorMode or was traced by torch.export "
                "or torch.compile: only shapes and dtypes exist)")
    return "a meta tensor (the model is on torch.device('meta'): only shapes and dtypes exist)"


def check_has_values(t: Tensor, where: str, doing: str,
                     error: type[HookscopeError] = HookscopeError) -> None:
    """Raise ``error`` when ``t`` (what ``where`` returned) holds no values to ``doing``.

    Raises:
        HookscopeError (or ``error``): ``t`` is a meta tensor or a FakeTensor; the message names
            ``where``, the kind and the fix.
    """
    if holds_no_values(t):
        raise error(f"'{where}' returned {no_values_reason(t)}, which holds no values to "
                    f"{doing}; {NO_VALUES_FIX}")


def check_not_transformed(t: torch.Tensor, where: str) -> None:
    """Raise when ``t`` lives inside a ``torch.func`` transform.

    Raises:
        CaptureError: naming the transform (vmap, or grad/jacrev/vjp) and what to do instead.
    """
    if torch.compiler.is_dynamo_compiling() or not _functorch.is_functorch_wrapped_tensor(t):
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


def requantize_like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` (float) quantized with ``old``'s dtype, scheme, scale(s) and zero point(s), so an
    edit computed on dequantized values can be returned to a quantized model."""
    new = new.to(torch.float32)
    if old.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return torch.quantize_per_tensor(new, old.q_scale(), old.q_zero_point(), old.dtype)
    return torch.quantize_per_channel(new, old.q_per_channel_scales(), old.q_per_channel_zero_points(),
                                      old.q_per_channel_axis(), old.dtype)
