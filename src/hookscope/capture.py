"""Capture: record what selected modules return (and take, and receive as gradient) on every call.

``capture(model, *patterns)`` is a context manager. On entry it resolves the patterns (errors
come before anything is registered), then adds one forward hook per selected module; on exit it
removes every hook it added, also on an exception or ``KeyboardInterrupt``, checks that no
captured value was overwritten in place, and reports each selected module whose hook never fired.

Captured values stay equal to what the module returned at that moment. A later in-place write
(``ReLU(inplace=True)``, ``x += y``) would change a tensor kept by reference; cloning every output
costs x1.54 against x1.31 for references on an all-leaf ResNet-50 capture (shared/BASELINE.md).
So the default ``clone=None`` learns, per module, whether its output is ever written in place:
the first capture of a module clones its outputs and keeps the version counters
(``Tensor._version``) of the originals; if they changed by the end of that forward pass, the
module is remembered as written-in-place (its outputs are cloned from then on), else as safe (kept
by reference). Outputs kept by reference are checked again on exit; a value that changed anyway
(a data-dependent branch) is never returned: reading it raises ``CaptureError``.

Under ``torch.inference_mode()`` tensors carry no version counter: the first capture then decides
by comparing each original with its copy at the end of the pass, and later outputs kept by
reference cannot be checked. A module whose in-place writer left the values unchanged during that
first pass (a ``clamp_`` that clipped nothing) would go unnoticed; pass ``clone=True`` where that
matters.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope import diagnose
from hookscope._nested import get_part, map_tensors
from hookscope.errors import CaptureError, HookNeverFiredError, HookNeverFiredWarning, HookscopeError
from hookscope.grads import NO_GRADIENT_YET, GradRecord, converter, watch_inputs, watch_output
from hookscope.records import save_records
from hookscope.select import Target, resolve, unwrap

__all__ = ["Capture", "CallInputs", "capture", "run"]

Tensor = torch.Tensor
OnUnfired = Literal["warn", "error", "ignore"]

# module -> True when its output was seen written in place after it returned, False when seen safe.
_WRITTEN_IN_PLACE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class CallInputs:
    """The inputs of one call: ``args`` and ``kwargs`` as passed, ``named`` bound to the
    signature of ``forward`` (``{'hidden_states': Tensor, 'attention_mask': Tensor, ...}``).

    ``inputs[0]`` is the first argument and ``inputs["attention_mask"]`` the named one, whether
    the caller passed it by position or by keyword.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    named: dict[str, Any]

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, int):
            return list(self.named.values())[key]
        return self.named[key]


class _Slot:
    """Everything recorded for one target (a module, or a part of its output)."""

    __slots__ = ("target", "outputs", "inputs", "grads", "grad_inputs", "versions", "broken")

    def __init__(self, target: Target):
        self.target = target
        self.outputs: list[Any] = []
        self.inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.grads: list[GradRecord] = []
        self.grad_inputs: list[GradRecord] = []
        self.versions: list[tuple[int, Tensor, int]] = []  # (call, tensor kept by reference, version)
        self.broken: set[int] = set()  # calls whose value was overwritten in place


class Capture:
    """Records of one capture session; build it with ``hookscope.capture(...)``.

    Reading records: ``acts[path]`` is the output of the module's one call; ``acts[path, k]`` the
    output of call ``k`` (negative counts from the end); ``acts.calls(path)`` every call in order.
    Outputs keep their structure (tensor, tuple, dict, dataclass, ``ModelOutput``), each tensor
    detached, e.g. ``(batch, channels, height, width)`` float32 for a ``Conv2d``.

    Raises (on reading):
        CaptureError: the path was not selected, never ran, ran more than once (for
            ``acts[path]``), or its value was overwritten in place (``clone=False``, or a module
            whose in-place write depends on the data).
    """

    def __init__(self, model: nn.Module, patterns: Sequence[str], *, inputs: bool = False,
                 grads: bool = False, grad_inputs: bool = False,
                 to: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, reduce: Callable[[Tensor], Tensor] | None = None,
                 clone: bool | None = None, on_unfired: OnUnfired = "warn"):
        if on_unfired not in ("warn", "error", "ignore"):
            raise HookscopeError(f"on_unfired={on_unfired!r} is not one of 'warn', 'error', 'ignore'")
        self.model = model
        diagnose.preflight(model)
        self._targets = resolve(model, list(patterns))
        diagnose.check_targets(model, self._targets)
        self._slots = {t.key: _Slot(t) for t in self._targets}
        self._options = dict(inputs=inputs, grads=grads, grad_inputs=grad_inputs, to=to,
                             dtype=dtype, reduce=reduce, clone=clone)
        self._grad_convert = converter(to, dtype)  # applied to each gradient as it arrives
        self._on_unfired = on_unfired
        self._handles: list[RemovableHandle] = []
        self._ran: set[str] = set()
        # modules on trial: (module, tensor kept by reference, its version or None, its copy)
        self._learning: list[tuple[nn.Module, Tensor, int | None, Tensor]] = []
        # module -> copy its outputs? (True/False), or None while on trial; see the module docstring
        self._policy: dict[nn.Module, bool | None] = {}
        self.unfired: dict[str, str] = {}
        self._active = False

    # ----------------------------------------------------------------- session
    def __enter__(self) -> Capture:
        if self._active:
            raise HookscopeError("this capture is already active: a Capture is entered once; "
                                 "call hookscope.capture(...) again for a new session")
        self._active = True
        try:
            self._register()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._remove()
        self._finish_learning()
        self._check_versions()
        if exc is not None:
            diagnose.locate_error(self.model, exc)
            return
        self.unfired = diagnose.explain_unfired(
            self.model, [s.target for s in self._slots.values() if not s.outputs], self._ran)
        self._report_unfired()

    def _register(self) -> None:
        by_module: dict[nn.Module, list[_Slot]] = {}
        for slot in self._slots.values():
            by_module.setdefault(slot.target.module, []).append(slot)
        for module, slots in by_module.items():
            hook = self._make_hook(module, slots)
            self._handles.append(module.register_forward_hook(
                hook, with_kwargs=bool(self._options["inputs"])))
            if self._options["grad_inputs"]:
                self._handles.append(module.register_forward_pre_hook(
                    watch_inputs([s.grad_inputs for s in slots], self._grad_convert), with_kwargs=True))
        root, _ = unwrap(self.model)
        self._handles.append(root.register_forward_hook(self._end_of_pass))
        for path, module in diagnose.witnesses(self.model, self._targets).items():
            self._handles.append(module.register_forward_pre_hook(self._witness(path)))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active = False

    def _witness(self, path: str) -> Callable[..., None]:
        ran = self._ran

        def hook(module: nn.Module, args: Any) -> None:
            ran.add(path)
        return hook

    def _end_of_pass(self, module: nn.Module, args: Any, output: Any) -> None:
        self._finish_learning()

    # ----------------------------------------------------------------- hooks
    def _make_hook(self, module: nn.Module, slots: list[_Slot]) -> Callable[..., None]:
        snapshot = self._snapshot_fn(module)
        ran, path = self._ran, slots[0].target.path
        with_inputs, with_grads = self._options["inputs"], self._options["grads"]
        convert = self._grad_convert
        single = slots[0] if len(slots) == 1 and not slots[0].target.parts else None

        def hook(module: nn.Module, args: Any, *rest: Any) -> None:
            output = rest[-1]
            ran.add(path)
            if single is not None:  # the common case: one record of the whole output
                single.outputs.append(snapshot(output, single))
            else:
                for slot in slots:
                    slot.outputs.append(snapshot(_part(output, slot), slot))
            if with_inputs:
                kwargs = rest[0] if len(rest) == 2 else {}
                for slot in slots:
                    slot.inputs.append((map_tensors(_copy, args), map_tensors(_copy, kwargs)))
            if with_grads:
                for slot in slots:
                    slot.grads.append(watch_output(_part(output, slot), convert))
        return hook

    def _snapshot_fn(self, module: nn.Module) -> Callable[[Any, _Slot], Any]:
        """Return ``snapshot(output, slot)``: the output with each tensor detached, converted,
        reduced, and copied when the in-place policy says so (decided once per call)."""
        to, dtype, reduce = self._options["to"], self._options["dtype"], self._options["reduce"]
        converts = to is not None or dtype is not None or reduce is not None
        clone, trial, policy = self._options["clone"], self._learning, self._policy
        policy.setdefault(module, _WRITTEN_IN_PLACE.get(module) if clone is None else clone)

        def keep(t: Tensor, slot: _Slot, copy: bool, learning: bool) -> Tensor:
            kept = t.detach()
            if converts:
                if to is not None or dtype is not None:
                    kept = kept.to(device=to, dtype=dtype)
                if reduce is not None:
                    kept = reduce(kept)
                if not _shares_memory(kept, t):
                    return kept
            if copy:
                pristine = kept.clone()
                if learning:
                    trial.append((module, kept, _version(kept), pristine))
                return pristine
            if not kept.is_inference():  # inference tensors have no version counter
                slot.versions.append((len(slot.outputs), kept, kept._version))
            return kept

        def snapshot(output: Any, slot: _Slot) -> Any:
            written = policy[module]
            copy, learning = written is not False, written is None
            if isinstance(output, Tensor):
                return keep(output, slot, copy, learning)
            return map_tensors(lambda t: keep(t, slot, copy, learning), output)
        return snapshot

    # ----------------------------------------------------------------- in-place safety
    def _finish_learning(self) -> None:
        """Decide, for each module on trial, whether its output was written in place: by the
        version counter, or for inference tensors (which have none) by comparing with the copy."""
        verdict: dict[nn.Module, bool] = {}
        for module, kept, version, pristine in self._learning:
            written = kept._version != version if version is not None else not torch.equal(kept, pristine)
            verdict[module] = verdict.get(module, False) or written
        for module, written in verdict.items():
            _WRITTEN_IN_PLACE[module] = self._policy[module] = written
        self._learning.clear()

    def _check_versions(self) -> None:
        for slot in self._slots.values():
            for call, tensor, version in slot.versions:
                if tensor._version != version:
                    slot.broken.add(call)
                    _WRITTEN_IN_PLACE[slot.target.module] = self._policy[slot.target.module] = True
            slot.versions.clear()
        broken = [f"{k} (calls {sorted(s.broken)})" for k, s in self._slots.items() if s.broken]
        if broken:
            warnings.warn(
                f"captured outputs were overwritten in place after capture: {', '.join(broken)}. "
                f"Their values are wrong and reading them raises. Run the capture again: hookscope "
                f"now copies these modules' outputs (or pass clone=True).", RuntimeWarning, stacklevel=3)

    # ----------------------------------------------------------------- unfired
    def _report_unfired(self) -> None:
        if not self.unfired or self._on_unfired == "ignore":
            return
        lines = "\n".join(f"  - {path}: {why}" for path, why in self.unfired.items())
        n = len(self.unfired)
        message = (f"{n} selected module{'s' if n > 1 else ''} never ran, so no hook fired and "
                   f"nothing was recorded:\n{lines}")
        if self._on_unfired == "error":
            raise HookNeverFiredError(message + "\n(the records of the modules that ran are in "
                                      "err.capture)", capture=self, unfired=self.unfired)
        warnings.warn(message + "\n(pass on_unfired='error' to make this an error, 'ignore' to "
                      "silence it)", HookNeverFiredWarning, stacklevel=3)

    # ----------------------------------------------------------------- reading
    @property
    def paths(self) -> list[str]:
        """Selected record names (paths, with output parts if asked), ``named_modules()`` order."""
        return list(self._slots)

    @property
    def counts(self) -> dict[str, int]:
        """``{path: number of calls recorded}``; 0 for modules that never ran."""
        return {k: len(s.outputs) for k, s in self._slots.items()}

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._slots and bool(self._slots[key].outputs)

    def __iter__(self) -> Iterator[str]:
        return (k for k, s in self._slots.items() if s.outputs)

    def __len__(self) -> int:
        return sum(1 for s in self._slots.values() if s.outputs)

    def __getitem__(self, key: str | tuple[str, int]) -> Any:
        if isinstance(key, tuple):
            path, call = key
            return self._value(path, call)
        slot = self._slot(key)
        if len(slot.outputs) != 1:
            raise CaptureError(
                f"'{key}' ran {len(slot.outputs)} times in this capture, so acts['{key}'] is "
                f"ambiguous: ask for one call with acts['{key}', k] (k = 0 … {len(slot.outputs) - 1}, "
                f"or -1 for the last) or for all with acts.calls('{key}')")
        return self._value(key, 0)

    def calls(self, path: str) -> list[Any]:
        """Every call's output for ``path``, in call order (possibly empty only if it never ran,
        which raises instead)."""
        slot = self._slot(path)
        return [self._value(path, k) for k in range(len(slot.outputs))]

    def inputs(self, path: str, call: int = 0) -> CallInputs:
        """The inputs of call ``call`` of ``path``; needs ``capture(..., inputs=True)``."""
        slot = self._slot(path)
        if not self._options["inputs"]:
            raise CaptureError(f"inputs were not recorded: use hookscope.capture(model, "
                               f"'{path}', inputs=True) to keep them")
        args, kwargs = slot.inputs[self._index(path, slot, call)]
        return CallInputs(args, kwargs, _bind(slot.target.module, args, kwargs))

    def grad(self, path: str, call: int = 0) -> Any:
        """d(loss)/d(output) of call ``call`` of ``path``; same structure and shapes as the output.

        Needs ``capture(..., grads=True)`` and a backward pass (``loss.backward()`` or
        ``torch.autograd.grad``) through that output, inside or after the ``with`` block; each
        backward pass replaces the gradients of the one before. It is the gradient of the value
        the module returned, also when an in-place op (``ReLU(inplace=True)``) rewrites it later.
        In a structured output, a tensor without a gradient is a ``hookscope.NoGrad`` with the
        reason (an integer tensor, a part the loss does not use).

        Raises:
            CaptureError: gradients were not recorded; no tensor of this output requires grad
                (the forward ran under ``torch.no_grad()``, or nothing before it requires
                grad); or no gradient has reached it yet (no backward pass ran through it).
        """
        record = self._grad_record(path, call, "grads")
        if record.watched == 0:
            raise CaptureError(f"call {call} of '{path}' has no gradient because its output "
                               f"cannot have one: {record.first_reason()}")
        if not record.grads:
            raise CaptureError(f"call {call} of '{path}': {NO_GRADIENT_YET}")
        return record.value()

    def grad_calls(self, path: str) -> list[Any]:
        """d(loss)/d(output) for every call of ``path``, in call order (see ``grad``)."""
        return [self.grad(path, k) for k in range(len(self._slot(path).outputs))]

    def grad_input(self, path: str, call: int = 0) -> CallInputs:
        """d(loss)/d(input) of call ``call`` of ``path``: the gradient through this module only.

        Needs ``capture(..., grad_inputs=True)`` and a backward pass. Laid out as ``inputs``:
        ``g[0]`` is the gradient of the first input, ``g["attention_mask"]`` of a named one,
        ``g.args``/``g.kwargs`` as passed. An input that does not require grad (the data fed
        to the first layer, an integer mask), or that got no gradient, is a
        ``hookscope.NoGrad`` whose ``reason`` says so; never a bare ``None``.

        Raises:
            CaptureError: input gradients were not recorded, or ``path``/``call`` does not exist.
        """
        record = self._grad_record(path, call, "grad_inputs")
        args, kwargs = record.value()
        return CallInputs(args, kwargs, _bind(self._slots[path].target.module, args, kwargs))

    def _grad_record(self, path: str, call: int, option: str) -> GradRecord:
        slot = self._slot(path)
        if not self._options[option]:
            raise CaptureError(f"{'input ' if option == 'grad_inputs' else ''}gradients were not "
                               f"recorded: use hookscope.capture(model, '{path}', {option}=True), "
                               f"then call loss.backward()")
        records = slot.grads if option == "grads" else slot.grad_inputs
        return records[self._index(path, slot, call)]

    def save(self, file: str, *, overwrite: bool = True, metadata: dict[str, str] | None = None) -> None:
        """Write every record to one safetensors file, atomically; see ``hookscope.records``
        for the key names (``path``, ``path:k``, ``lstm[1][0]``) and ``hookscope.load``."""
        save_records(self, file, overwrite=overwrite, metadata=metadata)

    def _slot(self, key: str) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            raise CaptureError(f"'{key}' was not selected in this capture; selected: "
                               f"{', '.join(repr(k) for k in list(self._slots)[:8])}"
                               f"{' …' if len(self._slots) > 8 else ''}")
        if not slot.outputs:
            why = self.unfired.get(key, "no forward pass has run yet")
            raise CaptureError(f"'{key}' never ran, so nothing was recorded: {why}")
        return slot

    def _index(self, path: str, slot: _Slot, call: int) -> int:
        n = len(slot.outputs)
        if not -n <= call < n:
            raise CaptureError(f"'{path}' ran {n} time{'s' if n != 1 else ''}; call {call} does "
                               f"not exist (use 0 … {n - 1}, or -1 for the last)")
        return call % n

    def _value(self, path: str, call: int) -> Any:
        slot = self._slot(path)
        k = self._index(path, slot, call)
        if k in slot.broken:
            raise CaptureError(
                f"call {k} of '{path}' was overwritten in place after it was captured (an in-place "
                f"op such as ReLU(inplace=True) or '+=' in the code that uses it), so the kept "
                f"value is wrong. Capture again (hookscope now copies this module's output) or "
                f"pass clone=True")
        return slot.outputs[k]


def _part(output: Any, slot: _Slot) -> Any:
    parts = slot.target.parts
    if not parts:
        return output
    try:
        return get_part(output, parts)
    except KeyError as err:
        raise CaptureError(f"cannot take {slot.target.key!r}: {err.args[0]}") from None


def _shares_memory(kept: Tensor, original: Tensor) -> bool:
    if kept is original or kept._base is original or kept._base is original._base is not None:
        return True
    try:
        return kept.untyped_storage().data_ptr() == original.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without storage (meta, some subclasses)
        return False


def _version(t: Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _copy(t: Tensor) -> Tensor:
    return t.detach().clone()


def _bind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    import inspect
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    bound.apply_defaults()
    return dict(bound.arguments)


def capture(model: nn.Module, *patterns: str, inputs: bool = False, grads: bool = False,
            grad_inputs: bool = False, to: torch.device | str | None = None,
            dtype: torch.dtype | None = None,
            reduce: Callable[[Tensor], Tensor] | None = None, clone: bool | None = None,
            on_unfired: OnUnfired = "warn") -> Capture:
    """Record the output of every call of each module that ``patterns`` select.

    Use it as a context manager; hooks exist only inside the ``with`` block::

        with hookscope.capture(model, "conv2", "pos_block.*.proj.0") as acts:
            model(x)
        acts["conv2"]          # (batch, 16, 10, 10) float32 for LeNet on (batch, 3, 32, 32)

    Args:
        model: root module; ``DataParallel``/``DDP``/``torch.compile`` wrappers are looked through.
        *patterns: paths, ``state_dict()`` keys, globs, ``re:``/``type:`` patterns, optionally
            with output parts (``"lstm[0]"``); see ``hookscope.select``.
        inputs: also keep each call's positional and keyword inputs (``acts.inputs(path, k)``).
        grads: also keep d(loss)/d(output) of each call, filled in when ``backward()`` runs
            through it (``acts.grad(path, k)``); uses tensor hooks, so in-place ops after the
            module, tuple outputs and modules with a legacy backward hook work (``grads.py``).
        grad_inputs: also keep d(loss)/d(input) of each call, the gradient through the module
            only (``acts.grad_input(path, k)``); inputs that do not require grad are marked
            ``NoGrad(reason)``. Each input that requires grad reaches the module as an alias
            (same values and memory) that carries the tensor hook.
        to: device to move captured tensors to (``"cpu"`` frees accelerator memory).
        dtype: dtype to cast captured floating tensors to (e.g. ``torch.float16`` halves memory).
        reduce: function applied to each captured tensor at capture time, e.g.
            ``lambda t: t.mean(dim=(2, 3))`` keeps ``(batch, channels)`` instead of the map.
        clone: ``None`` (default) copies outputs only of modules whose output is written in place
            later (learned on first use, see the module docstring); ``True`` copies always;
            ``False`` never (values overwritten later raise on reading).
        on_unfired: what to do on exit about selected modules that never ran: ``"warn"``
            (``HookNeverFiredWarning``), ``"error"`` (``HookNeverFiredError``, raised after the
            forward finished, records still in ``err.capture``) or ``"ignore"``.

    Returns:
        A ``Capture`` (not yet active: hooks are added by ``with``).

    Raises:
        SelectorError: at once, before any hook exists, when a pattern matches nothing or names a
            container (``ModuleList``) whose hook could never fire.
        HookscopeError: the model cannot be hooked (TorchScript), or an option is invalid.
    """
    return Capture(model, patterns, inputs=inputs, grads=grads, grad_inputs=grad_inputs, to=to,
                   dtype=dtype, reduce=reduce, clone=clone, on_unfired=on_unfired)


def run(model: nn.Module, *args: Any, layers: str | Sequence[str],
        options: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Any, Capture]:
    """Run ``model(*args, **kwargs)`` once while capturing ``layers``; return (output, records).

    Args:
        model: the model to run.
        *args, **kwargs: passed to ``model``.
        layers: one pattern or a list of patterns (see ``capture``).
        options: keyword options of ``capture`` (``inputs``, ``grads``, ``grad_inputs``, ``to``,
            ``dtype``, ``reduce``, ``clone``, ``on_unfired``).

    Returns:
        ``(output, acts)``: what the model returned, and the ``Capture``.

    Raises:
        As ``capture``; an exception inside the forward pass propagates with a note naming the
        innermost module where it happened.
    """
    patterns = [layers] if isinstance(layers, str) else list(layers)
    with capture(model, *patterns, **(options or {})) as acts:
        output = model(*args, **kwargs)
    return output, acts
