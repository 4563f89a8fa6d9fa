"""Records: what a capture recorded, read the same way live, saved, or loaded back from a file.

A record is addressed by a ``RecordKey`` (``hookscope.engine.values.record_key``:
``path[::op][:call][part]...``).

Older files wrote the parts of a selected name before the call (``lstm[0]:1``); ``parse`` reads
both. What a saved file holds is in ``hookscope.record.record_file``; ``load`` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hookscope.engine import (
    Layout,
    Part,
    RecordKey,
    Tokens,
    check_path,
    describe,
    is_standard,
    layout_of,
    outside_inference,
    token_axes,
    unresolved_standard,
)
from hookscope.errors import ArgumentTypeError, CaptureError, HookscopeError
from hookscope.record.entries import CallInputs, Entry, _bind
from hookscope.record.grads import NO_GRADIENT_YET, GradRecord
from hookscope.record.record_file import _aliases, _call_names, _rebuild, _savable
from hookscope.util import check_new_file, get_part, iter_tensors_with_keys, write_atomic

__all__ = ["RecordKey", "Records", "load"]

Tensor = torch.Tensor


class Records:
    """What was recorded, by record name; ``with hookscope.capture(...) as acts`` gives a
    ``Capture``, which is a ``Records`` (read live, inside the block and after it), and
    ``hookscope.load`` gives one.

    Reading: ``acts[path]`` is the output of the module's one call; ``acts[path, k]`` the output
    of call ``k`` (negative counts from the end); ``acts.calls(path)`` every call in order; any
    ``RecordKey`` or its text works too (``acts["relu:2"]``, ``acts["lstm[1][0]"]``). Outputs keep
    their structure (tensor, tuple, dict, dataclass, ``ModelOutput``), each tensor detached, e.g.
    ``(batch, channels, height, width)`` float32 for a ``Conv2d``; loaded records rebuild
    structured outputs as tuples (integer parts) and dicts (named parts).

    As a collection, records hold one tensor per saved key: ``list(acts)`` gives the keys a file
    would hold (``fc1``, ``relu:0``, ``lstm[1][0]``) and ``len(acts)`` their number.

    Attributes:
        metadata: strings saved with the file (``load``), else empty.
        unfired: ``{record name: reason}`` for selected modules that never ran.
        notes: ``{record name: note}`` where a value was kept in another form, e.g.
            ``"torch.quint8 (scale 0.02, zero point 0), kept dequantized as torch.float32"``.
        aliases: ``{other name: record name}`` for modules registered under several names
            (``"encoder.embed_tokens": "shared"``); reading by an alias reads the record.

    Raises (on reading):
        CaptureError: the name was not recorded, never ran, ran more than once (for
            ``acts[path]``), or its value was overwritten in place after capture.
    """

    def __init__(self, entries: Iterable[Entry], kept: Iterable[str] = (),
                 metadata: Mapping[str, str] | None = None):
        self._entries = {e.name: e for e in entries}
        self._kept = frozenset(kept)  # of "inputs", "grads", "grad_inputs"
        self.metadata = dict(metadata or {})
        self.unfired: dict[str, str] = {}
        self.notes: dict[str, str] = {}  # record name -> how a value was kept (dequantized)
        self.aliases: dict[str, str] = {}  # other name of a recorded module -> its record name

    def entry(self, name: str) -> Entry:
        """The entry of record ``name`` (live capture sessions append to it)."""
        return self._entries[name]

    def clear(self) -> None:
        """Drop every recorded value, keep the record names (for reuse across batches)."""
        for entry in self._entries.values():
            entry.clear()
        self.unfired = {}

    # ----------------------------------------------------------------- names and counts
    @property
    def paths(self) -> list[str]:
        """Record names (paths, with output parts if asked), ``named_modules()`` order."""
        return list(self._entries)

    @property
    def names(self) -> dict[str, str]:
        """``{name asked: record name}`` for every record, in record order: the standard name
        a module was selected by (``"resid_post.1": "transformer.h.1"``, ``"attn.z.0":
        "transformer.h.0.attn::scaled_dot_product_attention"``; the first when it had several),
        else the record name itself (a path, a glob's match). ``acts[name]`` reads by either;
        a file saved and loaded keeps them."""
        asked: dict[str, str] = {}  # record name -> its first standard name
        for alias, record in self.aliases.items():
            if is_standard(alias) and record in self._entries:
                asked.setdefault(record, alias)
        return {asked.get(name, name): name for name in self._entries}

    @property
    def counts(self) -> dict[str, int]:
        """``{record name: number of calls recorded}``; 0 for modules that never ran."""
        return {name: len(e.outputs) for name, e in self._entries.items()}

    def items(self) -> Iterator[tuple[RecordKey, Tensor]]:
        """``(key, tensor)`` for every tensor of every call, keys as a saved file holds them."""
        for name, entry in self._entries.items():
            base = entry.key
            count = len(entry.outputs)
            for call in range(count):
                at = None if count == 1 else call
                for keys, tensor in iter_tensors_with_keys(self._value(name, call)):
                    yield dataclasses.replace(base, call=at, parts=(*base.parts, *keys)), tensor

    def __iter__(self) -> Iterator[str]:
        return (str(key) for key, _ in self.items())

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def __contains__(self, key: object) -> bool:
        """True when something was recorded at ``key`` (a record name that ran, with any
        number of calls, or a ``RecordKey``/its text naming an existing call and part)."""
        if isinstance(key, str) and key in self._entries:
            return bool(self._entries[key].outputs)
        try:
            address = RecordKey.parse(key) if isinstance(key, str) else key
            if not isinstance(address, RecordKey):
                return False
            name, parts = self._name_for(address)
            outputs = self._entries[name].outputs
            call = 0 if address.call is None else address.call
            get_part(outputs[call], parts)
        except (HookscopeError, KeyError, IndexError):
            return False
        return True

    def __repr__(self) -> str:
        shown = [f"{name}{f' ({record})' if name != record else ''}: "
                 f"{_shapes(self._entries[record].outputs)}"
                 for name, record in list(self.names.items())[:6]]
        more = f", … {len(self._entries) - 6} more" if len(self._entries) > 6 else ""
        return f"<hookscope.{type(self).__name__} {', '.join(shown)}{more}>"

    # ----------------------------------------------------------------- values
    def __getitem__(self, key: str | tuple[str, int] | RecordKey) -> Any:
        _check_key(key)
        if isinstance(key, tuple):
            return self._value(*key)
        if isinstance(key, str) and (key in self._entries or key in self.aliases):
            return self._only(key)
        address = self._address(key)
        name, parts = self._name_for(address)
        value = self._only(name) if address.call is None else self._value(name, address.call)
        try:
            return get_part(value, parts)
        except KeyError as err:
            raise CaptureError(f"cannot take {str(address)!r}: {err.args[0]}") from None

    def calls(self, path: str) -> list[Any]:
        """Every call's output for ``path``, in call order (never empty: a record that never
        ran raises)."""
        entry = self._entry(path)
        return [self._value(path, k) for k in range(len(entry.outputs))]

    def inputs(self, path: str, call: int = 0) -> CallInputs:
        """The inputs of call ``call`` of ``path``; needs ``capture(..., inputs=True)``."""
        entry = self._entry(path)
        if "inputs" not in self._kept:
            raise CaptureError(f"inputs were not recorded: use hookscope.capture(model, "
                               f"'{path}', inputs=True) to keep them")
        k = self._index(path, entry, call)
        args, kwargs = entry.inputs[k] = outside_inference(entry.inputs[k])  # once: kept converted
        return CallInputs(args, kwargs, _bind(entry, args, kwargs))

    def tokens(self, path: str, call: int = 0) -> Tokens:
        """The ``Tokens`` of the forward pass that made call ``call`` of ``path``: the
        ``attention_mask`` the model was called with (``None`` without one, and in a loaded
        file, which keeps no masks) and the KV cache's length before it.

        Raises:
            CaptureError: ``path`` or ``call`` does not exist.
        """
        entry = self._entry(path)
        return entry.tokens(self._index(path, entry, call))

    def layout(self, key: str | RecordKey, call: int = 0, seq_dim: int | None = None, *,
               heads: bool = False) -> Layout:
        """What call ``call`` of the tensor recorded at ``key`` holds: its token and heads axes and
        the mask of the forward that produced it (``hookscope.engine.values.layout.layout_of``).

        Raises:
            CaptureError: as reading ``acts[key]``; the record is not a tensor.
            PositionError: as ``layout_of`` (a function of unknown layout without ``seq_dim``).
        """
        address = self._address(key)
        name, parts = self._name_for(address)  # a standard name is read as the record it names
        value = get_part(self._value(name, call), parts)
        if not isinstance(value, Tensor):
            raise CaptureError(f"'{address}' is a {type(value).__name__}, not a tensor; give a "
                               f"part that is one, e.g. '{address}[0]'")
        return layout_of(str(address), address.op, value.shape, seq_dim, heads=heads,
                         tokens=self.tokens(name, call), module=self._entry(name).module,
                         parts=address.parts)

    def token_axes(self, key: str | RecordKey, dims: int) -> tuple[int, int | None]:
        """``(batch axis, token axis)`` of a ``dims``-dim tensor recorded at ``key``: the
        ``TOKEN_AXES`` row of the module that made it (``(0, 1)`` for most; ``(1, 0)`` for a
        sequence-first ``nn.MultiheadAttention``); the token axis is ``None`` when it has none.

        Raises:
            CaptureError: ``key`` was not recorded.
        """
        address = self._address(key)
        name, _ = self._name_for(address)
        module = self._entry(name).module if address.op is None else None
        return token_axes(module, address.parts, dims)

    def grad(self, path: str, call: int = 0) -> Any:
        """d(loss)/d(output) of call ``call`` of ``path``; same structure and shapes as the output.

        Needs ``capture(..., grads=True)`` and a backward pass (``loss.backward()`` or
        ``torch.autograd.grad``) through that output, inside or after the ``with`` block. Several
        backward passes through the same forward (``retain_graph=True``, several losses, an
        ``autograd.grad`` on part of the output) accumulate as ``.grad`` does: the result is the
        sum of every pass's gradient (``grad_passes`` says how many). It is the gradient of the value
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

    def grad_passes(self, path: str, call: int = 0) -> int:
        """How many backward passes reached call ``call`` of ``path``'s output (``grad`` is
        their sum); 0 before any. Needs ``capture(..., grads=True)``.

        Raises:
            CaptureError: gradients were not recorded, or ``path``/``call`` does not exist.
        """
        return max(self._grad_record(path, call, "grads").passes.values(), default=0)

    def grad_calls(self, path: str) -> list[Any]:
        """d(loss)/d(output) for every call of ``path``, in call order (see ``grad``)."""
        return [self.grad(path, k) for k in range(len(self._entry(path).outputs))]

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
        return CallInputs(args, kwargs, _bind(self._entry(path), args, kwargs))

    def save(self, file: str | os.PathLike[str], *, overwrite: bool = False,
             metadata: Mapping[str, str] | None = None) -> None:
        """Write every recorded tensor to the safetensors ``file``, atomically; keys as ``items``.

        Tensors are moved to CPU and made contiguous; tensors sharing memory are copied apart.

        Every dtype a module returns is written as it is (float8, uint16..64, bool, complex64
        included) except ``torch.complex128``, which safetensors has no type for.

        Args:
            file: the ``.safetensors`` file to write.
            overwrite: replace an existing ``file``; without it an existing file is refused
                (as the CLI's ``--save`` without ``--overwrite``).
            metadata: extra ``{key: value}`` strings for the file's header.

        Raises:
            OutputExistsError: ``file`` exists and ``overwrite`` is False, or is a folder.
            HookscopeError: nothing was recorded, a record is a meta tensor or FakeTensor (no
                values), or a record's dtype is one safetensors cannot hold
                (``torch.complex128``); before anything is written.
        """
        file = check_new_file(file, overwrite=overwrite, example="acts.safetensors")
        tensors: dict[str, Tensor] = {}
        seen: set[int] = set()
        for key, tensor in self.items():
            t = _savable(str(key), tensor).detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr()
            tensors[str(key)] = t.clone() if ptr in seen else t
            seen.add(ptr)
        if not tensors:
            if any(self.counts.values()):
                raise HookscopeError("nothing to save: the selected modules ran but returned no "
                                     "tensor (None) [kind: None]; select a module (or a part of "
                                     "its output) that returns a tensor")
            raise HookscopeError("nothing to save: no selected module ran inside the capture block")
        meta = {"hookscope.calls": json.dumps({p: n for p, n in self.counts.items() if n})}
        if self.aliases:  # load(file)["resid_post.1"] reads as acts["resid_post.1"] did
            meta["hookscope.aliases"] = json.dumps(self.aliases)
        meta.update(metadata or {})
        write_atomic(file, lambda tmp: save_file(tensors, tmp, metadata=meta))

    # ----------------------------------------------------------------- lookups
    def _address(self, key: str | RecordKey) -> RecordKey:
        """``key`` parsed, a recorded module's other name (``resid_post.1``, an alias path) in
        it replaced by the record's address, its call and parts kept (``resid_post.1:0``)."""
        address = RecordKey.parse(key) if isinstance(key, str) else key
        if address.op is None and address.path in self.aliases:
            base = RecordKey.parse(self.aliases[address.path])
            address = RecordKey(base.path, address.call, base.parts + address.parts, base.op)
        return address

    def _name_for(self, key: RecordKey) -> tuple[str, tuple[Part, ...]]:
        """The record name holding ``key`` (the longest recorded prefix of its parts) and the
        parts left to take inside that record's value."""
        for n in range(len(key.parts), -1, -1):
            name = RecordKey(key.path, None, key.parts[:n], key.op).name
            if name in self._entries:
                return name, key.parts[n:]
        self._entry(key.name)  # raises, naming what was recorded
        raise AssertionError  # pragma: no cover

    def _entry(self, name: str) -> Entry:
        name = self.aliases.get(name, name)
        entry = self._entries.get(name)
        if entry is None:
            raise CaptureError(f"'{name}' was not selected in this capture; selected: "
                               f"{', '.join(repr(k) for k in list(self._entries)[:8])}"
                               f"{' …' if len(self._entries) > 8 else ''}."
                               f"{unresolved_standard(name, 'these records')}")
        if not entry.outputs:
            why = self.unfired.get(name, "no forward pass has run yet")
            raise CaptureError(f"'{name}' never ran, so nothing was recorded: {why}")
        return entry

    def _only(self, name: str) -> Any:
        entry = self._entry(name)
        if len(entry.outputs) != 1:
            raise CaptureError(
                f"'{name}' ran {len(entry.outputs)} times in this capture, so acts['{name}'] is "
                f"ambiguous: ask for one call with acts['{name}', k] (k = 0 … "
                f"{len(entry.outputs) - 1}, or -1 for the last) or for all with acts.calls('{name}')")
        return self._value(name, 0)

    def _index(self, name: str, entry: Entry, call: int) -> int:
        n = len(entry.outputs)
        if not -n <= call < n:
            raise CaptureError(f"'{name}' ran {n} time{'s' if n != 1 else ''}; call {call} does "
                               f"not exist (use 0 … {n - 1}, or -1 for the last)")
        return call % n

    def _value(self, name: str, call: int) -> Any:
        entry = self._entry(name)
        k = self._index(name, entry, call)
        if k in entry.broken:
            raise CaptureError(
                f"call {k} of '{name}' was overwritten in place after it was captured (an in-place "
                f"op such as ReLU(inplace=True) or '+=' in the code that uses it), so the kept "
                f"value is wrong. Capture again or pass clone=True")
        value = entry.outputs[k] = outside_inference(entry.outputs[k])  # once: kept converted
        return value

    def _grad_record(self, path: str, call: int, option: str) -> GradRecord:
        entry = self._entry(path)
        if option not in self._kept:
            raise CaptureError(f"{'input ' if option == 'grad_inputs' else ''}gradients were not "
                               f"recorded: use hookscope.capture(model, '{path}', {option}=True), "
                               f"then call loss.backward()")
        kept = entry.grads if option == "grads" else entry.grad_inputs
        return kept[self._index(path, entry, call)]

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor],
                     metadata: Mapping[str, str] | None = None) -> Records:
        """Records from flat ``{key: tensor}`` as a file holds them; record names and call
        counts come from ``metadata["hookscope.calls"]`` when present, else from the keys."""
        metadata = dict(metadata or {})
        known = [RecordKey.parse(n) for n in _call_names(metadata.get("hookscope.calls", "{}"))]
        calls: dict[RecordKey, dict[int, dict[tuple[Part, ...], Tensor]]] = {k: {} for k in known}
        for text, tensor in tensors.items():
            key = RecordKey.parse(text)
            cut = max((len(k.parts) for k in known if (k.path, k.op) == (key.path, key.op)
                       and key.parts[:len(k.parts)] == k.parts), default=0)
            record = dataclasses.replace(key, call=None, parts=key.parts[:cut])
            calls.setdefault(record, {}).setdefault(key.call or 0, {})[key.parts[cut:]] = tensor
        entries = []
        for record, by_call in calls.items():
            entry = Entry(record)
            entry.outputs.extend(_rebuild(by_call[k]) for k in sorted(by_call))
            entries.append(entry)
        records = Records(entries, metadata=metadata)
        records.aliases = _aliases(metadata.get("hookscope.aliases", "{}"), records.paths)
        return records


def _check_key(key: object) -> None:
    """Raise ``ArgumentTypeError`` unless ``key`` is ``"path"``, a ``RecordKey`` or ``("path",
    call)`` with an ``int`` call (a ``bool`` is not a call index, though Python counts it one)."""
    if isinstance(key, (str, RecordKey)):
        return
    if (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)
            and isinstance(key[1], int) and not isinstance(key[1], bool)):
        return
    raise ArgumentTypeError(f"a record is read as acts['path'], acts['path', k] with an int call "
                            f"k, or acts[RecordKey]; got acts[{key!r}] ({type(key).__name__}). "
                            f"List what was recorded with list(acts)")


def _shapes(outputs: list[Any]) -> str:
    if not outputs:
        return "never ran"
    first = outputs[0]
    shape = describe(first)
    return shape if len(outputs) == 1 else f"{len(outputs)} calls, first {shape}"


def load(file: str | os.PathLike[str]) -> Records:
    """Read a file written by ``save``: ``Records`` on CPU, with the file's metadata
    (``records.metadata``) and its call counts (``records.counts``).

    Raises:
        ArgumentTypeError: ``file`` is not a ``str`` or ``os.PathLike``.
        HookscopeError: the file is missing or is not a safetensors file.
    """
    check_path("file", file, "hookscope.load('acts.safetensors') (a file Capture.save wrote)")
    file = os.fspath(file)
    if not os.path.exists(file):
        raise HookscopeError(f"no such file: {file}")
    try:
        tensors = load_file(file)
        with safe_open(file, "pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as err:  # safetensors raises its own SafetensorError
        raise HookscopeError(f"{file} is not a readable safetensors file: {err}") from err
    return Records.from_tensors(tensors, metadata)
