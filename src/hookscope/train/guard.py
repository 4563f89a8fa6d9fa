"""The NaN guard's pieces: the cheap per-step check, the replay bundle and ``replay``.

The check runs once per backward pass, after every gradient is accumulated: one fused norm over
all gradients (``torch.nn.utils.get_total_norm``, a ``foreach`` kernel per device) and one
host sync on its finiteness. A finite norm means every gradient is finite; a non-finite one is
confirmed tensor by tensor (a finite gradient can overflow the norm).

When it fires, the step is replayed with ``find_nonfinite`` (forward and backward hooks on every
module): the same inputs, the weights before ``optimizer.step`` (a copy of the state dict taken
when the check fired), the same CPU/CUDA RNG states (taken when the forward began) and the same
autocast state. The backward of the replay does not need the user's loss: it back-propagates
the gradient that the real step delivered to the model's output tensors (``loss = sum(out *
grad_out)`` has exactly that gradient), so a loss computed outside the model, a GradScaler's
scale, or a loss inside the model (Hugging Face ``labels=``) are all reproduced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.diagnostics.nonfinite import NonFiniteOrigin, find_nonfinite
from hookscope.engine.run import RngState, input_device, untouched
from hookscope.engine.select import unwrap
from hookscope.errors import HookscopeError
from hookscope.util.nested import iter_tensors

Tensor = torch.Tensor


@dataclasses.dataclass
class StepInputs:
    """What a forward began with: its inputs (references, not copies), RNG states, autocast.

    Attributes:
        args, kwargs: the root module's call arguments.
        rng: the CPU (and CUDA, when initialised) generators' states before the forward.
        autocast: ``(device_type, dtype name)`` when autocast was on for the model's device.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: RngState
    autocast: tuple[str, str] | None

    @classmethod
    def now(cls, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> StepInputs:
        """The state at the start of a forward on ``device_type`` (``"cpu"``, ``"cuda"``)."""
        autocast = None
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            autocast = (device_type, str(dtype).replace("torch.", ""))
        return cls(args, kwargs, RngState.now(), autocast)


@dataclasses.dataclass
class ReplayBundle:
    """Everything ``replay`` needs to re-run one training step's forward and backward.

    Attributes:
        step: the optimizer step (0-based) the forward belonged to.
        rank: the ``torch.distributed`` rank that ran it (0 without a process group).
        inputs: the forward's ``StepInputs``.
        output_grads: the gradient the backward delivered to each floating-point output tensor
            that requires grad (``iter_tensors`` order), None where none arrived.
        state: the model's ``state_dict()`` (detached clones) before ``optimizer.step``.
    """

    step: int
    rank: int
    inputs: StepInputs
    output_grads: list[Tensor | None]
    state: dict[str, Tensor]

    def save(self, path: str | Path) -> Path:
        """Write the bundle with ``torch.save`` (plain tensors, lists and dicts: it loads with
        ``weights_only=True``) and return the path."""
        path = Path(path)
        i = self.inputs
        torch.save({"step": self.step, "rank": self.rank, "args": list(i.args), "kwargs": i.kwargs,
                    "rng_cpu": i.rng.cpu, "rng_cuda": i.rng.cuda,
                    "autocast": list(i.autocast) if i.autocast else None,
                    "output_grads": self.output_grads, "state": self.state}, path)
        return path

    @classmethod
    def load(cls, path: str | Path, map_location: torch.device | str | None = None) -> ReplayBundle:
        """Read a bundle written by ``save`` (tensors onto ``map_location`` when given).

        Raises:
            HookscopeError: the file is not a hookscope replay bundle.
        """
        data = torch.load(path, map_location=map_location, weights_only=True)
        if not isinstance(data, dict) or "output_grads" not in data:
            raise HookscopeError(f"{path} is not a replay bundle written by hookscope.monitor "
                                 "(no 'output_grads'); pass the nonfinite-step-*.pt file of the run")
        autocast = tuple(data["autocast"]) if data["autocast"] else None
        rng = RngState(data["rng_cpu"].cpu(),
                       [s.cpu() for s in data["rng_cuda"]] if data["rng_cuda"] else None)
        inputs = StepInputs(tuple(data["args"]), data["kwargs"], rng, autocast)
        return cls(data["step"], data["rank"], inputs, data["output_grads"], data["state"])


def gradients_finite(params: Iterable[nn.Parameter]) -> bool:
    """True when every ``.grad`` of ``params`` is finite (None counts as finite): one fused
    norm and one host sync; a non-finite norm is confirmed tensor by tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norm = torch.nn.utils.get_total_norm(grads)
    return bool(torch.isfinite(norm)) or all(bool(torch.isfinite(g).all()) for g in grads)


def replay(bundle: ReplayBundle | str | Path, model: nn.Module) -> NonFiniteOrigin | None:
    """Re-run a recorded training step on ``model`` and return where NaN/Inf first appeared.

    ``model`` gets the bundle's weights (``load_state_dict``: its parameters and buffers are
    overwritten; pass a copy to keep yours), then ``find_nonfinite(model, ..., backward=True)``
    runs the step's forward under its autocast state and RNG state, and back-propagates the
    gradient the real step delivered to the outputs (see the module docstring). The RNG states
    are put back afterwards.

    Args:
        bundle: a ``ReplayBundle`` or the path of one (``nonfinite-step-<N>.pt`` in a run
            folder); tensors are loaded onto the device of ``model``'s first parameter.
        model: a model of the same architecture (the state dict must load strictly).

    Returns:
        The ``NonFiniteOrigin`` (module path, call, ``phase`` ``"forward"``/``"backward"``,
        op, tensor), or None when the replay is finite (the step depended on something the
        bundle does not hold, e.g. a non-deterministic kernel or a second forward per backward).
        ``path == "<loss>"``: the gradient reaching the outputs was already non-finite, i.e. the
        loss computed outside the model was. ``path == "<input>"``: the step's batch already
        held NaN/Inf (``bad_label`` names the input, ``first_bad`` the indices).

    Raises:
        HookscopeError: ``bundle`` is not a replay bundle; as ``find_nonfinite``.
        RuntimeError: (torch) the state dict does not fit ``model``.
    """
    root, _ = unwrap(model)
    if not isinstance(bundle, ReplayBundle):
        device = input_device(root)
        bundle = ReplayBundle.load(bundle, map_location=device)
    root.load_state_dict(bundle.state)
    inputs = bundle.inputs
    grads = bundle.output_grads
    with untouched(root):  # puts the RNG states back afterwards
        inputs.rng.restore()
        with _autocast(inputs.autocast):
            return find_nonfinite(root, *inputs.args, backward=True,
                                  loss_fn=lambda output: _output_loss(output, grads), **inputs.kwargs)


def _autocast(state: tuple[str, str] | None) -> AbstractContextManager[Any]:
    if state is None:
        return nullcontext()
    return torch.autocast(state[0], dtype=getattr(torch, state[1]))


def grad_outputs(output: Any) -> list[Tensor]:
    """The output tensors whose gradient the guard records: floating point, requiring grad."""
    return [t for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]


def _output_loss(output: Any, grads: list[Tensor | None]) -> Tensor:
    """``sum(out * grad)`` over the outputs that received their gradient from outside the
    model: an output computed from another one (HF ``logits`` -> ``loss``) got its gradient
    through that one and is left out, or it would count twice."""
    tensors = grad_outputs(output)
    if len(tensors) != len(grads):
        raise HookscopeError(f"the replayed forward returned {len(tensors)} output tensors that "
                             f"require grad, the recorded step {len(grads)}: replay the bundle on "
                             "the model (same architecture and train/eval mode) that recorded it")
    pairs = [(t, g) for t, g in zip(tensors, grads, strict=True) if g is not None]
    inner = set()
    for t, _ in pairs:
        inner |= _ancestors(t.grad_fn)
    kept = [(t, g) for t, g in pairs if t.grad_fn not in inner] or pairs
    return torch.stack([(t.float() * g.to(t.device).float()).sum() for t, g in kept]).sum()


def _ancestors(node: Any) -> set[Any]:
    """Every autograd node reachable from ``node`` through ``next_functions``, not ``node``."""
    seen: set[Any] = set()
    stack = [n for n, _ in node.next_functions if n is not None] if node is not None else []
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack += [n for n, _ in current.next_functions if n is not None]
    return seen


def drop_gradients(params: Iterable[nn.Parameter]) -> None:
    """Set each ``.grad`` to None: ``optimizer.step`` then leaves every parameter alone."""
    for p in params:
        p.grad = None
