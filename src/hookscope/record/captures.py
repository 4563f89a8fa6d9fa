"""Capture: record what selected modules return (and take, and receive as gradient) on every call.

``capture(model, *layers)`` is a context manager (a ``HookSession``, see ``engine.session``). On
entry it resolves the patterns ``layers`` (errors come before anything is registered), then adds
one forward hook per selected module; on exit it removes every hook it added, also on an exception or
``KeyboardInterrupt``, and reports each selected module whose hook never fired.

Captured values stay equal to what the module returned at that moment, even when a later in-place
op writes over its memory, without copying every output: each is kept copy-on-write, and only a
tensor really written later is copied, when the write happens (``engine.values.copy_on_write``).
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
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
    as_patterns,
    batch_first,
    check_device,
    check_dtype,
    check_flag,
    check_model,
    check_no_unmasked_padding,
    check_options,
    eager_copy,
    flat_patterns,
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
    token_axes,
    unwrap,
    version_of,
)
from hookscope.errors import CaptureError, warn
from hookscope.record.entries import CallInputs, Entry
from hookscope.record.grads import converter, require_grad_mode, watch_inputs, watch_output
from hookscope.record.records import RecordKey, Records
from hookscope.record.reductions import REDUCTIONS, Reduce, Reduction, reduction
from hookscope.util import Keys, get_part, iter_tensors, map_tensors, map_tensors_with_keys

__all__ = ["Capture", "CaptureOptions", "CallInputs", "capture", "run", "capture_options"]

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


class _Slot(Entry):
    """One target's record entry, plus the session's state for it: the target, the references
    kept with their versions. One object per selected module (with its hook)."""

    __slots__ = ("target", "versions", "recomputed")

    def __init__(self, target: Target):
        Entry.__init__(self, None, target.module, target.key)
        self.target = target
        self.versions: list[tuple[int, Tensor, int]] = []  # (call, tensor kept by reference, version)
        self.recomputed = 0  # checkpoint recomputes seen (with grads=True)

    def _make_key(self) -> RecordKey:
        return self.target.record_key


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


def _by_module(slots: list[_Slot]) -> dict[nn.Module, list[_Slot]]:
    """``slots`` grouped by module, in order: one hook per module serves all its records."""
    grouped: dict[nn.Module, list[_Slot]] = {}
    for slot in slots:
        grouped.setdefault(slot.target.module, []).append(slot)
    return grouped


def _snapshot_of(snapshot: Callable[[Any, _Slot], Any], slot: _Slot) -> Callable[[Any], Any]:
    """``snapshot`` for ``slot``'s outputs: what its ``RecordingHook`` keeps of an output."""
    return lambda output: snapshot(output, slot)


def _first_tensor(outputs: list[Any]) -> Tensor | None:
    """The first tensor of a record's first call (a plain tensor output, most often: no walk)."""
    if outputs and type(outputs[0]) is Tensor:
        return outputs[0]
    return next(iter_tensors(outputs[:1]), None)


def _reduced(reduce: Reduction, t: Tensor, watcher: MaskWatcher, target: Target,
             keys: Keys) -> Tensor:
    """``reduce`` of ``t`` (part ``keys`` of what ``target`` selects) seen as ``(batch, seq,
    ...)`` (``engine.values.layout.batch_first``: a sequence-first or length-last output moved so),
    with the attention mask of the running forward (None without one), on ``t``'s device.

    Raises:
        PositionError: ``reduce`` is one of the named token reductions (``"first"``,
            ``"last"``, ``"mean"``) and the input looks padded without a mask
            (``engine.values.layout.check_no_unmasked_padding``), or ``t`` has no token axis (an
            RNN's final state)."""
    module, parts = (target.module if target.op is None else None), (*target.parts, *keys)
    axes = token_axes(module, parts, t.dim())
    if reduce in REDUCTIONS.values():
        check_no_unmasked_padding(watcher.tokens, "a reduction over tokens (reduce='first', "
                                  "'last' or 'mean')", positions=False)
        if axes[1] is None:  # refused, the message names it
            watcher.layout(f"{target.key}{''.join(f'[{k}]' for k in keys)}", target.op, t.shape,
                           module=module, parts=parts)
    t = batch_first(t, axes)
    mask = watcher.mask_for(t.shape)
    return reduce(t, None if mask is None else mask.to(t.device))


def _part(output: Any, slot: _Slot) -> Any:
    parts = slot.target.parts
    if not parts:
        return output
    try:
        return get_part(output, parts)
    except KeyError as err:
        raise CaptureError(f"cannot take {slot.target.key!r}: {err.args[0]}") from None


def _keep_input(t: Tensor, clone: bool | None) -> Tensor:
    """An input as the module received it, safe from later in-place writes
    (``engine.values.copy_on_write``)."""
    t = keepable(t, "an input")
    return eager_copy(t) if clone else lazy_copy(t)


def _regrad(slots: list[_Slot], output: Any,
            convert: Callable[[Target], Callable[[Tensor], Tensor]]) -> None:
    """A checkpoint recompute of a call whose output could not take a gradient (reentrant
    checkpointing runs the first forward under no_grad): watch the recomputed output instead,
    which is what the gradient flows through. Recomputes come in call order within a segment."""
    for slot in slots:
        grads = slot.grads
        if not grads:
            continue
        call = slot.recomputed % len(grads)
        slot.recomputed += 1
        if grads[call].watched == 0:
            grads[call] = watch_output(_part(output, slot), convert(slot.target))


def _inputs_hook(slots: list[_Slot], clone: bool | None
                 ) -> tuple[Callable[..., None], Callable[[Any], None]]:
    """A forward pre-hook keeping each call's inputs as the module receives them, and its
    ``on_kept`` for a call inside a compiled graph (``engine.compile.graph``): ``(args, kwargs)``
    already copied, an argument the graph cannot hand out as ``NotKept``."""
    def keep(t: Tensor) -> Tensor:
        return _keep_input(t, clone)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for slot in slots:
            slot.inputs.append((map_tensors(keep, args), map_tensors(keep, kwargs)))

    def kept(call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        for slot in slots:
            slot.inputs.append((call[0], dict(call[1])))
    return hook, kept


def _call_of(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``pick`` of the inputs pre-hook: the call's arguments and keywords."""
    return args, kwargs


def capture(model: nn.Module, *layers: str | Sequence[str], inputs: bool = False, grads: bool = False,
            grad_inputs: bool = False, to: torch.device | str | None = None,
            dtype: torch.dtype | None = None, reduce: Reduce = None, clone: bool | None = None,
            early_stop: bool = False, on_unfired: OnUnfired = "warn") -> Capture:
    """Record the output of every call of each module that ``layers`` select.

    Use it as a context manager; hooks exist only inside the ``with`` block:

    ```python
    with hookscope.capture(model, "conv2", "pos_block.*.proj.0") as acts:
        model(x)
    acts["conv2"]          # (batch, 16, 10, 10) float32 for LeNet on (batch, 3, 32, 32)
    ```

    Args:
        model: root module; ``DataParallel``/``DDP``/``torch.compile`` wrappers are looked through.
        *layers: patterns: paths, ``state_dict()`` keys, globs, ``re:``/``type:`` patterns, optionally
            with output parts (``"lstm[0]"``); see ``hookscope.select``. A function-level
            address ``PATTERN::NAME`` records every call of function ``NAME`` made by the own
            forward of the modules selected (``"::relu"``, ``"h.*.attn::softmax"``;
            ``"::relu#1"`` for call 1 of each forward), each value copied unless ``clone=False``.
            A list of patterns stands for its patterns: ``capture(model, ["fc1", "fc2"])``.
        inputs: also keep each call's positional and keyword inputs (``acts.inputs(path, k)``);
            for a function-level address, its arguments bound to the function's parameters.
        grads: also keep d(loss)/d(output) of each call, filled in when ``backward()`` runs
            through it (``acts.grad(path, k)``); uses tensor hooks, so in-place ops after the
            module, tuple outputs and modules with a legacy backward hook work (``grads.py``).
            Several backward passes through one forward accumulate, as ``.grad`` does.
        grad_inputs: also keep d(loss)/d(input) of each call, the gradient through the module
            only (``acts.grad_input(path, k)``); inputs that do not require grad are marked
            ``NoGrad(reason)``. Each input that requires grad reaches the module as an alias
            (same values and memory) that carries the tensor hook.
        to: device to move captured tensors to (``"cpu"`` frees accelerator memory).
        dtype: floating dtype to cast captured floating tensors to (e.g. ``torch.float16``
            halves memory); integer dtypes are refused.
        reduce: applied to each captured tensor at capture time: a named reduction as
            ``extract`` takes (``"mean"``, ``"first"``, ``"last"``; ``hookscope.reductions`` says
            which axis each uses), which counts only the real tokens of the ``attention_mask``
            the model is called with (by keyword or position), so its rows equal ``extract``'s;
            or a function of the output, e.g. ``lambda t: t.mean(dim=(2, 3))`` keeps
            ``(batch, channels)``. With ``grads=True`` each gradient is reduced the same way
            (with the mask of its own forward), so ``acts.grad(path)`` has the shape of
            ``acts[path]``; inputs and their gradients (``grad_inputs``) are kept whole.
        clone: ``None`` (default) keeps each tensor copy-on-write: nothing is copied unless a
            later in-place op writes it, and then only that tensor, just before the write (the
            writer gets the copy; exact in every grad mode, see ``engine.values.copy_on_write``); ``True``
            copies every tensor at once; ``False`` keeps plain references: values overwritten
            later raise on reading, except under ``torch.inference_mode()``, whose tensors have
            no version counter (a warning says so).
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

    The forwards in the block are the user's own: their effects stay (a model in training mode
    updates its BatchNorm statistics, advances spectral norm, draws dropout masks), as without
    the capture. The verbs that run forwards of their own (``tree``, ``stats``, ``gradcam`` ...)
    restore the model afterwards instead.

    Raises:
        SelectorError: at once, before any hook exists, when a pattern matches nothing or names a
            container (``ModuleList``) whose hook could never fire.
        CaptureError: on entering the block, with ``grads``/``grad_inputs``, under
            ``torch.no_grad()`` or ``torch.inference_mode()``: no gradient could be recorded
            there (the message gives the fix: ``torch.enable_grad()``, or leave inference
            mode; switching gradients off inside the block is allowed and marks ``NoGrad``).
        ReductionError: ``reduce`` is not a known name or a function (at once); a ``reduce``
            function that returns something other than a tensor (at its first call).
        ArgumentTypeError: at once, ``model`` is not an ``nn.Module``; a flag (``inputs``,
            ``grads``, ``grad_inputs``, ``clone``, ``early_stop``) is not a ``bool``
            (``grads="yes"`` is refused, not read as true); ``to``/``dtype`` of the wrong type.
        ArgumentValueError: at once, ``to`` is not a device this machine has
            (``"nodevice"``, ``"cuda:7"``); ``dtype`` is not floating (``torch.int8`` would
            truncate every activation).
        HookscopeError: the model cannot be hooked (TorchScript), or an option is invalid.
    """
    if early_stop and (grads or grad_inputs):
        raise CaptureError("early_stop=True ends the forward before the model's output exists, so "
                           "no loss and no backward pass can reach the captured modules: drop "
                           "early_stop to record gradients (grads=True / grad_inputs=True)")
    _check_options(inputs=inputs, grads=grads, grad_inputs=grad_inputs, early_stop=early_stop,
                   to=to, dtype=dtype, clone=clone)
    reducer = reduction(reduce)
    options = CaptureOptions(inputs=inputs, grads=grads, grad_inputs=grad_inputs, to=to, dtype=dtype,
                             reduce=reducer,
                             clone=clone, early_stop=early_stop)
    return Capture(model, flat_patterns(layers), options, on_unfired)


def _check_options(*, to: object, dtype: object, clone: object, **flags: object) -> None:
    """Refuse a bad capture option at construction (``engine.checks``): a flag that is not a
    bool, a device torch cannot parse or this machine lacks, a dtype that is not floating."""
    for name, value in flags.items():
        check_flag(name, value)
    if clone is not None:
        check_flag("clone", clone)
    check_device("to", to)
    check_dtype("dtype", dtype, floating=True)


def run(model: nn.Module, *args: Any, layers: str | Sequence[str],
        options: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Any, Capture]:
    """Run ``model(*args, **kwargs)`` once while capturing ``layers``; return (output, records).

    Args:
        model: the model to run.
        *args, **kwargs: passed to ``model``. A mapping given as the only input (a dict, the
            ``BatchEncoding`` a Hugging Face tokenizer returns) is passed as keyword arguments,
            ``model(**mapping)``, when its keys are parameters of ``model.forward``.
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
        CaptureError: a keyword is a capture option (``grads=True``) that ``model.forward``
            does not name as a parameter: it would reach the model's ``**kwargs`` silently.
        ArgumentTypeError: ``options`` is not a dict, or ``layers`` is ``None``.
        ArgumentValueError: ``options`` holds a key that is not an option of ``capture``.
    """
    check_model(model)
    patterns = as_patterns(layers)
    check_options("options", options, capture_options())
    _refuse_options_as_keywords(model, kwargs)
    args, kwargs = _as_keywords(model, args, kwargs)
    output = None
    block = capture(model, *patterns, **(options or {}))
    with block as acts:
        output = model(*args, **kwargs)
    return output, acts


def capture_options() -> set[str]:
    """The names of ``capture``'s keyword options (what ``run(options=)`` and
    ``capture_generation(**options)`` may hold)."""
    return set(inspect.signature(capture).parameters) - {"model", "layers"}


def _refuse_options_as_keywords(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise when a keyword meant for ``capture`` would go to the model's ``**kwargs``."""
    options = capture_options()
    try:
        named = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        named = set()
    misplaced = sorted(k for k in kwargs if k in options and k not in named)
    if misplaced:
        given = ", ".join(f"{k}={kwargs[k]!r}" for k in misplaced)
        raise CaptureError(
            f"hookscope.run got {given} as a keyword: run passes keywords to the model, and "
            f"{type(model).__name__}.forward has no parameter {misplaced[0]!r} (it would reach "
            f"its **kwargs silently). For the capture option write options={{"
            f"{', '.join(f'{k!r}: {kwargs[k]!r}' for k in misplaced)}}}; for a keyword of the "
            f"model's own, call it inside the block: with hookscope.capture(model, ...) as acts: "
            f"model(..., {given})")


def _as_keywords(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A mapping given as the one input (a dict, a tokenizer's ``BatchEncoding``) becomes keyword
    arguments, as ``extract`` passes a dict batch, when its keys name ``forward``'s parameters;
    a model whose ``forward`` takes the mapping itself gets it unchanged."""
    if len(args) != 1 or kwargs or not isinstance(args[0], Mapping):
        return args, kwargs
    try:
        inspect.signature(model.forward).bind(**args[0])
    except (TypeError, ValueError):
        return args, kwargs
    return (), dict(args[0])
