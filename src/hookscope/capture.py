"""Capture: record what selected modules return (and take, and receive as gradient) on every call.

``capture(model, *patterns)`` is a context manager (a ``HookSession``, see ``_session.py``). On
entry it resolves the patterns (errors come before anything is registered), then adds one forward
hook per selected module; on exit it removes every hook it added, also on an exception or
``KeyboardInterrupt``, checks that no captured value was overwritten in place, and reports each
selected module whose hook never fired.

Captured values stay equal to what the module returned at that moment, even when a later in-place
op writes over its memory, without copying every output: see ``_inplace.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookscope._inplace import InPlacePolicy, shares_memory
from hookscope._nested import get_part, iter_tensors, map_tensors
from hookscope._session import HookSession, OnUnfired, by_module
from hookscope.errors import CaptureError
from hookscope.grads import converter, watch_inputs, watch_output
from hookscope.records import CallInputs, Entry, RecordKey, Records
from hookscope.select import Target, as_patterns, unwrap

__all__ = ["Capture", "CaptureOptions", "CallInputs", "capture", "run"]  # CallInputs: records.py

Tensor = torch.Tensor


@dataclass(frozen=True)
class CaptureOptions:
    """What a capture keeps besides each call's output; see ``capture`` for each field."""

    inputs: bool = False
    grads: bool = False
    grad_inputs: bool = False
    to: torch.device | str | None = None
    dtype: torch.dtype | None = None
    reduce: Callable[[Tensor], Tensor] | None = None
    clone: bool | None = None
    early_stop: bool = False


class _Slot:
    """One target's record entry, plus the references kept with their versions (session state)."""

    __slots__ = ("target", "entry", "versions")

    def __init__(self, target: Target, entry: Entry):
        self.target = target
        self.entry = entry
        self.versions: list[tuple[int, Tensor, int]] = []  # (call, tensor kept by reference, version)


class Capture(HookSession):
    """One capture session: the hooks and the in-place policy; build it with ``hookscope.capture``.

    What it recorded is ``self.records`` (a ``hookscope.Records``); the session reads through to
    it, so ``acts[path]``, ``acts[path, k]``, ``acts.calls(path)``, ``acts.save(file)`` and the
    rest work on the session itself, inside the ``with`` block and after it.

    Raises (on reading): as ``Records``.
    """

    def __init__(self, model: nn.Module, patterns: Sequence[str], options: CaptureOptions,
                 on_unfired: OnUnfired = "warn"):
        super().__init__(model, patterns, on_unfired)
        kept = [name for name in ("inputs", "grads", "grad_inputs") if getattr(options, name)]
        self.records = Records((Entry(t.key, t.module) for t in self.targets), kept)
        self._slots = {t.key: _Slot(t, self.records.entry(t.key)) for t in self.targets}
        self._options = options
        self._grad_convert = converter(options.to, options.dtype)  # applied to each arriving gradient
        self._policy = InPlacePolicy(options.clone)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        try:
            return super().__exit__(exc_type, exc, tb)  # True: this capture's early stop ended it
        finally:
            self.records.unfired = self.unfired  # so reading a silent module says why

    def _register(self) -> None:
        for module, targets in by_module(self.targets).items():
            slots = [self._slots[t.key] for t in targets]
            self._add(module.register_forward_hook(self._make_hook(module, slots),
                                                   with_kwargs=self._options.inputs))
            if self._options.grad_inputs:
                self._add(module.register_forward_pre_hook(
                    watch_inputs([s.entry.grad_inputs for s in slots], self._grad_convert), with_kwargs=True))
        root, _ = unwrap(self.model)
        self._add(root.register_forward_hook(lambda module, args, output: self._policy.end_pass()))
        if self._options.early_stop:
            self._stop_early()

    def _finish(self) -> None:
        self._policy.end_pass()
        self._check_versions()
        if self._options.clone is False:
            self._warn_unverifiable()

    def _ran_paths(self) -> set[str]:
        # selected modules are known to have run by their records: their hooks skip ran.add()
        return self._ran | {s.target.path for s in self._slots.values() if s.entry.outputs}

    # ----------------------------------------------------------------- hooks
    def _make_hook(self, module: nn.Module, slots: list[_Slot]) -> Callable[..., None]:
        snapshot = self._snapshot_fn(module)
        options = self._options
        single = slots[0] if len(slots) == 1 and not slots[0].target.parts else None
        if single is not None and not (options.inputs or options.grads or options.to is not None
                                       or options.dtype is not None or options.reduce is not None):
            return self._plain_hook(module, single, snapshot)
        with_inputs, with_grads, convert = options.inputs, options.grads, self._grad_convert

        def hook(module: nn.Module, args: Any, *rest: Any) -> None:
            output = rest[-1]
            for slot in slots:
                slot.entry.outputs.append(snapshot(_part(output, slot), slot))
            if with_inputs:
                kwargs = rest[0] if len(rest) == 2 else {}
                for slot in slots:
                    slot.entry.inputs.append((map_tensors(_copy, args), map_tensors(_copy, kwargs)))
            if with_grads:
                for slot in slots:
                    slot.entry.grads.append(watch_output(_part(output, slot), convert))
        return hook

    def _plain_hook(self, module: nn.Module, slot: _Slot,
                    snapshot: Callable[[Any, _Slot], Any]) -> Callable[..., None]:
        """The hot path: one record of the whole output, no options. A tensor output of a module
        known to be safe is kept by reference with its version; anything else goes through
        ``snapshot``. Per call this costs about what a bare hook appending ``detach()`` costs."""
        outputs, versions, verdicts = slot.entry.outputs, slot.versions, self._policy.copy

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if type(output) is Tensor and verdicts[module] is False:
                kept = output.detach()
                if not kept.is_inference():  # inference tensors have no version counter
                    versions.append((len(outputs), kept, kept._version))
                outputs.append(kept)
            else:
                outputs.append(snapshot(output, slot))
        return hook

    def _snapshot_fn(self, module: nn.Module) -> Callable[[Any, _Slot], Any]:
        """Return ``snapshot(output, slot)``: the output with each tensor detached, converted,
        reduced, and copied when the in-place policy says so (decided once per call)."""
        to, dtype, reduce = self._options.to, self._options.dtype, self._options.reduce
        converts = to is not None or dtype is not None or reduce is not None
        policy = self._policy
        policy.watch(module)
        verdicts = policy.copy

        def keep(t: Tensor, slot: _Slot, copy: bool, on_trial: bool) -> Tensor:
            kept = t.detach()
            if converts:
                if to is not None or dtype is not None:
                    kept = kept.to(device=to, dtype=dtype)
                if reduce is not None:
                    kept = reduce(kept)
                if not shares_memory(kept, t):
                    return kept
            if copy:
                pristine = kept.clone()
                if on_trial:
                    policy.on_trial(module, kept, pristine)
                return pristine
            if not kept.is_inference():  # inference tensors have no version counter
                slot.versions.append((len(slot.entry.outputs), kept, kept._version))
            return kept

        def snapshot(output: Any, slot: _Slot) -> Any:
            written = verdicts[module]
            copy, on_trial = written is not False, written is None
            if isinstance(output, Tensor):
                return keep(output, slot, copy, on_trial)
            return map_tensors(lambda t: keep(t, slot, copy, on_trial), output)
        return snapshot

    def _warn_unverifiable(self) -> None:
        """clone=False under torch.inference_mode(): nothing can tell whether the references kept
        were written in place later, so say so rather than return them as if checked."""
        unchecked = [k for k, s in self._slots.items()
                     if any(t.is_inference() for o in s.entry.outputs for t in iter_tensors(o))]
        if unchecked:
            warnings.warn(
                f"clone=False under torch.inference_mode(): the outputs of {', '.join(unchecked[:5])}"
                f"{' …' if len(unchecked) > 5 else ''} are kept by reference and inference tensors "
                f"have no version counter, so an in-place write after capture (ReLU(inplace=True), "
                f"'+=') would go unnoticed. Use clone=None (the default) or clone=True, or run "
                f"under torch.no_grad()", RuntimeWarning, stacklevel=4)

    def _check_versions(self) -> None:
        for slot in self._slots.values():
            for call, tensor, counter in slot.versions:
                if tensor._version != counter:
                    slot.entry.broken.add(call)
                    self._policy.mark(slot.target.module, True)
            slot.versions.clear()
        broken = [f"{k} (calls {sorted(s.entry.broken)})" for k, s in self._slots.items()
                  if s.entry.broken]
        if broken:
            warnings.warn(
                f"captured outputs were overwritten in place after capture: {', '.join(broken)}. "
                f"Their values are wrong and reading them raises. Run the capture again: hookscope "
                f"now copies these modules' outputs (or pass clone=True).", RuntimeWarning, stacklevel=4)

    # ----------------------------------------------------------------- live records
    def clear(self) -> None:
        """Drop every record so far and keep the hooks: one capture can serve many batches
        (``with capture(...) as acts: for x in batches: model(x); use(acts); acts.clear()``)."""
        self.records.clear()
        for slot in self._slots.values():
            slot.versions.clear()

    @property
    def paths(self) -> list[str]:
        """See ``Records.paths``."""
        return self.records.paths

    @property
    def counts(self) -> dict[str, int]:
        """See ``Records.counts``."""
        return self.records.counts

    def items(self) -> Iterator[tuple[RecordKey, Tensor]]:
        """See ``Records.items``."""
        return self.records.items()

    def __contains__(self, key: object) -> bool:
        return key in self.records

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: str | tuple[str, int] | RecordKey) -> Any:
        return self.records[key]

    def __repr__(self) -> str:
        return repr(self.records).replace("hookscope.Records", "hookscope.Capture", 1)

    def calls(self, path: str) -> list[Any]:
        """See ``Records.calls``."""
        return self.records.calls(path)

    def inputs(self, path: str, call: int = 0) -> CallInputs:
        """See ``Records.inputs``."""
        return self.records.inputs(path, call)

    def grad(self, path: str, call: int = 0) -> Any:
        """See ``Records.grad``."""
        return self.records.grad(path, call)

    def grad_calls(self, path: str) -> list[Any]:
        """See ``Records.grad_calls``."""
        return self.records.grad_calls(path)

    def grad_input(self, path: str, call: int = 0) -> CallInputs:
        """See ``Records.grad_input``."""
        return self.records.grad_input(path, call)

    def save(self, file: str, *, overwrite: bool = True, metadata: dict[str, str] | None = None) -> None:
        """See ``Records.save``."""
        self.records.save(file, overwrite=overwrite, metadata=metadata)


def _part(output: Any, slot: _Slot) -> Any:
    parts = slot.target.parts
    if not parts:
        return output
    try:
        return get_part(output, parts)
    except KeyError as err:
        raise CaptureError(f"cannot take {slot.target.key!r}: {err.args[0]}") from None


def _copy(t: Tensor) -> Tensor:
    return t.detach().clone()


def capture(model: nn.Module, *patterns: str, inputs: bool = False, grads: bool = False,
            grad_inputs: bool = False, to: torch.device | str | None = None,
            dtype: torch.dtype | None = None,
            reduce: Callable[[Tensor], Tensor] | None = None, clone: bool | None = None,
            early_stop: bool = False, on_unfired: OnUnfired = "warn") -> Capture:
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
            later (learned on first use, see ``_inplace.py``); ``True`` copies always;
            ``False`` never: values overwritten later raise on reading, except under
            ``torch.inference_mode()``, whose tensors have no version counter (a warning says so).
        early_stop: stop the forward pass once every selected module has returned in it: the
            rest of the model does not run (faster in proportion), the forward call does not
            return, and the ``with`` block ends there, cleanly (hooks removed, model untouched,
            records kept): make the forward the block's last statement, or use
            ``run(..., options={"early_stop": True})``, which returns ``(None, acts)``. A module
            called again later in the same pass (shared weights) keeps its first call only.
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
    if early_stop and (grads or grad_inputs):
        raise CaptureError("early_stop=True ends the forward before the model's output exists, so "
                           "no loss and no backward pass can reach the captured modules: drop "
                           "early_stop to record gradients (grads=True / grad_inputs=True)")
    options = CaptureOptions(inputs=inputs, grads=grads, grad_inputs=grad_inputs, to=to,
                             dtype=dtype, reduce=reduce, clone=clone, early_stop=early_stop)
    return Capture(model, patterns, options, on_unfired)


def run(model: nn.Module, *args: Any, layers: str | Sequence[str],
        options: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Any, Capture]:
    """Run ``model(*args, **kwargs)`` once while capturing ``layers``; return (output, records).

    Args:
        model: the model to run.
        *args, **kwargs: passed to ``model``.
        layers: one pattern or a list of patterns (see ``capture``).
        options: keyword options of ``capture`` (``inputs``, ``grads``, ``grad_inputs``, ``to``,
            ``dtype``, ``reduce``, ``clone``, ``early_stop``, ``on_unfired``). They travel in
            one dict, not as keywords, because ``**kwargs`` belong to the model: a forward that
            takes ``inputs=``, ``to=`` or ``dtype=`` (Hugging Face models take
            ``inputs_embeds``, ``output_attentions``, ...) must get them untouched, and a capture
            option spelled as a keyword could silently shadow one of them.

    Returns:
        ``(output, acts)``: what the model returned (``None`` when ``early_stop`` cut it
        short), and the ``Capture``.

    Raises:
        As ``capture``; an exception inside the forward pass propagates with a note naming the
        innermost module where it happened.
    """
    patterns = as_patterns(layers)
    output = None
    with capture(model, *patterns, **(options or {})) as acts:
        output = model(*args, **kwargs)
    return output, acts
