"""The capture session: it records what selected modules return (and take, and receive as gradient).

``capture(model, *layers)`` (``verbs.py``) returns one, a context manager (a ``HookSession``, see
``engine.session``). On entry it resolves the patterns ``layers`` (errors come before anything is
registered), then adds one forward hook per selected module; on exit it removes every hook it
added, also on an exception or ``KeyboardInterrupt``, and reports each selected module whose hook never fired.

Captured values stay equal to what the module returned at that moment, even when a later in-place
op writes over its memory, without copying every output: each is kept copy-on-write, and only a
tensor really written later is copied, when the write happens (``engine.values.copy_on_write``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.engine import (
    NO_VALUES_FIX,
    HookSession,
    MaskWatcher,
    OnUnfired,
    OwnedHook,
    RecordingHook,
    Target,
    fullgraph,
    holds_no_values,
    in_recompute,
    keepable,
    kept_note,
    lazy_copy,
    no_values_reason,
    output_of,
    shares_memory,
    special,
    unwrap,
    version_of,
)
from hookscope.errors import CaptureError, warn
from hookscope.record.entries import CallInputs
from hookscope.record.grads import converter, require_grad_mode, watch_inputs, watch_output
from hookscope.record.records import Records
from hookscope.record.reductions import Reduction
from hookscope.record.slots import (
    _by_module,
    _call_of,
    _first_tensor,
    _inputs_hook,
    _keep_input,
    _part,
    _reduced,
    _regrad,
    _Slot,
    _snapshot_of,
)
from hookscope.util import Keys, iter_tensors, map_tensors, map_tensors_with_keys

__all__ = ["Capture", "CaptureOptions", "CallInputs"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class CaptureOptions:
    """What a capture keeps besides each call's output; see ``capture`` for each field."""

    inputs: bool = False
    grads: bool = False
    grad_inputs: bool = False
    to: torch.device | str | None = None
    dtype: torch.dtype | None = None
    reduce: Reduction | None = None
    clone: bool | None = None
    early_stop: bool = False


# Why a capture built but never entered holds nothing (``acts = capture(...)`` without ``with``).
NOT_ENTERED = ("this capture was never entered, so no hook was registered: run the model inside "
               "`with hookscope.capture(model, ...) as acts:`, or use "
               "`output, acts = hookscope.run(model, x, layers=...)`")


class Capture(HookSession, Records):
    """One capture session: the hooks and the in-place policy; build it with ``hookscope.capture``.

    A capture is the ``hookscope.Records`` it fills: ``acts[path]``, ``acts[path, k]``,
    ``acts.calls(path)``, ``acts.save(file)`` and the rest read it, inside the ``with`` block and
    after it; ``unfired`` says why a selected module has no record (also why reading it raises).

    Raises (on reading): as ``Records``.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], options: CaptureOptions,
                 on_unfired: OnUnfired = "warn"):
        HookSession.__init__(self, model, layers, on_unfired)
        kept = [name for name in ("inputs", "grads", "grad_inputs") if getattr(options, name)]
        self._slots = {t.key: _Slot(t) for t in self.targets}
        Records.__init__(self, self._slots.values(), kept)
        self.aliases = {alias + t.key[len(t.path):]: t.key for t in self.targets for alias in t.aliases}
        self.aliases |= {name: t.key for t in self.targets for name in t.standard}  # acts["resid_post.3"]
        self._options = options
        self._grad_convert = converter(options.to, options.dtype)  # applied to each arriving gradient
        # the tokens (attention mask, KV cache length) of the running forward: kept with each
        # record (Records.tokens, .layout), and read by a reduction, as extract gives them
        self._mask = MaskWatcher(unwrap(model)[0])
        self._tokens_seen = False  # a forward so far said something about its tokens
        self.unfired = dict.fromkeys(self._slots, NOT_ENTERED)

    def _before_entry(self) -> None:
        for option in ("grads", "grad_inputs"):
            if getattr(self._options, option):
                require_grad_mode(f"{option}=True")
        self._refuse_in_fullgraph()
        self.unfired = {}

    def _refuse_in_fullgraph(self) -> None:
        """Refuse, on entry, what a ``torch.compile(fullgraph=True)`` graph cannot hold: these
        hooks run outside the graph (``engine.door.hooks._untraced``), which splits it, and
        fullgraph forbids a split (torch would raise its own ``Unsupported`` at the call)."""
        if not fullgraph(self.model):
            return
        options = self._options
        why = {
            "grads=True": "a gradient hook on a value made inside a compiled graph needs "
                          "compiled autograd",
            "grad_inputs=True": "a gradient hook on a value made inside a compiled graph needs "
                                "compiled autograd",
            "early_stop=True": "it ends the forward with an exception, which a graph cannot hold",
        }
        # (function addresses are refused on any compiled model: engine.naming.function_names)
        refused = [name for name in why if getattr(options, name.split("=")[0])]
        if refused:
            first = refused[0]
            raise CaptureError(
                f"{first} cannot run inside torch.compile(model, fullgraph=True): {why[first]}. "
                f"Compile with fullgraph=False (each hooked module then splits the graph, and "
                f"values equal eager), or capture on the eager model (compiled._orig_mod); "
                f"captures of outputs and inputs (to=, dtype=, reduce=, clone=) run inside the full "
                f"graph")

    @property
    def records(self) -> Records:
        """A plain ``Records`` over this capture's values (the same entries, no session)."""
        view = Records(self._entries.values(), self._kept)
        view.unfired, view.notes, view.aliases = self.unfired, self.notes, self.aliases
        return view

    def _register(self) -> None:
        self._snapshot = self._snapshot_fn()  # one per session, shared by every hook
        # a compiled call passes its mask on through ``pick``/``on_kept`` (engine.compile.graph)
        self._own(OwnedHook(self._watch_tokens, unwrap(self.model)[0], pick=self._mask.find,
                            on_kept=self._compiled_tokens), pre=True, with_kwargs=True)
        for _, stack in self._mask.modules[1:]:  # an encoder-decoder's stacks: their own tokens
            self._hook(stack, self._watch_tokens, pre=True, with_kwargs=True)
        on_modules = []
        for slot in self._slots.values():
            if slot.target.op is None:
                on_modules.append(slot)
            else:
                self._hook_output(slot.target, self._function_hook(slot), with_kwargs=self._options.inputs)
        if self._plain_options() and not any(s.target.parts for s in on_modules):
            # the hot path: one record of its whole output per module (each module is selected
            # once), registered in bulk in module order
            thread = threading.get_ident()
            self._own_forward([RecordingHook(slot.outputs, slot.target.module,
                                             _snapshot_of(self._snapshot, slot), thread)
                               for slot in on_modules])
        else:
            for module, slots in _by_module(on_modules).items():
                self._register_module(module, slots)
        if self._options.early_stop:
            self._stop_early()

    def _watch_tokens(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The root's pre-hook: read this forward's ``Tokens`` (``_note_tokens``)."""
        self._mask.hook(module, args, kwargs)
        self._note_tokens()

    def _compiled_tokens(self, mask: Tensor | None) -> None:
        """The root's pre-hook inside a compiled graph: the call's mask only."""
        self._mask.set(mask)
        self._note_tokens()

    def _note_tokens(self) -> None:
        """Once any forward has said something about its tokens, note from which call on each
        record has them (one ``(len(outputs), tokens)`` per record per forward; nothing for a
        model called without a mask or cache)."""
        tokens = self._mask.tokens
        if not (tokens.known or self._tokens_seen):
            return
        self._tokens_seen = True
        for slot in self._slots.values():
            slot.runs.append((len(slot.outputs), tokens))

    def _register_module(self, module: nn.Module, slots: list[_Slot]) -> None:
        """The hooks of one module whose records need more than the output as it is (inputs,
        gradients, conversions, output parts): one forward hook serves all its records."""
        if self._options.inputs:  # before the call: a module may write its input in place
            hook, kept = _inputs_hook(slots, self._options.clone)
            self._own(OwnedHook(hook, module, pick=_call_of, on_kept=kept), pre=True, with_kwargs=True)
        # with grads, a checkpoint recompute reaches the hook: under reentrant checkpointing
        # the gradient flows only through the recomputed output (_regrad)
        # without grads the hook reads the output only: a compiled graph holds it (output_of)
        grads = self._options.grads
        self._own(OwnedHook(self._make_hook(slots), module, in_recompute=grads,
                            pick=None if grads else output_of))
        if self._options.grad_inputs:
            self._hook(module, watch_inputs([s.grad_inputs for s in slots], self._grad_convert),
                       pre=True, with_kwargs=True)

    def _finish(self) -> None:
        for key, function in self._functions.functions.items():
            self._slots[key].function = function
        self._note_valueless()
        if self._options.clone is False:
            self._check_versions()
            self._warn_unverifiable()

    def _ran_paths(self) -> set[str]:
        # selected modules are known to have run by their records: their hooks skip ran.add()
        return self._ran | {s.target.path for s in self._slots.values() if s.outputs}

    # ----------------------------------------------------------------- hooks
    def _plain_options(self) -> bool:
        """True when no option asks for more than the output as it is: a module with one
        record of its whole output then takes the hot path (``engine.RecordingHook``)."""
        options = self._options
        return options.clone is None and not (options.inputs or options.grads or options.grad_inputs
                                              or options.to is not None or options.dtype is not None
                                              or options.reduce is not None)

    def _make_hook(self, slots: list[_Slot]) -> Callable[..., None]:
        snapshot = self._snapshot
        with_grads, grad_now = self._options.grads, self._grad_now

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_recompute():
                _regrad(slots, output, grad_now)
                return
            for slot in slots:
                slot.outputs.append(snapshot(_part(output, slot), slot))
            if with_grads:
                for slot in slots:
                    slot.grads.append(watch_output(_part(output, slot), grad_now(slot.target)))
        return hook

    def _function_hook(self, slot: _Slot) -> Callable[..., None]:
        """Record each call of a function-level target: its output (the selected part), kept as
        ``snapshot`` keeps module outputs (copy-on-write unless ``clone`` says otherwise; values
        made inside a forward are often written in place by the code that follows,
        ``x += ...``); with ``inputs=True`` the function's arguments; with ``grads=True`` a
        gradient watch."""
        options, entry, snapshot, grad_now = self._options, slot, self._snapshot, self._grad_now
        clone = options.clone

        def keep_input(t: Tensor) -> Tensor:
            return _keep_input(t, clone)

        def hook(module: nn.Module, args: Any, *rest: Any) -> None:
            output = _part(rest[-1], slot)
            entry.outputs.append(snapshot(output, slot))
            if options.inputs:
                entry.inputs.append((map_tensors(keep_input, args), map_tensors(keep_input, rest[0])))
            if options.grads:
                entry.grads.append(watch_output(output, grad_now(slot.target)))
        return hook

    def _grad_now(self, target: Target) -> Callable[[Tensor], Tensor]:
        """The conversion of the gradient of the call running now: ``to``/``dtype``, then
        ``reduce`` with this forward's attention mask (bound now: the backward pass may come
        after other forwards), so a gradient has the shape of its reduced output."""
        reduce, base = self._options.reduce, self._grad_convert
        if reduce is None:
            return base
        frozen = copy.copy(self._mask)  # the watcher's mask as of this call

        def convert(grad: Tensor) -> Tensor:
            grad = base(grad)
            return _reduced(reduce, grad, frozen, target, ())
        return convert

    def _snapshot_fn(self) -> Callable[[Any, _Slot], Any]:
        """Return ``snapshot(output, slot)``: the output with each tensor detached, converted,
        reduced, and kept safe from later in-place writes as ``clone`` asks
        (``engine.values.copy_on_write``)."""
        to, dtype, reduce = self._options.to, self._options.dtype, self._options.reduce
        converts = to is not None or dtype is not None or reduce is not None
        clone, watcher = self._options.clone, self._mask

        def one(t: Tensor, slot: _Slot, keys: Keys = ()) -> Tensor:
            if special(t):  # quantized: dequantized; DTensor: global; in a functorch transform: refused
                t = self._keepable(t, slot)
            kept = t.detach()
            if converts:
                if to is not None or dtype is not None:
                    kept = kept.to(device=to, dtype=dtype)
                if reduce is not None:
                    kept = _reduced(reduce, kept, watcher, slot.target, keys)
                if not shares_memory(kept, t):
                    return kept
            if clone is None:
                return lazy_copy(kept)
            if clone:
                return kept.clone()
            counter = version_of(kept)
            if counter is not None:  # inference tensors have no version counter
                slot.versions.append((len(slot.outputs), kept, counter))
            return kept

        def snapshot(output: Any, slot: _Slot) -> Any:
            if isinstance(output, Tensor):
                return one(output, slot)
            return map_tensors_with_keys(lambda t, keys: one(t, slot, keys), output)
        return snapshot

    def _keepable(self, t: Tensor, slot: _Slot) -> Tensor:
        note = kept_note(t)
        if note is not None:
            self.notes.setdefault(slot.target.key, note)
        return keepable(t, slot.target.key)

    def _note_valueless(self) -> None:
        """Records of meta tensors or FakeTensors (a traced or meta-device model) hold shapes
        only: note each (``acts.notes``) and warn once, so none passes for a value. Each record's
        first call is checked, on exit (nothing is checked per call)."""
        empty = {}
        for key, slot in self._slots.items():
            outputs = slot.outputs
            if not outputs:
                continue
            first = outputs[0]
            if type(first) is Tensor:  # most records: a plain tensor, checked inline
                if not first.is_meta:
                    continue
            else:
                first = _first_tensor(outputs)
            if first is not None and holds_no_values(first):
                empty[key] = self.notes[key] = f"{no_values_reason(first)}: shapes, no values"
        if empty:
            warn(f"the records of {', '.join(list(empty)[:5])}{' …' if len(empty) > 5 else ''} "
                 f"hold {next(iter(empty.values()))}; saving them, stats and extract refuse "
                 f"them. To get values, {NO_VALUES_FIX}", RuntimeWarning)

    def _warn_unverifiable(self) -> None:
        """clone=False under torch.inference_mode(): nothing can tell whether the references kept
        were written in place later, so say so rather than return them as if checked."""
        unchecked = [k for k, s in self._slots.items()
                     if any(t.is_inference() for o in s.outputs for t in iter_tensors(o))]
        if unchecked:
            warn(
                f"clone=False under torch.inference_mode(): the outputs of {', '.join(unchecked[:5])}"
                f"{' …' if len(unchecked) > 5 else ''} are kept by reference and inference tensors "
                f"have no version counter, so an in-place write after capture (ReLU(inplace=True), "
                f"'+=') would go unnoticed. Use clone=None (the default) or clone=True, or run "
                f"under torch.no_grad()", RuntimeWarning)

    def _check_versions(self) -> None:
        """clone=False: mark each reference whose version counter moved since capture."""
        for slot in self._slots.values():
            for call, tensor, counter in slot.versions:
                if tensor._version != counter:
                    slot.broken.add(call)
            slot.versions.clear()
        broken = [f"{k} (calls {sorted(s.broken)})" for k, s in self._slots.items()
                  if s.broken]
        if broken:
            warn(
                f"captured outputs were overwritten in place after capture: {', '.join(broken)}. "
                f"Their values are wrong and reading them raises. Capture again with clone=None "
                f"(the default: copy-on-write) or clone=True.", RuntimeWarning)

    # ----------------------------------------------------------------- live records
    def clear(self) -> None:
        """Drop every record so far and keep the hooks: one capture can serve many batches
        (``with capture(...) as acts: for x in batches: model(x); use(acts); acts.clear()``)."""
        super().clear()
        for slot in self._slots.values():
            slot.versions.clear()

    def check_writes(self) -> None:
        """With ``clone=False``, check the outputs kept by reference so far, as leaving the
        ``with`` block does: one written in place since its call is marked (reading it raises).
        For loops that read records inside the block, before ``clear()``. (The default
        copy-on-write records cannot be overwritten, so there is nothing to check.)"""
        self._check_versions()


