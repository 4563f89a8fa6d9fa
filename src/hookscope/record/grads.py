"""Gradients at module outputs and inputs, recorded with tensor hooks (never module backward hooks).

``capture(..., grads=True)`` and ``grad_inputs=True`` use this module. Why tensor hooks:

- ``register_full_backward_hook`` wraps a module's outputs in a custom autograd Function that
  returns views; an in-place op right after the module (``ReLU(inplace=True)``) then makes the
  *forward* pass fail (pytorch/pytorch#61519). A tensor hook registered on the output from a forward
  hook changes nothing in the forward and, registered before an in-place write, receives
  d(loss)/d(output) as the module returned it.
- The legacy ``register_backward_hook`` reports the gradients of the module's last autograd node,
  and once used it leaves ``module._is_full_backward_hook = False`` behind, which blocks full
  hooks (case 22). Tensor hooks do not look at that flag at all.
- Full backward hooks on a first layer fire with ``grad_input == (None,)`` and a UserWarning on
  every batch (case 11). Here an input that does not require grad is marked ``NoGrad(reason)``,
  silently and once per call, never a bare ``None``.

d(loss)/d(input) is the gradient through the module only (what a full backward hook reports as
``grad_input``), also when the same tensor feeds other modules too (a residual ``x + f(x)``): a
forward pre-hook hands the module an alias (``t.view_as(t)``: same values, same memory) of each
input that requires grad, and a tensor hook on the alias receives only what flows back through
the module.

Several backward passes through one forward (``backward(retain_graph=True)`` then another
``backward``, several losses from one output, ``torch.autograd.grad`` on a part of the output then
``backward`` on the rest) **accumulate**, as ``.grad`` does: each tensor's recorded gradient is the
sum of what every pass delivered to it, in the capture's dtype. A part of the output that no pass
reached stays a ``NoGrad``. Each tensor hook returns ``None``, so it never changes the gradient
that flows on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from hookscope.engine import on_tensor_grad
from hookscope.errors import CaptureError, HookscopeError
from hookscope.util import iter_tensors, map_tensors

__all__ = ["NoGrad", "GradRecord", "converter", "watch_output", "watch_inputs", "why_no_grad",
           "require_grad_mode", "gradient_pass", "grad_leaf", "NO_GRADIENT_YET"]

Tensor = torch.Tensor
Convert = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class NoGrad:
    """Stands where a gradient cannot be, with the reason; falsy, so ``if g:`` skips it.

    Attributes:
        reason: why there is no gradient, e.g. ``"it does not require grad: ..."``.
    """

    reason: str

    def __bool__(self) -> bool:
        return False


class GradRecord:
    """Gradients of the tensors of one call (an output, or ``(args, kwargs)``), by position.

    Keeps a skeleton of the structure (``meta`` tensors: shapes, no memory, no autograd graph),
    so recording gradients never keeps a forward pass's graph alive. Gradients of several
    backward passes through the call are summed, as ``.grad`` accumulates (module docstring);
    ``passes`` counts, per position, the passes that reached it.
    """

    __slots__ = ("skeleton", "reasons", "grads", "passes")

    def __init__(self, value: Any):
        self.skeleton = map_tensors(_meta, value)
        self.reasons: dict[int, str] = {}  # position -> why that tensor cannot get a gradient
        self.grads: dict[int, Tensor] = {}  # position -> sum of the gradients of every backward pass
        self.passes: dict[int, int] = {}  # position -> how many backward passes reached it

    @property
    def watched(self) -> int:
        """How many tensors of the call require grad (and so are watched)."""
        return sum(1 for _ in iter_tensors(self.skeleton)) - len(self.reasons)

    def value(self) -> Any:
        """The structure with each tensor replaced by its gradient or a ``NoGrad``."""
        positions = iter(range(1 << 62))

        def fill(_: Tensor) -> Tensor | NoGrad:
            i = next(positions)
            if i in self.grads:
                return self.grads[i]
            return NoGrad(self.reasons.get(i, NO_GRADIENT_YET))
        return map_tensors(fill, self.skeleton)

    def first_reason(self) -> str:
        """The reason of the first tensor that cannot get a gradient (or that got none yet)."""
        return next(iter(self.reasons.values()), NO_GRADIENT_YET)

    def _hook(self, position: int, convert: Convert) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:  # returning None: the gradient flows on unchanged
            arrived = convert(grad.detach())
            earlier = self.grads.get(position)
            self.grads[position] = arrived if earlier is None else earlier + arrived
            self.passes[position] = self.passes.get(position, 0) + 1
        return hook


NO_GRADIENT_YET = ("no gradient has reached it: call loss.backward() (or torch.autograd.grad) "
                   "on a loss computed from the model's output, inside or after the capture "
                   "block; if you did, the loss does not depend on this tensor")


def watch_output(output: Any, convert: Convert) -> GradRecord:
    """Record d(loss)/d(t) for every tensor ``t`` of a module's output, as it was returned.

    Args:
        output: what the module returned (any structure); called from a forward hook.
        convert: applied to each gradient when it arrives (device/dtype of the capture).

    Returns:
        The ``GradRecord`` that backward fills in.
    """
    record = GradRecord(output)
    positions = iter(range(1 << 62))

    def watch(t: Tensor) -> Tensor:
        i = next(positions)
        if t.requires_grad:
            on_tensor_grad(t, record._hook(i, convert))
        else:
            record.reasons[i] = why_no_grad(t)
        return t
    map_tensors(watch, output)
    return record


def watch_inputs(records: list[list[GradRecord]], convert: Convert) -> Callable[..., Any]:
    """Return a forward pre-hook (``with_kwargs=True``) recording d(loss)/d(input) per call.

    Each input tensor that requires grad is handed to the module as an alias with a tensor hook,
    see the module docstring; the hook appends one ``GradRecord`` of ``(args, kwargs)`` to each
    list in ``records`` (one list per record key of the module).
    """
    def hook(module: torch.nn.Module, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        record = GradRecord((args, kwargs))
        for calls in records:
            calls.append(record)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in iter_tensors((args, kwargs)))):
            record.reasons.update(enumerate(why_no_grad(t) for t in iter_tensors((args, kwargs))))
            return None
        positions = iter(range(1 << 62))

        def alias(t: Tensor) -> Tensor:
            i = next(positions)
            if not t.requires_grad:
                record.reasons[i] = why_no_grad(t)
                return t
            view = t.view_as(t)
            on_tensor_grad(view, record._hook(i, convert))
            return view
        new_args, new_kwargs = map_tensors(alias, (args, kwargs))
        return new_args, new_kwargs
    return hook


def converter(to: torch.device | str | None, dtype: torch.dtype | None) -> Convert:
    """Return the function applied to each gradient as it arrives: a move to ``to`` and a cast
    to ``dtype`` (the capture's options), or nothing when both are ``None``."""
    if to is None and dtype is None:
        return lambda grad: grad
    return lambda grad: grad.to(device=to, dtype=dtype)


def why_no_grad(t: Tensor) -> str:
    """Say why ``t`` does not require grad, and what to do if its gradient is wanted."""
    if not (t.is_floating_point() or t.is_complex()):
        return (f"it does not require grad: it is a {t.dtype} tensor, and only floating "
                f"tensors have gradients")
    if not torch.is_grad_enabled():
        return ("it does not require grad: the forward pass ran with gradients disabled "
                "(torch.no_grad() or torch.inference_mode()); run it with gradients enabled")
    return ("it does not require grad: nothing it is computed from does (input data, frozen "
            "parameters), so no gradient is computed for it. For the input of the first layer "
            "call x.requires_grad_() before the forward pass to get d(loss)/d(x)")


def require_grad_mode(option: str) -> None:
    """Refuse to open a capture recording gradients (``option``: ``"grads=True"``) where its
    forward could build no autograd graph, so no gradient could ever arrive.

    Raises:
        CaptureError: under ``torch.inference_mode()`` (which ``torch.enable_grad()`` cannot
            lift) or with gradients disabled (``torch.no_grad()``); the message gives the fix.
    """
    if torch.is_inference_mode_enabled():
        raise CaptureError(
            f"capture(..., {option}) was entered under torch.inference_mode(): nothing inside "
            f"builds an autograd graph, and torch.enable_grad() cannot lift inference mode "
            f"(a Lightning test/predict step runs under it), so no gradient could be recorded. "
            f"Open the block outside inference mode (Lightning: Trainer(inference_mode=False)), "
            f"or inside `with torch.inference_mode(False), torch.enable_grad():` with inputs "
            f"made outside inference mode")
    if not torch.is_grad_enabled():
        raise CaptureError(
            f"capture(..., {option}) was entered with gradients disabled (torch.no_grad()): "
            f"the forward inside builds no autograd graph, so no gradient could be recorded. "
            f"Open the block with gradients on: `with torch.enable_grad(), "
            f"hookscope.capture(...):`")


@contextmanager
def gradient_pass(model: nn.Module, error: type[HookscopeError]) -> Iterator[None]:
    """Gradients on for a verb's own forward and backward (Grad-CAM), wherever it is called:
    under ``torch.no_grad()`` and under ``torch.inference_mode()`` too (switched off for the
    pass; give the pass ``grad_leaf(x)``, an ordinary tensor even when ``x`` is an inference
    tensor). Frozen weights need nothing: the gradient flows from the input.

    Raises:
        error: a parameter or buffer of ``model`` is an inference tensor (the model was built or
            loaded under ``torch.inference_mode()``): autograd cannot save it for backward.
    """
    made = [name for name, t in chain(model.named_parameters(), model.named_buffers())
            if t.is_inference()]
    if made:
        raise error(
            f"{len(made)} parameters/buffers of the model ({', '.join(made[:3])}"
            f"{' …' if len(made) > 3 else ''}) are inference tensors: the model was built or "
            f"loaded under torch.inference_mode(), and autograd cannot use them for gradients. "
            f"Build/load the model outside inference mode (Lightning: Trainer(inference_mode="
            f"False)), or call this outside it")
    with torch.inference_mode(False), torch.enable_grad():
        yield


def grad_leaf(x: Tensor) -> Tensor:
    """``x`` as a new leaf that requires grad (an ordinary copy if ``x`` is an inference
    tensor), for ``gradient_pass``: the gradient reaches every activation computed from it,
    whatever the weights' ``requires_grad``."""
    return (x.clone() if x.is_inference() else x).detach().requires_grad_(True)


def _meta(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")
