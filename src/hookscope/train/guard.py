"""The NaN guard's pieces: the cheap per-step check, the replay bundle and ``replay``.

The check runs once per backward pass, after every gradient is accumulated: one fused norm over
all gradients (``torch._foreach_norm``, a kernel per device and dtype), the sum of those norms
and one host sync on it (``gradients_finite``). A finite sum means every gradient is finite; a
non-finite one is confirmed tensor by tensor (finite gradients can overflow a norm).

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
import math
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.diagnostics import LOSS, NonFiniteOrigin, find_nonfinite, loss_gradient_origin
from hookscope.engine import RngState, check_model, input_device, state_snapshot, untouched, unwrap
from hookscope.errors import BundleError, HookscopeError
from hookscope.train.bundle import decode, read_bundle, write_bundle
from hookscope.util import iter_tensors

__all__ = ["ReplayBundle", "StepInputs", "drop_gradients", "extremes", "extremes_finite", "finite",
           "grad_outputs", "gradients_finite", "replay"]

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
        forward_finite: whether the recorded step's model outputs were finite (so whether the
            recorded ``output_grads`` came from a non-finite loss on finite outputs); None when
            not known (a bundle written before it was recorded).
    """

    step: int
    rank: int
    inputs: StepInputs
    output_grads: list[Tensor | None]
    state: dict[str, Tensor]
    forward_finite: bool | None = None

    def save(self, path: str | Path) -> Path:
        """Write the bundle to ``path`` (a safetensors file, see ``hookscope.train.bundle``)
        atomically (temporary file, fsync, rename) and return the path.

        Raises:
            BundleError: the step's inputs hold a value a bundle cannot hold (not a tensor,
                number, string, None, list, tuple or dict of them).
            OSError: the file cannot be written (the disk is full); nothing is left behind.
        """
        return write_bundle(self, Path(path))

    @classmethod
    def load(cls, path: str | Path, map_location: torch.device | str | None = None) -> ReplayBundle:
        """Read and check a bundle written by ``save`` (tensors onto ``map_location`` when
        given); nothing is unpickled.

        Raises:
            ArgumentTypeError: ``path`` is not a path.
            BundleError: the file is missing, not a regular file, a link leading out of its
                folder, truncated, damaged (checksum), not a hookscope bundle, or breaks the
                schema (the message names the field).
        """
        data = read_bundle(path)
        if map_location is not None:
            data = {**data, "tensors": {k: v.to(map_location) for k, v in data["tensors"].items()}}
        return cls.from_parts(data)

    @classmethod
    def from_parts(cls, data: dict[str, Any]) -> ReplayBundle:
        """The bundle of ``read_bundle``'s checked parts (tensors by name, the JSON fields)."""
        tensors, fields = data["tensors"], data["fields"]
        state = {key: tensors[name] for key, name in fields["state"].items()}
        grads = [None if name is None else tensors[name] for name in fields["output_grads"]]
        rng = RngState(tensors[fields["rng_cpu"]],
                       None if fields["rng_cuda"] is None else [tensors[n] for n in fields["rng_cuda"]])
        autocast = tuple(fields["autocast"]) if fields["autocast"] is not None else None
        inputs = StepInputs(tuple(decode(fields["args"], tensors)), decode(fields["kwargs"], tensors),
                            rng, autocast)
        return cls(fields["step"], fields["rank"], inputs, grads, state,
                   fields.get("forward_finite"))


def gradients_finite(params: Iterable[nn.Parameter]) -> bool:
    """True when every ``.grad`` of ``params`` is finite (None counts as finite): one
    ``torch._foreach_norm`` over all gradients (a fused kernel per device and dtype), their sum,
    and one host sync on it. A finite sum means every gradient is finite; a non-finite one is
    confirmed tensor by tensor (finite gradients whose norms overflow float32, above about
    1.8e19, make it non-finite too: that rare case costs a pass over each gradient)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    return math.isfinite(_norm_sum(grads).item()) or all(finite(g) for g in grads)


def _norm_sum(tensors: list[Tensor]) -> Tensor:
    """The sum of the L2 norms of ``tensors`` (0-d): finite exactly when every tensor is,
    unless a norm or the sum overflows. One ``_foreach_norm`` (half-precision tensors' norms in
    float32, so a GradScaler's scaled float16 gradients do not overflow them); tensors on
    several devices, or float64 ones beside half ones, take ``get_total_norm``'s grouping."""
    wide = torch.float32 if tensors[0].dtype in _HALF else None
    try:
        norms = torch._foreach_norm(tensors, 2, dtype=wide)
        return norms[0] if len(norms) == 1 else torch.stack(norms).sum()
    except RuntimeError:  # several devices (stack), or a dtype that float32 would narrow
        return torch.nn.utils.get_total_norm(tensors)


_HALF = (torch.float16, torch.bfloat16)


def finite(tensor: Tensor) -> bool:
    """True when every element of ``tensor`` (floating point) is finite; an empty one is."""
    return tensor.numel() == 0 or extremes_finite([extremes(tensor)])


def extremes(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.aminmax`` of a non-empty floating-point ``tensor`` (detached), no host sync: NaN
    propagates into both and +-Inf are their own extremes, so both are finite exactly when
    every element is. One pass, where ``isfinite(t).all()`` makes two and a bool tensor (about
    20x the time on a CPU)."""
    low, high = torch.aminmax(tensor.detach())
    return low, high


def extremes_finite(pairs: list[tuple[Tensor, Tensor]]) -> bool:
    """True when every ``extremes`` pair is finite (one host sync per device)."""
    devices: dict[torch.device, list[Tensor]] = {}
    for pair in pairs:
        for value in pair:
            devices.setdefault(value.device, []).append(value.reshape(()))
    return all(bool(torch.isfinite(torch.stack(values)).all()) for values in devices.values())


def replay(bundle: ReplayBundle | str | Path, model: nn.Module) -> NonFiniteOrigin | None:
    """Re-run a recorded training step on ``model`` and return where NaN/Inf first appeared.

    The bundle is checked whole first (file, checksum, schema; nothing is unpickled) and its
    state dict against ``model``'s (the same keys, shapes and dtypes): a damaged bundle, or one
    of another model, is ``BundleError`` with ``model`` untouched. Then ``model`` gets the
    bundle's weights (``load_state_dict``: its parameters and buffers are overwritten; pass a
    copy to keep yours; when the replay itself fails they are put back), then
    ``find_nonfinite(model, ..., backward=True)``
    runs the step's forward under its autocast state and RNG state, and back-propagates the
    gradient the real step delivered to the outputs (see the module docstring). The RNG states
    are put back afterwards.

    Args:
        bundle: a ``ReplayBundle`` or the path of one (``nonfinite-step-<N>.safetensors`` in a
            run folder); tensors are loaded onto the device of ``model``'s first parameter.
        model: a model of the same architecture (the state dict must load strictly).

    Returns:
        The ``NonFiniteOrigin`` (module path, call, ``phase`` ``"forward"``/``"backward"``,
        op, tensor), or None when the replay is finite (the step depended on something the
        bundle does not hold, e.g. a non-deterministic kernel or a second forward per backward).
        ``path == "<loss>"`` (``class_name`` ``"loss outside the model"``): the gradient
        reaching the outputs was already non-finite, i.e. the loss computed outside the model
        was (``outputs`` summarise those gradients: a +inf loss's are +Inf, not NaN).
        ``path == "<recorded gradient>"``: the forward is finite now, but the recorded step's
        outputs were not, so only the gradient recorded in the bundle (which the loss of
        those non-finite outputs sent back) is non-finite: the model was changed since (a fix
        of the forward), and the backward can only be checked on a fresh step.
        ``path == "<input>"``: the step's batch already held NaN/Inf (``bad_label`` names the
        input, ``first_bad`` the indices).

    Raises:
        ArgumentTypeError: ``model`` is not a module, ``bundle`` neither a bundle nor a path.
        BundleError: the bundle is damaged, not hookscope's, or its state dict does not fit
            ``model`` (``model`` untouched); or its step raises in ``model`` (its state put
            back); as ``find_nonfinite``.
    """
    check_model(model)
    root, _ = unwrap(model)
    if not isinstance(bundle, ReplayBundle):
        bundle = ReplayBundle.load(bundle, map_location=input_device(root))
    _check_fits(bundle.state, root)
    before = state_snapshot(root)
    try:
        root.load_state_dict(bundle.state)
        inputs = bundle.inputs
        grads = bundle.output_grads
        # untouched puts the RNG states back afterwards
        with untouched(root):
            origin = _step(root, inputs, grads)
        if origin is not None and origin.path == LOSS and origin.phase == "forward":
            # the forward was finite and the surrogate loss is not: the real loss's gradient was,
            # or, when the recorded forward was not finite, the model has changed since (a fix)
            return loss_gradient_origin([(f"grad of output {i}", g) for i, g in enumerate(grads)
                                         if g is not None], bundle.step,
                                        recorded=bundle.forward_finite is False) or origin
        return origin
    except BaseException as err:
        root.load_state_dict(before)  # a replay that fails leaves the weights as they were
        if isinstance(err, HookscopeError) or not isinstance(err, Exception):
            raise
        raise BundleError(f"the bundle's step does not run on {type(root).__name__} "
                          f"({type(err).__name__}: {str(err)[:300]}); replay the bundle on the "
                          f"model that recorded it, in the same train/eval mode (the model's "
                          f"weights were put back)") from err


def _step(root: nn.Module, inputs: StepInputs, grads: list[Tensor | None]) -> NonFiniteOrigin | None:
    """The step's forward and backward from its RNG state, under its autocast state."""
    inputs.rng.restore()
    with _autocast(inputs.autocast):
        return _find(root, inputs, grads)


def _find(root: nn.Module, inputs: StepInputs, grads: list[Tensor | None]) -> NonFiniteOrigin | None:
    return find_nonfinite(root, *inputs.args, backward=True,
                          loss_fn=lambda output: _output_loss(output, grads), **inputs.kwargs)


def _check_fits(state: dict[str, Tensor], root: nn.Module) -> None:
    """Raise ``BundleError`` unless ``state`` has ``root``'s state-dict keys, shapes, dtypes."""
    mine = root.state_dict()
    if set(state) != set(mine):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise BundleError(f"the bundle's state dict does not fit the model ({type(root).__name__})"
                          f": missing {missing[:5]}, unexpected {extra[:5]}; replay the bundle on "
                          f"the architecture that recorded it (the model was not changed)")
    for key, tensor in state.items():
        if not isinstance(tensor, Tensor) or tensor.shape != mine[key].shape \
                or tensor.dtype != mine[key].dtype:
            what = (f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, Tensor)
                    else type(tensor).__name__)
            raise BundleError(f"the bundle's state dict entry {key!r} is {what}, the model's "
                              f"{tuple(mine[key].shape)} {mine[key].dtype}; replay the bundle on "
                              f"the model that recorded it (the model was not changed)")


def _autocast(state: tuple[str, str] | None) -> AbstractContextManager[Any]:
    if state is None:
        return nullcontext()
    return torch.autocast(state[0], dtype=getattr(torch, state[1]))


def grad_outputs(output: Any) -> list[Tensor]:
    """The output tensors whose gradient the guard records: floating point, requiring grad."""
    if type(output) is Tensor:  # the common case, without walking a structure
        return [output] if output.is_floating_point() and output.requires_grad else []
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
