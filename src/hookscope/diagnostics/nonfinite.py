"""Find the module where NaN or Inf first appears, in the forward pass or in the gradients.

Forward: a pre-hook on every module checks that module's inputs *before* it runs (a later
in-place operation could change them), and a forward hook checks its output when it returns.
Forward hooks fire in post-order (a child returns before its parent), so the first module that
returns a non-finite output from finite inputs is the innermost one that made it: a parent whose
child produced the NaN receives finite inputs and returns a non-finite output too, but returns
later. A parent is reported only when the NaN comes from its own code between child calls
(``torch.log`` in its ``forward``), which is where it was made.

Backward: full backward hooks would break on in-place operations (pytorch/pytorch#61519), so the
gradients are watched on the autograd graph itself: while the forward runs, a
function mode (``engine.each_call``) notes which module call created each autograd node; during the backward,
a hook on every node sees the gradients coming in and going out. The first node whose incoming
gradients are finite and whose outgoing ones are not made the non-finite gradient; its module
is reported. The same mode names the first operation that turned finite inputs into a
non-finite output in the forward pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from hookscope.engine import (
    Observer,
    Target,
    check_callable,
    check_flag,
    each_call,
    index,
    preflight,
    record_name,
    untouched,
    unwrap,
    values_for,
)
from hookscope.errors import HookscopeError
from hookscope.util import iter_tensors

__all__ = ["INPUT", "LOSS", "OUTSIDE", "NonFiniteOrigin", "TensorSummary", "find_nonfinite", "input_origin",
           "loss_gradient_origin", "own_nonfinite"]

Tensor = torch.Tensor
MAX_POSITIONS = 8
INPUT = "<input>"  # NonFiniteOrigin.path when the model's inputs already hold NaN/Inf
LOSS = "<loss>"  # NonFiniteOrigin.path when the loss (loss_fn's, or one outside the model) is NaN/Inf
OUTSIDE = "loss outside the model"  # its class_name when only the loss's gradient is known
RECORDED = "<recorded gradient>"  # path when a replay's forward is finite now, its recorded
RECORDED_CLASS = "gradient recorded in the bundle"  # output gradient not (the model changed)


@dataclasses.dataclass(frozen=True)
class TensorSummary:
    """One tensor's shape, dtype, count of non-finite values, and range of the finite ones.

    Attributes:
        label: which tensor: ``"args[0]"``, ``"kwargs['mask']"``, ``"output[1]"``, or for
            gradients ``"grad of output 0"`` / ``"grad of input 1"`` of an autograd node.
        min, max, mean: over the finite elements; NaN when there are none.
    """

    label: str
    shape: tuple[int, ...]
    dtype: str
    nan: int
    posinf: int
    neginf: int
    min: float
    max: float
    mean: float

    @property
    def nonfinite(self) -> int:
        """Number of NaN and +-Inf elements."""
        return self.nan + self.posinf + self.neginf

    @classmethod
    def of(cls, label: str, tensor: Tensor) -> TensorSummary:
        """Summarise ``tensor`` (any shape and dtype; integers are always finite)."""
        values = values_for(tensor, label, "nonfinite").detach()
        shape = tuple(tensor.shape) if tensor.layout == torch.strided and not tensor.is_nested \
            else tuple(values.shape)
        if values.is_complex():  # an element is NaN (or +-Inf) when either part is
            parts = torch.view_as_real(values)
            nan = torch.isnan(parts).any(-1)
            posinf, neginf = ((parts == inf).any(-1) & ~nan for inf in (math.inf, -math.inf))
            kept = parts[torch.isfinite(values)].double()
        else:
            if not values.is_floating_point():
                values = values.double()
            nan, posinf, neginf = torch.isnan(values), values == math.inf, values == -math.inf
            kept = values[torch.isfinite(values)].double()
        has_any = kept.numel() > 0
        return cls(
            label=label, shape=shape, dtype=str(tensor.dtype).replace("torch.", ""),
            nan=int(nan.sum()), posinf=int(posinf.sum()), neginf=int(neginf.sum()),
            min=float(kept.min()) if has_any else math.nan,
            max=float(kept.max()) if has_any else math.nan,
            mean=float(kept.mean()) if has_any else math.nan)

    def __str__(self) -> str:
        bad = f", {self.nan} NaN, {self.posinf} +Inf, {self.neginf} -Inf" if self.nonfinite else ""
        finite = (f"finite range [{self.min:.4g}, {self.max:.4g}], mean {self.mean:.4g}"
                  if not math.isnan(self.min) else "no finite value")
        return f"{self.label}: {list(self.shape)} {self.dtype}, {finite}{bad}"


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """The module call where a NaN or Inf first appeared.

    Attributes:
        path: qualified name of the module (``""`` for the root, ``"<loss>"`` for ``loss_fn``
            or, in a replay, the loss computed outside the model (``class_name`` ``"loss
            outside the model"``, ``outputs`` the gradients it sent into the model's outputs),
            ``"<input>"`` when the model's inputs already hold NaN/Inf: ``bad_label`` then
            names the input, e.g. ``"args[0]"``, ``"kwargs['mask']"``, ``"args[1][0]"``).
        class_name: its class, e.g. ``"Linear"`` (``"input"`` for ``"<input>"``).
        call_index: which call of that module (0 for the first; a reused module runs several
            times per forward).
        phase: ``"forward"`` (its output) or ``"backward"`` (a gradient it computed).
        op: the operation inside it that made the first non-finite value from finite inputs,
            e.g. ``"log"`` or ``"LogBackward0"``; ``None`` when not known (fused kernels).
        inputs: forward: its tensor arguments, checked before it ran; backward: the gradients
            coming into ``op`` (all finite); ``()`` for ``"<input>"``.
        outputs: forward: its output tensors; backward: the gradients ``op`` produced;
            for ``"<input>"``: the model's tensor inputs that hold NaN/Inf.
        bad_count: number of NaN/Inf elements in ``outputs``.
        bad_label: label of the first output tensor that holds them.
        first_bad: indices of up to 8 non-finite elements in that tensor, in row-major order.
        parameters: the module's own parameters and buffers (``recurse=False``: not its
            submodules') that hold NaN/Inf, labelled by their local name (``"weight"``,
            ``"running_var"``); ``()`` when they are all finite. When not empty they are the
            cause and are named first: ``weight of 'fc1' holds 3 NaN``.
    """

    path: str
    class_name: str
    call_index: int
    phase: str
    op: str | None
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]
    bad_count: int
    bad_label: str
    first_bad: tuple[tuple[int, ...], ...]
    parameters: tuple[TensorSummary, ...] = ()

    @property
    def parameter_names(self) -> list[str]:
        """Qualified names (``state_dict`` keys) of ``parameters``: ``["fc1.weight"]``."""
        return [f"{self.path}.{s.label}" if self.path else s.label for s in self.parameters]

    def __str__(self) -> str:
        first_at = ", ".join(str(list(p)) for p in self.first_bad)
        if self.path == INPUT:
            lines = [f"the model's input is already non-finite: {self.bad_count} NaN/Inf in "
                     f"{self.bad_label}, first at {first_at}; "
                     "no module made it: check the data (or the preprocessing) that produced it"]
            return "\n".join(lines + [f"  in  {s}" for s in self.outputs])
        if self.path == RECORDED:
            lines = [f"the forward is finite now: on the step's inputs and weights no module "
                     f"makes a NaN or Inf any more; only the gradient recorded in the bundle is "
                     f"non-finite ({_counts(self.outputs)} in {self.bad_label}, first at "
                     f"{first_at}): the loss of step {self.call_index} sent it back from that "
                     f"step's non-finite outputs, and the model has changed since. The forward "
                     f"is fixed; check the backward on a fresh training step"]
            return "\n".join(lines + [f"  out {s}" for s in self.outputs])
        if self.class_name == OUTSIDE:
            lines = [f"the loss computed outside the model is non-finite: the gradient it sent "
                     f"into the model's output holds {_counts(self.outputs)} ({self.bad_label}, "
                     f"first at {first_at}); no module made it: check the loss function (a log "
                     f"or division of 0, an overflow, a non-finite target or weight)"]
            return "\n".join(lines + [f"  out {s}" for s in self.outputs])
        where = f"'{record_name(self.path)}'"
        op = f" (first in op {self.op})" if self.op else ""
        what = "output" if self.phase == "forward" else "gradient"
        lines = [f"first non-finite {what}: {where} ({self.class_name}), call {self.call_index}, "
                 f"{self.phase}{op}: {self.bad_count} NaN/Inf in {self.bad_label}, first at "
                 f"{first_at}"]
        lines += [f"  in  {s}" for s in self.inputs] + [f"  out {s}" for s in self.outputs]
        return "\n".join(_parameter_lines(self.parameters, where, self.class_name) + lines)


def _parameter_lines(parameters: tuple[TensorSummary, ...], where: str,
                     class_name: str) -> list[str]:
    """The lines that name a module's non-finite parameters and buffers, before its output:
    ``non-finite parameter: weight of 'fc1' (Linear) holds 3 NaN``."""
    if not parameters:
        return []
    held = "; ".join(f"{s.label} of {where} holds {_counts((s,))}" for s in parameters)
    return [f"non-finite parameter: {held} ({class_name}); it made the output below"] + [
        f"  param {s}" for s in parameters]


def _counts(summaries: tuple[TensorSummary, ...]) -> str:
    """``"3 NaN, 1 +Inf"``: the non-zero counts of each kind over ``summaries``."""
    totals = ((sum(s.nan for s in summaries), "NaN"), (sum(s.posinf for s in summaries), "+Inf"),
              (sum(s.neginf for s in summaries), "-Inf"))
    return ", ".join(f"{count} {kind}" for count, kind in totals if count)


def loss_gradient_origin(grads: list[tuple[str, Tensor]], step: int, *,
                         recorded: bool = False) -> NonFiniteOrigin | None:
    """The origin ``"<loss>"`` (``class_name`` ``"loss outside the model"``, ``phase``
    ``"backward"``) when a gradient the loss sent into the model's outputs holds NaN/Inf: the
    loss was computed outside the model and only its gradient is known (``replay``); else None.
    With ``recorded`` (the recorded step's outputs were non-finite, this forward's are finite)
    the origin is ``"<recorded gradient>"`` instead: the model changed since, and only the
    gradient recorded at ``step`` is non-finite.

    Args:
        grads: ``(label, gradient)`` of each output that received one, e.g. ``("grad of
            output 0", (batch, classes) float32)``.
        step: the recorded training step (its index is the origin's ``call_index``).
        recorded: the recorded forward was not finite.
    """
    bad = [(label, g) for label, g in grads if not _is_finite(g)]
    if not bad:
        return None
    summaries = tuple(TensorSummary.of(label, g) for label, g in bad)
    path, class_name = (RECORDED, RECORDED_CLASS) if recorded else (LOSS, OUTSIDE)
    return _origin(path, class_name, step if recorded else 0, "backward", None, (), summaries,
                   [g for _, g in bad])


def find_nonfinite(model: nn.Module, *args: Any, backward: bool = False,
                   loss_fn: Callable[[Any], Tensor] | None = None,
                   **kwargs: Any) -> NonFiniteOrigin | None:
    """Run ``model(*args, **kwargs)`` once and return where NaN/Inf first appeared, or None.

    The model runs eagerly in its current train/eval mode (so dropout is what training sees): a
    ``torch.compile``'d model runs its original module (compiled code would skip or trace the
    hooks), a ``DataParallel`` one its wrapped module. Hooks are removed on return, also on an
    error, and the model is left as it was found (BatchNorm statistics, spectral norm,
    train/eval flags, ``requires_grad``, ``.grad``, the RNG state: ``engine.run.untouched``).
    With ``backward=True`` and a finite forward, the gradients of ``loss_fn(output)``
    (default: the sum of every floating-point output tensor) with respect to the parameters and
    to inputs that require grad are computed with ``torch.autograd.grad``, so no ``.grad`` is changed.

    Args:
        model: Root module (``DataParallel`` and ``torch.compile`` wrappers are looked through).
        *args, **kwargs: Inputs of one forward call.
        backward: Also look for the first non-finite gradient.
        loss_fn: ``output -> scalar tensor`` for the backward pass.

    Returns:
        A ``NonFiniteOrigin``: the first place a non-finite value appears. In the forward pass,
        the first module to return (post-order)
        whose inputs were finite and whose output is not; else, in the backward pass, the module
        whose operation first produced a non-finite gradient from finite ones. ``None`` when
        everything is finite. When no module made a non-finite value but one returned it (or the
        model's output or the loss is non-finite) and an input (``args``/``kwargs``, nested tuples, lists and
        dicts included) already holds NaN/Inf, the origin is that input (``path == "<input>"``,
        ``phase == "forward"``, ``bad_label`` the input, ``first_bad`` its indices). An input
        with ``-inf`` that the model consumes without a non-finite result (an additive attention
        mask) is not reported.

    Raises:
        HookscopeError: the model is TorchScript; or ``backward=True`` but the output does
            not require grad (the forward ran under ``torch.no_grad()``/``inference_mode`` or
            nothing requires grad).
    """
    check_flag("backward", backward)
    if loss_fn is not None:
        check_callable("loss_fn", loss_fn, "lambda out: out.logits.sum()")
    preflight(model)
    root, _ = unwrap(model)
    bad_input = input_origin(args, kwargs)
    tracker = _Tracker(root, record_nodes=backward)
    search = partial(_search, tracker, root, args, kwargs, bad_input, backward, loss_fn)
    # one session: forward hooks, then the node hooks
    with untouched(root), tracker.observing() as session:
        return search(session)


def _search(tracker: _Tracker, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            bad_input: NonFiniteOrigin | None, backward: bool,
            loss_fn: Callable[[Any], Tensor] | None, session: Observer) -> NonFiniteOrigin | None:
    """``find_nonfinite``'s search inside its session: the forward under the op watcher, then
    (``backward=True``, nothing found) the gradients with the node hooks."""
    forward = partial(_forward, tracker, root, args, kwargs, bad_input, backward, loss_fn)
    with each_call(tracker.saw_call):
        found, loss = forward()
    if found is not None or loss is None:
        return found
    if bad_input is not None and not _is_finite(loss):
        return bad_input
    loss_origin = tracker.loss_origin(loss)
    if loss_origin is not None:
        return loss_origin
    leaves: list[Tensor] = [p for p in root.parameters() if p.requires_grad]
    leaves += [t for t in iter_tensors((args, kwargs)) if t.requires_grad and t.is_leaf]
    if loss.grad_fn is None or not leaves:
        raise HookscopeError(
            "backward=True needs a loss that requires grad, but it has no autograd graph: run "
            "find_nonfinite outside torch.no_grad()/torch.inference_mode(), with parameters or "
            "inputs that require grad (model.requires_grad_(True))")
    for node in tracker.owners:
        session.hook_grad_node(node, tracker.node_hook(node))
    torch.autograd.grad(loss, leaves, allow_unused=True)
    return tracker.found


def _forward(tracker: _Tracker, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             bad_input: NonFiniteOrigin | None, backward: bool,
             loss_fn: Callable[[Any], Tensor] | None) -> tuple[NonFiniteOrigin | None, Tensor | None]:
    """The forward (and the loss) under the op watcher: ``(origin, None)`` when the forward
    settled it (``origin`` None: all finite and no backward wanted), else ``(None, loss)``."""
    output = root(*args, **kwargs)
    if tracker.found is not None:
        return tracker.found, None
    if bad_input is not None and (tracker.carried or
                                  not all(_is_finite(t) for t in iter_tensors(output))):
        return bad_input, None  # no module made it: it came in with the input
    if not backward:
        return None, None
    return None, loss_fn(output) if loss_fn is not None else _sum_floats(output)


def input_origin(args: tuple[Any, ...], kwargs: dict[str, Any]) -> NonFiniteOrigin | None:
    """The ``"<input>"`` origin when a tensor among a call's inputs holds NaN/Inf, else None.

    Args:
        args, kwargs: the inputs of one forward call (tensors nested in tuples, lists, dicts,
            dataclasses are looked at; integer tensors are always finite).
    """
    labelled = list(_labelled(args, "args")) + list(_labelled(kwargs, "kwargs"))
    if all(_is_finite(t) for _, t in labelled):
        return None
    bad = [(label, t) for label, t in labelled if not _is_finite(t)]
    summaries = tuple(TensorSummary.of(label, t) for label, t in bad)
    return _origin(INPUT, "input", 0, "forward", None, (), summaries, [t for _, t in bad])


@dataclasses.dataclass
class _Call:
    module: nn.Module
    index: int
    inputs: list[tuple[str, Tensor, int]] | None  # (label, tensor, version); None: not finite
    op: str | None = None

    def input_summaries(self) -> tuple[TensorSummary, ...]:
        """Summaries of the inputs, noting those the module changed in place since its start."""
        return tuple(TensorSummary.of(label if tensor._version == version
                                      else f"{label} (as changed in place by this module)", tensor)
                     for label, tensor, version in self.inputs or ())


class _Tracker:
    """Hooks on every module of ``root`` and a function mode; holds the first finding."""

    def __init__(self, root: nn.Module, record_nodes: bool) -> None:
        self.root = root
        # canonical paths: wrappers at any depth (FSDP blocks) are looked through, not hooked
        self.paths = {module: path for path, module in index(root).modules.items()}
        self.record_nodes = record_nodes
        self.counts: dict[nn.Module, int] = {}
        self.active: list[_Call] = []
        self.owners: dict[Any, _Call | None] = {}  # autograd node -> module call that made it
        self.found: NonFiniteOrigin | None = None
        self.carried = False  # a module whose inputs were already non-finite returned NaN/Inf
        self.busy = False  # True while our own hooks run torch functions: the mode ignores them

    @contextmanager
    def observing(self) -> Iterator[Observer]:
        """The session of the hooks on every module (each call's inputs and output), open
        for the forward and the backward (``hook_grad_node``); every hook is removed on exit."""
        targets = [Target(path, module) for module, path in self.paths.items()]
        observer = Observer(self.root, targets, pre=lambda t: self._pre_hook,
                            forward=lambda t: self._post_hook, with_kwargs=True,
                            explain_unfired=False)
        with observer as session:
            yield session

    def loss_origin(self, loss: Tensor) -> NonFiniteOrigin | None:
        """Report ``loss_fn`` itself when it turned a finite output into a non-finite loss."""
        if bool(torch.isfinite(loss.detach()).all()):
            return None
        return _origin(LOSS, "loss_fn", 0, "forward", None, (),
                       (TensorSummary.of("loss", loss),), [loss])

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        index = self.counts.get(module, 0)
        self.counts[module] = index + 1
        inputs = None
        if self.found is None:
            self.busy = True
            labelled = list(_labelled(args, "args")) + list(_labelled(kwargs, "kwargs"))
            if all(_is_finite(t) for _, t in labelled):
                inputs = [(label, t, t._version) for label, t in labelled]
            self.busy = False
        self.active.append(_Call(module, index, inputs))

    def _post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        call = self.active.pop()
        if self.found is not None:
            return
        self.busy = True
        labelled = list(_labelled(output, "output"))
        if call.inputs is None:  # not an origin: it was handed NaN/Inf
            self.carried = self.carried or not all(_is_finite(t) for _, t in labelled)
            self.busy = False
            return
        if not all(_is_finite(t) for _, t in labelled):
            outputs = tuple(TensorSummary.of(label, t) for label, t in labelled)
            self.found = _origin(self.paths[module], type(module).__name__, call.index, "forward",
                                 call.op, call.input_summaries(), outputs, [t for _, t in labelled],
                                 own_nonfinite(module))
        self.busy = False

    def saw_call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: Any, output: Any) -> None:
        """Called after each torch function inside the forward (``engine.each_call``): its
        output, unless one of our own hooks ran it."""
        if not self.busy and isinstance(output, (Tensor, tuple, list)):
            self.note_op(getattr(func, "__name__", str(func)), (args, kwargs), output)

    def note_op(self, name: str, args: Any, output: Any) -> None:
        """What a torch function inside the model produced (``saw_call``)."""
        call = self.active[-1] if self.active else None
        if self.record_nodes:
            for tensor in iter_tensors(output):
                if tensor.grad_fn is not None and tensor.grad_fn not in self.owners:
                    self.owners[tensor.grad_fn] = call
        if call is None or call.inputs is None or call.op is not None or self.found is not None:
            return
        if not all(_is_finite(t) for t in iter_tensors(output)):
            # parameters do not count as inputs, as for modules: an Inf weight is the op's doing
            if all(_is_finite(t) for t in iter_tensors(args) if not isinstance(t, nn.Parameter)):
                call.op = name

    def node_hook(self, node: Any) -> Callable[[tuple[Any, ...], tuple[Any, ...]], None]:
        """The hook on autograd node ``node``: notes the first non-finite gradient it makes
        from finite incoming ones."""
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if self.found is not None:
                return
            incoming = [(f"grad of output {i}", g) for i, g in enumerate(grad_outputs)
                        if isinstance(g, Tensor)]
            produced = [(f"grad of input {i}", g) for i, g in enumerate(grad_inputs)
                        if isinstance(g, Tensor)]
            if all(_is_finite(g) for _, g in produced) or not all(_is_finite(g) for _, g in incoming):
                return
            call = self.owners[node]
            module = call.module if call is not None else None
            self.found = _origin(
                self.paths[module] if module is not None else LOSS,
                type(module).__name__ if module is not None else "loss_fn",
                call.index if call is not None else 0, "backward", node.name(),
                tuple(TensorSummary.of(label, g) for label, g in incoming),
                tuple(TensorSummary.of(label, g) for label, g in produced),
                [g for _, g in produced], own_nonfinite(module) if module is not None else ())
        return hook


def _origin(path: str, class_name: str, index: int, phase: str, op: str | None,
            inputs: tuple[TensorSummary, ...], outputs: tuple[TensorSummary, ...],
            tensors: list[Tensor],
            parameters: tuple[TensorSummary, ...] = ()) -> NonFiniteOrigin:
    first = next(i for i, t in enumerate(tensors) if not _is_finite(t))
    bad = ~torch.isfinite(tensors[first].detach())
    positions = torch.nonzero(bad)[:MAX_POSITIONS].tolist()
    return NonFiniteOrigin(
        path=path, class_name=class_name, call_index=index, phase=phase, op=op, inputs=inputs,
        outputs=outputs, bad_count=sum(s.nonfinite for s in outputs),
        bad_label=outputs[first].label, first_bad=tuple(tuple(p) for p in positions),
        parameters=parameters)


def own_nonfinite(module: nn.Module) -> tuple[TensorSummary, ...]:
    """Summaries of ``module``'s own parameters and buffers (``recurse=False``) that hold
    NaN/Inf, labelled by local name (``"weight"``); ``()`` when all are finite."""
    named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return tuple(TensorSummary.of(name, t) for name, t in named
                 if t is not None and not _is_finite(t))


def _labelled(obj: Any, name: str) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(label, tensor)`` for the tensors in ``obj``: ``args[0]``, ``output[1]``, ..."""
    if isinstance(obj, Tensor):
        yield name, obj
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from _labelled(value, f"{name}[{i}]")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _labelled(value, f"{name}[{key!r}]")
    else:
        for i, tensor in enumerate(iter_tensors(obj)):  # dataclasses, ModelOutput
            yield f"{name}.{i}", tensor


def _is_finite(tensor: Tensor) -> bool:
    """True when no element is NaN or +-Inf. One sum decides in the common case: a finite sum
    means every element is finite; only an infinite or NaN sum (or an overflow) needs a full
    ``isfinite`` pass."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    values = tensor.detach()
    if values.layout != torch.strided or values.is_nested or values.is_meta or type(values) is not Tensor:
        # nested, sparse, quantized: their values; meta and FakeTensors: refused (no values)
        values = values_for(values, "a value", "nonfinite")
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())


def _sum_floats(output: Any) -> Tensor:
    floats = [t for t in iter_tensors(output) if t.is_floating_point()]
    if not floats:
        raise HookscopeError("backward=True needs a floating-point output to differentiate; "
                             "pass loss_fn=lambda output: <a scalar tensor>")
    return torch.stack([t.sum().float() for t in floats]).sum()
