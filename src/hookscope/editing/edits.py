"""Edits: change what selected modules return (or receive) while a ``with`` block runs.

Four context managers, each selecting modules with the same patterns as ``capture``:

- ``edit(model, {pattern: fn})``: any change, ``fn(output) -> new output``;
- ``ablate(model, layers, how="zero" | "mean" | "resample", reference=acts)``;
- ``patch(model, source=acts, layers=patterns)``: activation patching from another run;
- ``steer(model, {pattern: vector}, scale=1.0, positions=None)``: add a direction.

``ablate``, ``patch`` and ``steer`` take ``positions=``: token positions of the token axis (dim 1
of a module's output; dim 2, the queries, of ``"path::scaled_dot_product_attention"``'s ``(batch,
heads, query, head_dim)``; ``seq_dim=`` for any other function's value), counted among the
real tokens of each row whenever an attention mask is known (the ``attention_mask`` the model is
called with, read by a pre-hook on the root, or the one given), so a padded batch never has a
padding position edited; ``absolute=True`` indexes the axis as it is. ``heads=`` edits only those
attention heads of a value with a heads axis. See ``hookscope.record.positions``.

Output edits are forward hooks that return the new output; input edits (``edit(...,
inputs=True)``) are forward pre-hooks (``with_kwargs=True``) that return ``(args, kwargs)``. Every
hook is removed when the block exits, also when the forward pass raises. Hooks of one module run
in the order they were added: to record the edited value of a module, enter ``capture`` inside
the edit (``with edit(...), capture(...)``); a capture of *other* modules sees the edit's effect
whatever the order. A pattern with output parts (``"lstm[0]"``) edits only that part.

Calls are counted per block, as ``capture`` counts them: call ``k`` of a module is its ``k``-th
call since the block was entered, and ``patch`` gives it call ``k`` of the same module in the
source. On exit, a selected module that never ran is reported like in ``capture``
(``on_unfired``), because an edit that never applied is a silent wrong result.

Inside ``torch.compile`` (``fullgraph=True`` included) each output edit runs in the graph as one
operator whose result the graph goes on with (``engine.compile.graph.replace``): values equal eager,
no recompile per block. When gradients flow through the edited output it runs outside the graph
instead (``fullgraph=False``), or raises ``EditError`` at the call (``fullgraph=True``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from hookscope.editing import rules as edit_rules
from hookscope.editing.sources import Source, SourceReader
from hookscope.engine import (
    FULLGRAPH,
    HookSession,
    MaskWatcher,
    ModuleIndex,
    OnUnfired,
    OwnedHook,
    Target,
    apply_edit,
    as_patterns,
    brief,
    check_arity,
    check_callable,
    check_finite,
    check_flag,
    check_int,
    check_nonempty,
    check_number,
    check_positions,
    fullgraph,
    in_recompute,
    inside,
    kind_of,
    output_of,
    resolve_each,
    unwrap,
)
from hookscope.engine import index as module_index
from hookscope.errors import ArgumentTypeError, EditError, warn
from hookscope.record import Heads, Over, Positions, check_over
from hookscope.util import get_part, iter_tensors, set_part

__all__ = ["Edit", "edit", "ablate", "patch", "steer"]

Tensor = torch.Tensor
Rule = edit_rules.Rule  # (value, target, call) -> new value | None


class Edit(HookSession):
    """An active set of edits; build it with ``edit``, ``ablate``, ``patch`` or ``steer``.

    Attributes:
        counts: ``{record name: number of calls edited}``, e.g. ``{"fc1": 1, "lstm[0]": 2}``.
        unfired: ``{record name: reason}`` for selected modules that never ran (set on exit).
    """

    _unfired_consequence = "their edit was never applied"
    _edits = True

    def __init__(self, model: nn.Module, rules: Sequence[tuple[str, Rule]], *,
                 inputs: bool = False, on_unfired: OnUnfired = "warn",
                 watcher: MaskWatcher | None = None, names: ModuleIndex | None = None):
        each, names = resolve_each(model, [[pattern] for pattern, _ in rules], names)  # one index
        resolved = [(pattern, target, rule) for (pattern, rule), targets in zip(rules, each)
                    for target in targets]
        self._rules = [(target, rule) for _, target, rule in resolved]
        self._patterns = [pattern for pattern, _, _ in resolved]  # named when an edit misfits
        targets = list({(t.path, t.parts, t.op): t for t, _ in self._rules}.values())
        super().__init__(model, (), on_unfired, targets=targets, names=names)
        self._watcher = watcher  # the attention mask of the running forward, for positions
        if inputs and any(t.parts for t, _ in self._rules):
            raise EditError("output parts such as 'lstm[0]' select pieces of an output; an input "
                            "edit gets (args, kwargs): drop the brackets and change them in fn")
        if inputs and any(t.op for t, _ in self._rules):
            raise EditError("inputs=True edits what a module receives; a function-level address "
                            "('path::name') selects a value computed inside forward: edit that "
                            "value (inputs=False), or the inputs of the module that makes the call")
        self._inputs = inputs
        self._calls = [0] * len(self._rules)
        self._recomputed = [0] * len(self._rules)  # checkpoint recomputes seen, per rule

    @property
    def counts(self) -> dict[str, int]:
        """``{record name: calls edited}`` in this block so far."""
        return {target.key: calls for (target, _), calls in zip(self._rules, self._calls)}

    def _register(self) -> None:
        # in_recompute: activation checkpointing re-runs the forward during backward; the
        # edit must apply there too, or the recomputed values differ from the real ones.
        # pick: a compiled graph holds the watcher and each output edit whole (engine.compile.graph)
        replaces = FULLGRAPH if fullgraph(self.model) else True
        if self._watcher is not None:
            watcher = self._watcher
            self._own(OwnedHook(watcher.hook, unwrap(self.model)[0], in_recompute=True,
                                pick=watcher.find, on_kept=watcher.set), pre=True, with_kwargs=True)
            for _, stack in watcher.modules[1:]:  # an encoder-decoder's stacks: their own tokens
                self._hook(stack, watcher.hook, pre=True, with_kwargs=True, in_recompute=True)
        for index, (target, rule) in enumerate(self._rules):
            if self._inputs:
                self._hook(target.module, self._input_hook(index, target, rule), pre=True,
                           with_kwargs=True, in_recompute=True)
            elif target.op is None:
                self._own(OwnedHook(self._output_hook(index, target, rule), target.module,
                                    in_recompute=True, pick=output_of, replaces=replaces))
            else:
                self._hook_output(target, self._output_hook(index, target, rule), in_recompute=True)

    def _output_hook(self, index: int, target: Target, rule: Rule) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            call = self._next_call(index, target)
            old = _part(output, target)
            if edit_rules.is_positional(rule) and inside(output, target.parts, "PackedSequence"):
                raise EditError(
                    f"cannot edit positions of '{target.key}': it lies inside a PackedSequence, "
                    f"whose rows are the real tokens of all sequences time step by time step "
                    f"[kind: PackedSequence], not (batch, seq); select the PackedSequence itself "
                    f"('{target.key.rsplit('[', 1)[0]}'), which hookscope edits per sequence")
            if kind_of(old) is None:
                _refuse_quantized(old, target)

            def fitted(value: Any) -> Any:  # the rule on the value as its kind presents it
                new = rule(value, target, call)
                if new is not None:
                    edit_rules.check_fits(self._patterns[index], target, call, value, new)
                return new
            new = apply_edit(fitted, old, target.key, EditError)  # back in old's form
            if new is None:
                return None
            return set_part(output, target.parts, new) if target.parts else new
        return hook

    def _input_hook(self, index: int, target: Target, rule: Rule) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            call = self._next_call(index, target)
            new = rule((args, kwargs), target, call)
            if new is not None and not (isinstance(new, tuple) and len(new) == 2
                                        and isinstance(new[0], tuple) and isinstance(new[1], dict)):
                raise EditError(f"the input edit of '{target.path}' returned a "
                                f"{type(new).__name__}; it must return (args, kwargs) with args "
                                f"a tuple and kwargs a dict, or None to keep the inputs")
            return new
        return hook

    def _next_call(self, index: int, target: Target) -> int:
        if in_recompute():  # the same calls again, in order (not new calls): call k gets rule k
            self._recomputed[index] += 1
            return (self._recomputed[index] - 1) % max(self._calls[index], 1)
        self._ran.add(target.path)
        call = self._calls[index]
        self._calls[index] += 1
        return call


def edit(model: nn.Module, edits: Mapping[str, Callable[..., Any]], *, inputs: bool = False,
         context: bool = False, on_unfired: OnUnfired = "warn") -> Edit:
    """Replace what selected modules return (or receive) with what ``fn`` makes of it.

    ```python
    with hookscope.edit(model, {"fc1": lambda output: output * 2}):
        y = model(x)        # exactly as with a forward hook returning output * 2
    ```

    Args:
        model: root module (wrappers looked through, as in ``capture``).
        edits: ``{pattern: fn}``. For outputs, ``fn(output)`` returns the new output (any
            structure: tensor, tuple, dict, dataclass), or ``None`` to keep it; with a part
            (``"lstm[0]"``) ``fn`` gets and returns only that part. With ``inputs=True``,
            ``fn(args, kwargs)`` returns ``(args, kwargs)`` or ``None``. A function-level
            address (``"::relu#3"``, ``"h.*.attn::scaled_dot_product_attention"``) edits the
            value that call returned, before the rest of forward uses it.
        inputs: edit the inputs (forward pre-hooks) instead of the outputs.
        context: call ``fn(output, path, call)`` (``fn(args, kwargs, path, call)`` for inputs):
            also the module path and the call index, counted from 0 per module. A ``fn`` that
            cannot take the short form but takes this one is called so too, with a
            ``DeprecationWarning`` (the form was once guessed from the signature).
        on_unfired: a selected module that never ran: ``"warn"``, ``"error"`` or ``"ignore"``.

    Returns:
        An ``Edit`` context manager; the hooks exist only inside its ``with`` block. The
        forwards in the block are the user's own: their effects on the model (BatchNorm
        statistics in training mode, spectral norm, the RNG) stay, as without the edit.

    Raises:
        SelectorError: a pattern matches no module (before anything is registered).
        ArgumentTypeError: a ``fn`` whose signature cannot take the arguments it will get
            (``lambda o, p: o`` without ``context=True``), at the call.
        EditError: ``edits`` is not a dict; output parts or a function-level address with
            ``inputs=True``; during the
            forward pass, an input edit
            returned something other than ``(args, kwargs)`` or ``None``, or an output edit
            returned another structure, tensor shape or dtype than the module (or part) did:
            the message names the pattern, the module and call, and both.
        HookNeverFiredError: on exit, with ``on_unfired="error"``, a selected module never ran.
    """
    _check_mapping("edits", edits, "fn", "to zero modules instead, use hookscope.ablate(model, "
                   "patterns)")
    check_flag("inputs", inputs)
    check_flag("context", context)
    for pattern, fn in edits.items():
        example = ("lambda output: value to replace it by a tensor (to zero it use "
                   "hookscope.ablate(model, ...))" if fn is None or isinstance(fn, (str, Tensor))
                   else "lambda output: output * 2")
        check_callable(f"edits[{pattern!r}]", fn, example)
    rules = [(pattern, _adapt(pattern, fn, inputs, context)) for pattern, fn in edits.items()]
    return Edit(model, rules, inputs=inputs, on_unfired=on_unfired)


def ablate(model: nn.Module, layers: str | Sequence[str], *,
           how: Literal["zero", "mean", "resample"] = "zero", reference: Source | None = None,
           positions: Positions = None, attention_mask: Tensor | None = None,
           absolute: bool = False, heads: Heads = None, seq_dim: int | None = None,
           over: Over = "forward", on_unfired: OnUnfired = "warn") -> Edit:
    """Knock out the outputs of selected modules (every tensor in them, or the selected part).

    Args:
        model: root module.
        layers: one pattern or a list of patterns.
        how: ``"zero"``: zeros of the same shape and dtype. ``"mean"``: the reference's mean over
            the batch (dim 0, pooled over all its recorded calls), the same for every row.
            ``"resample"``: each row replaced by a reference row drawn at random (the global
            torch RNG: seed it with ``torch.manual_seed`` for a repeatable draw).
        reference: for ``"mean"``/``"resample"``: a ``Capture`` of the same modules on
            reference inputs, a dict from ``hookscope.load``, or a file ``Capture.save`` wrote.
        positions: only these token positions, counted among real tokens when an attention mask
            is known (see ``hookscope.record.positions``); ``None``: every position. The token axis is
            dim 1 of a module's output, the query axis (dim 2) of a
            ``"path::scaled_dot_product_attention"`` value ``(batch, heads, query, head_dim)``,
            ``seq_dim`` for any other function's value (refused without it).
        attention_mask: ``(batch, seq)`` mask to count positions by; ``None``: the one the model
            is called with (keyword or positional ``attention_mask``), if any.
        absolute: count positions on the token axis as it is, padding included.
        heads: only these attention heads (an int or a list; negative from the end), on
            addresses whose value has a heads axis: ``"path::scaled_dot_product_attention"``.
        seq_dim: the token axis of each selected value, overriding its known layout.
        over: under a KV cache (``generate()``), what ``positions`` count: ``"forward"`` the
            tokens of each forward pass (so ``positions=0`` is every newly generated token),
            ``"sequence"`` the whole sequence so far, the cached tokens included
            (``positions=0`` is the prompt's first token only, ``-1`` the newest token in each
            forward); the same without a cache (see ``hookscope.record.positions``).
        on_unfired: as in ``edit``.

    Returns:
        An ``Edit`` context manager.

    Raises:
        ArgumentTypeError: ``positions``, ``absolute`` or ``seq_dim`` of the wrong type
            (``positions="last"``, ``absolute="yes"``, ``seq_dim="1"``), at the call.
        EditError: an unknown ``how``; no ``reference`` for ``"mean"``/``"resample"``; in the
            forward pass, a reference that lacks the module, or whose rows (shape past dim 0)
            differ from the output's.
        PositionError: in the forward pass, a position that a row lacks (see ``positions``), a
            head that does not exist, ``heads`` on a value without a heads axis, ``positions``
            on a function's value of unknown layout without ``seq_dim``.
    """
    patterns = as_patterns(layers)
    _check_where(positions, absolute, seq_dim, over)
    if how not in ("zero", "mean", "resample"):
        raise EditError(f"how={brief(how)} is not one of 'zero', 'mean', 'resample'")
    rule: Rule = edit_rules.zero
    if how != "zero":
        if reference is None:
            raise EditError(f"how={brief(how)} needs reference=acts: a capture of the same modules on "
                            f"reference inputs, e.g. with hookscope.capture(model, *layers) as "
                            f"acts: model(x_reference)")
        rule = edit_rules.reference_rule(SourceReader(reference, "reference"), how)
    if positions is None and heads is None:
        return Edit(model, [(p, rule) for p in patterns], on_unfired=on_unfired)
    watcher = MaskWatcher(unwrap(model)[0], attention_mask)
    where = edit_rules.Where(heads, seq_dim, absolute, over)
    return Edit(model, [(p, edit_rules.at_positions(rule, positions, watcher, where))
                        for p in patterns], on_unfired=on_unfired, watcher=watcher)


def patch(model: nn.Module, *, source: Source,
          layers: str | Sequence[str] | Mapping[str, str] | None = None,
          source_layers: str | Sequence[str] | None = None,
          positions: Positions | Mapping[int, int] = None,
          attention_mask: Tensor | None = None, source_attention_mask: Tensor | None = None,
          absolute: bool = False, heads: Heads = None, seq_dim: int | None = None,
          over: Over = "forward", on_unfired: OnUnfired = "warn") -> Edit:
    """Activation patching: give call ``k`` of each selected module call ``k``'s value in ``source``.

    ```python
    with hookscope.capture(model, "blocks.*") as clean:
        model(x_clean)
    with hookscope.patch(model, source=clean, layers="blocks.3", positions=[-1]):
        y = model(x_corrupted)
    ```

    Values are cast to the live output's device and dtype; they carry no gradient.

    Args:
        model: root module.
        source: a ``Capture`` of another run, a dict from ``hookscope.load``, or the file.
        layers: patterns to patch; ``None``: every record in ``source``; ``[]``: none. A mapping
            ``{pattern: source pattern}`` patches each from another layer of the source.
        source_layers: the source layer of each of ``layers``, in the same order (each pattern
            must select as many modules as its partner); ``None``: the same layers.
        positions: patch only these token positions, counted among real tokens when a mask is
            known (see ``hookscope.record.positions``); a mapping ``{position: source position}``
            takes each from another position of the source. With positions, the source may
            have another sequence length (another prompt). The token axis is found as in
            ``ablate`` (dim 1 of a module's output, the query axis of scaled_dot_product_attention,
            else ``seq_dim``).
        attention_mask: this run's ``(batch, seq)`` mask; ``None``: the one the model is called
            with, if any.
        source_attention_mask: the source run's mask, to count source positions by; ``None``:
            the mask the source's capture saw its model called with (``Records.tokens``, kept
            with each record), none for a loaded file.
        absolute: count positions on the token axis as it is (both runs), padding included.
        heads: patch only these attention heads (every real position of them when
            ``positions`` is ``None``), on ``"path::scaled_dot_product_attention"`` addresses.
        seq_dim: the token axis of each selected value, overriding its known layout.
        over: under a KV cache (``generate()``), what ``positions`` count: ``"forward"`` the
            tokens of each forward pass (so ``positions=0`` is every newly generated token),
            ``"sequence"`` the whole sequence so far, the cached tokens included
            (``positions=0`` is the prompt's first token only, ``-1`` the newest token in each
            forward); the same without a cache (see ``hookscope.record.positions``).
        on_unfired: as in ``edit``.

    Returns:
        An ``Edit`` context manager.

    Raises:
        ArgumentTypeError: ``positions``, ``absolute`` or ``seq_dim`` of the wrong type
            (``positions={"a": "b"}``), at the call.
        EditError: ``layers`` and ``source_layers`` differ in length or in what they select; in
            the forward pass: ``source`` lacks a selected module or its call ``k``; a value's
            shape differs from the live output's (the message names the module, the call and
            both shapes).
        PositionError: in the forward pass, a position that a row of either run lacks; as in
            ``ablate`` for ``heads`` and ``seq_dim``.
    """
    _check_where(positions, absolute, seq_dim, over)
    records = SourceReader(source, "source")
    pairs = edit_rules.layer_pairs(records, layers, source_layers)
    names = module_index(model)  # one index for the source pairs and the session
    source_of = edit_rules.source_targets(model, pairs, names)
    if positions is None and heads is None:
        rule = edit_rules.patch_rule(records, source_of)
        return Edit(model, [(p, rule) for p, _ in pairs], on_unfired=on_unfired, names=names)
    destination, origin = ((list(positions), list(positions.values()))
                           if isinstance(positions, Mapping) else (positions, positions))
    watcher = MaskWatcher(unwrap(model)[0], attention_mask)
    where = edit_rules.Where(heads, seq_dim, absolute, over)
    rule = edit_rules.patch_positions_rule(records, source_of, destination, origin, watcher,
                                            source_attention_mask, where)
    return Edit(model, [(p, rule) for p, _ in pairs], on_unfired=on_unfired, watcher=watcher,
                names=names)


def steer(model: nn.Module, vectors: Mapping[str, Tensor], *, scale: float = 1.0,
          positions: Positions = None, attention_mask: Tensor | None = None,
          absolute: bool = False, heads: Heads = None, seq_dim: int | None = None,
          over: Over = "forward", on_unfired: OnUnfired = "warn") -> Edit:
    """Add ``scale * vector`` to the output of each selected module (a steering direction).

    The vector broadcasts over the leading dimensions: a ``(d_model,)`` vector is added to every
    batch row and token of a ``(batch, seq, d_model)`` output; for a ``(batch, channels, height,
    width)`` map give ``(channels, 1, 1)``. For a tuple output select the tensor, e.g.
    ``"layers.6[0]"``.

    Args:
        model: root module.
        vectors: ``{pattern: vector}``; each vector is cast to the output's device and dtype.
            A vector that requires grad gets its gradient from each backward, as through a
            plain hook (to train a steering vector); so does a ``patch`` source or an ``ablate``
            reference given as tensors that require grad.
        scale: multiplier of every vector.
        positions: only these token positions, counted among real tokens when an attention mask
            is known: ``-1`` is the last real token of each row, right- or left-padded (see
            ``hookscope.record.positions``); an int, a list of ints, a slice or a boolean mask;
            ``None``: everywhere. The token axis is found as in ``ablate``.
        attention_mask: ``(batch, seq)`` mask to count positions by; ``None``: the one the model
            is called with (keyword or positional ``attention_mask``), if any.
        absolute: count positions on the token axis as it is, padding included.
        heads: only these attention heads, on ``"path::scaled_dot_product_attention"``
            addresses (give a ``(head_dim,)`` vector there).
        seq_dim: the token axis of each selected value, overriding its known layout.
        over: under a KV cache (``generate()``), what ``positions`` count: ``"forward"`` the
            tokens of each forward pass (so ``positions=0`` is every newly generated token),
            ``"sequence"`` the whole sequence so far, the cached tokens included
            (``positions=0`` is the prompt's first token only, ``-1`` the newest token in each
            forward); the same without a cache (see ``hookscope.record.positions``).
        on_unfired: as in ``edit``.

    Returns:
        An ``Edit`` context manager.

    Raises:
        ArgumentTypeError: ``scale`` is not a real number; a complex or sparse vector; ``positions``,
            ``absolute`` or ``seq_dim`` of the wrong type (at the call).
        ArgumentValueError: ``scale`` or a vector is NaN or infinite, or ``scale * vector``
            overflows to infinity (``scale=1e308``) (at the call).
        EmptySelectionError: a vector with no values, ``torch.zeros(0)`` (at the call).
        EditError: a vector is not a tensor; in the forward pass: the selected output is not a
            tensor or the vector does not broadcast to it.
        PositionError: in the forward pass, the output has no token axis or a row lacks a
            position; as in ``ablate`` for ``heads`` and ``seq_dim``.
    """
    check_number("scale", scale)
    _check_where(positions, absolute, seq_dim, over)
    edits_part = positions is not None or heads is not None
    watcher = MaskWatcher(unwrap(model)[0], attention_mask) if edits_part else None
    rules = []
    _check_mapping("vectors", vectors, "vector", "one vector per pattern")
    for pattern, vector in vectors.items():
        if not isinstance(vector, Tensor):
            raise EditError(f"the steering vector for '{pattern}' is a {type(vector).__name__}; "
                            f"give a tensor, e.g. torch.tensor(values) of shape (d_model,)")
        _check_vector(f"vectors[{pattern!r}]", vector)
        check_finite(f"scale * vectors[{pattern!r}] (scale={scale:g})",  # an overflow
                     vector.detach() * scale)
        rule = edit_rules.steer_rule(vector, scale)
        if watcher is not None:
            rule = edit_rules.at_positions(rule, positions, watcher,
                                            edit_rules.Where(heads, seq_dim, absolute, over))
        rules.append((pattern, rule))
    return Edit(model, rules, on_unfired=on_unfired, watcher=watcher)


# ------------------------------------------------------------------------------- rules
def _check_where(positions: object, absolute: object, seq_dim: object, over: object) -> None:
    """The checks of ``positions``, ``absolute``, ``seq_dim`` and ``over`` every editing verb
    shares, at the call (they were once met only in the forward, or never when ``positions``
    was None)."""
    check_positions("positions", positions)
    check_flag("absolute", absolute)
    check_over(over)
    if seq_dim is not None:
        check_int("seq_dim", seq_dim)


def _check_vector(name: str, vector: Tensor) -> None:
    """A steering vector: dense, finite, with at least one value (complex only for a complex
    output: checked when it is added)."""
    if vector.layout != torch.strided:
        raise ArgumentTypeError(f"{name} is a {vector.layout} tensor: a steering vector is added "
                                f"to dense activations; pass {name.split('[')[0]}[...].to_dense()")
    check_nonempty(name, vector, "a vector of shape (d_model,)")
    check_finite(name, vector)


def _adapt(pattern: str, fn: Callable[..., Any], inputs: bool, context: bool) -> Rule:
    """The rule calling ``fn`` in the form asked for: (value) or (value, path, call), where for
    inputs the value is (args, kwargs)."""
    short = 2 if inputs else 1
    if not context and not _accepts(fn, short) and _accepts(fn, short + 2):
        warn(f"the edit of '{pattern}' takes (path, call) too: pass context=True to "
             f"hookscope.edit to say so", DeprecationWarning)
        context = True
    forms = ("(args, kwargs, path, call)", "(args, kwargs)") if inputs else (
        "(output, path, call)", "(output)")
    fix = (f"write it as fn{forms[0]}" if context else
           f"write it as fn{forms[1]}, or pass context=True to hookscope.edit to have it called "
           f"as fn{forms[0]}")
    check_arity(f"edits[{pattern!r}]", fn, short + 2 if context else short, fix)
    if inputs:
        if context:
            return lambda value, target, call: fn(*value, target.path, call)
        return lambda value, target, call: fn(*value)
    if context:
        return lambda value, target, call: fn(value, target.path, call)
    return lambda value, target, call: fn(value)


def _accepts(fn: Callable[..., Any], count: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): assume the short form
        return count in (1, 2)
    return True


def _refuse_quantized(value: Any, target: Target) -> None:
    quantized = [t.dtype for t in iter_tensors(value) if t.is_quantized]
    if quantized:
        raise EditError(
            f"cannot edit '{target.key}': its output holds quantized tensors ({quantized[0]}) "
            f"inside a structure, which hookscope cannot write back. Select the quantized "
            f"tensor itself ('{target.key}[0]' ...), or edit the float model before "
            f"torch.ao.quantization.convert")


# ------------------------------------------------------------------------------- helpers
def _check_mapping(name: str, value: object, item: str, hint: str) -> None:
    if not isinstance(value, Mapping):
        raise EditError(f"{name} must be a dict {{pattern: {item}}}, e.g. {{'layers.3': ...}}; got "
                        f"a {type(value).__name__} ({hint})")
    check_nonempty(name, value, f"{{'layers.3': {item}}}")


def _part(output: Any, target: Target) -> Any:
    if not target.parts:
        return output
    try:
        return get_part(output, target.parts)
    except KeyError as err:
        raise EditError(f"cannot edit '{target.key}': {err.args[0]}") from None

