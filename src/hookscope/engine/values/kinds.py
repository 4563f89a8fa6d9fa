"""Private: the table of value kinds, read by every verb.

A module can return much more than a strided float tensor: a nested tensor (``nn.TransformerEncoder``'s
eval fast path), a sparse tensor, a complex one, a quantized one, a DTensor, a meta tensor or a
FakeTensor, an inference tensor, a tensor wrapped by a ``torch.func`` transform, an RNN's
``PackedSequence``, or ``None``. Each is one row of ``KINDS``: how to recognise it, how its
numbers are read as one strided tensor (``values``), how its rows are read one per input when
they are not batch-first (``rows``), how an edit computed on those numbers is put back in its
form (``apply``), and the verbs it cannot take with the fix for each (``refuses``). Every verb
(capture's repr, save, stats, extract, edit/steer/ablate/patch, compare, find_nonfinite) asks
``kind_of`` and reads the row; none tests ``t.is_nested`` or ``t.is_quantized`` on its own.

Adding a kind is adding one row. For example, sparse CSR tensors (``Tensor.to_sparse_csr()``,
2-D): ::

    Kind("sparse CSR", "a sparse CSR tensor (torch.sparse_csr)",
         lambda v: isinstance(v, Tensor) and v.layout == torch.sparse_csr,
         values=_dense, apply=_sparse_apply)

Its numbers are its dense values (zeros included, as ``t.to_dense()`` has them); an edit is
computed on the dense tensor and turned back into the same layout (``to_sparse(layout=...)``).

The verbs are named by ``VERBS``; a refusal is a ``HookscopeError`` (or the verb's subclass)
naming the value, its kind and the fix (``refuse``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

from hookscope.engine.values import keep as v
from hookscope.errors import HookscopeError

__all__ = ["Kind", "KINDS", "VERBS", "kind_of", "values_for", "rows_for", "apply_edit",
           "refuse", "describe", "inside", "comparable", "NESTED_FIX"]

Tensor = torch.Tensor
Edit = Callable[[Tensor], "Tensor | None"]

#: the verbs a row can refuse
VERBS = ("capture", "save", "stats", "extract", "edit", "compare", "nonfinite")

NESTED_FIX = ("build the encoder with enable_nested_tensor=False (nn.TransformerEncoder), or run "
              "it in train() mode or without src_key_padding_mask, so the layers see padded tensors")


def _same(t: Any) -> Tensor:
    return t  # type: ignore[no-any-return]


def _apply_same(fn: Edit, t: Any) -> Any:
    return fn(t)


def _plain_apply(fn: Edit, t: Any) -> Any:
    """Quantized, DTensor: the edit sees the real (global) numbers; the result is put back in
    ``t``'s form (``values.restore_like``)."""
    new = fn(v.plain(t))
    return None if new is None else v.restore_like(new, t)


def _nested_values(t: Any) -> Tensor:
    """A nested tensor's numbers as one tensor: its components concatenated along their first
    dimension (``(tokens, features)`` for ``(seq_i, features)`` components): real tokens only."""
    return torch.cat([c.reshape(-1, *c.shape[1:]) if c.dim() else c.reshape(1) for c in t.unbind()])


def _nested_rows(t: Any) -> tuple[Tensor, Tensor]:
    parts = t.unbind()
    return _nested_values(t), torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)


def _nested_apply(fn: Edit, t: Any) -> Any:
    """The edit applied to each sequence as a batch of one (``(1, seq_i, ...)``, so positions
    count from each sequence's own last real token), rebuilt in ``t``'s layout."""
    parts = []
    for part in t.unbind():
        new = fn(part.unsqueeze(0))
        parts.append(part if new is None else new.squeeze(0))
    return torch.nested.as_nested_tensor(parts, layout=t.layout)


def _dense(t: Any) -> Tensor:
    return t.to_dense()  # type: ignore[no-any-return]


def _sparse_apply(fn: Edit, t: Any) -> Any:
    new = fn(t.to_dense())
    return None if new is None else new.to_sparse(layout=t.layout)


def _packed_values(p: Any) -> Tensor:
    return p.data  # type: ignore[no-any-return]


def _packed_padded(p: Any) -> tuple[Tensor, Tensor]:
    """``(padded (batch, longest, ...) in input order, lengths)``."""
    padded, lengths = pad_packed_sequence(p, batch_first=True)
    return padded, lengths.to(torch.int64)


def _packed_rows(p: Any) -> tuple[Tensor, Tensor]:
    padded, lengths = _packed_padded(p)
    return torch.cat([padded[i, :n] for i, n in enumerate(lengths.tolist())]), lengths


def _packed_apply(fn: Edit, p: Any) -> Any:
    """The edit applied to each sequence, unpacked, as a batch of one; packed again as it was."""
    padded, lengths = _packed_padded(p)
    rows = []
    for i, n in enumerate(lengths.tolist()):
        row = padded[i:i + 1, :n]
        new = fn(row)
        rows.append((row if new is None else new).squeeze(0))
    return pack_sequence(rows, enforce_sorted=p.sorted_indices is None)


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of value a module can return (a row of ``KINDS``).

    Attributes:
        name: short name (``"nested (jagged)"``), as the notes and the tests use it.
        what: the value described for an error message (``"a nested tensor (...)"``).
        recognise: True for a value of this kind (rows are tried in order; first match wins).
        values: the value's numbers as one strided tensor (elements in the value's order);
            ``None``: it holds no values (meta, FakeTensor).
        rows: ``(flat tokens (sum of lengths, ...), lengths (batch,) int64)`` in input order,
            for values whose first dimension is not the batch (nested, PackedSequence).
        apply: ``apply(fn, value)``: the edit ``fn`` (on strided tensors) applied, the result
            in the value's form.
        refuses: ``{verb: fix}`` for the verbs (``VERBS``) that cannot take it.
    """

    name: str
    what: str
    recognise: Callable[[Any], bool]
    values: Callable[[Any], Tensor] | None = _same
    rows: Callable[[Any], tuple[Tensor, Tensor]] | None = None
    apply: Callable[[Edit, Any], Any] = _apply_same
    refuses: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def _functorch(value: Any) -> bool:
    return (isinstance(value, Tensor) and not torch.compiler.is_dynamo_compiling()
            and bool(torch._C._functorch.is_functorch_wrapped_tensor(value)))


def _channels_last(value: Any) -> bool:
    return (isinstance(value, Tensor) and value.dim() == 4 and not value.is_contiguous()
            and value.is_contiguous(memory_format=torch.channels_last))


_NO_VALUES = {verb: v.NO_VALUES_FIX
              for verb in ("save", "stats", "extract", "compare", "nonfinite", "edit")}
_COMPLEX_STATS = ("select a module after it that returns its .real or .abs(), or capture it "
                  "(hookscope.capture) instead")
_NESTED_SAVE = ("save its sequences yourself ({f'seq{i}': s for i, s in "
                "enumerate(acts[name].unbind())}), or " + NESTED_FIX)

#: the rows, tried in order; the first whose ``recognise`` is True is the value's kind
KINDS: tuple[Kind, ...] = (
    Kind("None", "None (the module returned nothing here)", lambda x: x is None,
         values=None, refuses={verb: "select a part of the output that holds a tensor"
                               for verb in ("save", "stats", "extract", "edit")}),
    Kind("PackedSequence", "a PackedSequence (rows are the real tokens of all sequences, time "
         "step by time step, longest first: not the batch)",
         lambda x: isinstance(x, PackedSequence), values=_packed_values, rows=_packed_rows,
         apply=_packed_apply),
    Kind("meta/fake", "a tensor without values (meta or FakeTensor)",
         lambda x: isinstance(x, Tensor) and v.holds_no_values(x), values=None, refuses=_NO_VALUES),
    Kind("functorch-wrapped", "a tensor inside a torch.func transform", _functorch,
         refuses={"capture": "capture outside the transformed function"}),
    Kind("DTensor", "a DTensor (kept as its global tensor)",
         lambda x: isinstance(x, Tensor) and type(x) is not Tensor and v.is_dtensor(x),
         values=v.plain, apply=_plain_apply),
    Kind("quantized", "a quantized tensor (kept dequantized as float32)",
         lambda x: isinstance(x, Tensor) and x.is_quantized, values=v.plain, apply=_plain_apply),
    Kind("nested (jagged)", "a nested tensor of jagged layout (torch.jagged: one sequence of "
         "its own length per input)",
         lambda x: isinstance(x, Tensor) and x.is_nested and x.layout == torch.jagged,
         values=_nested_values, rows=_nested_rows, apply=_nested_apply,
         refuses={"save": _NESTED_SAVE}),
    Kind("nested (strided)", "a nested tensor (one sequence of its own length per input, as "
         "nn.TransformerEncoder's eval fast path makes them from src_key_padding_mask)",
         lambda x: isinstance(x, Tensor) and x.is_nested,
         values=_nested_values, rows=_nested_rows, apply=_nested_apply,
         refuses={"save": _NESTED_SAVE}),
    Kind("sparse COO", "a sparse COO tensor (torch.sparse_coo)",
         lambda x: isinstance(x, Tensor) and x.layout == torch.sparse_coo,
         values=_dense, apply=_sparse_apply),
    Kind("sparse CSR", "a sparse CSR tensor (torch.sparse_csr)",
         lambda x: isinstance(x, Tensor) and x.layout == torch.sparse_csr,
         values=_dense, apply=_sparse_apply),
    Kind("complex", "a complex tensor", lambda x: isinstance(x, Tensor) and x.is_complex(),
         refuses={"stats": _COMPLEX_STATS,
                  "extract": "store its real and imaginary parts: a model wrapper returning "
                             "torch.view_as_real(output)"}),
    Kind("inference", "an inference tensor (made under torch.inference_mode())",
         lambda x: isinstance(x, Tensor) and x.is_inference()),
    Kind("channels_last", "a channels_last tensor", _channels_last),
    Kind("strided", "a tensor", _is_tensor),
)


def kind_of(value: Any) -> Kind | None:
    """The row of ``KINDS`` for ``value``; ``None`` for a structure (tuple, dict, dataclass)
    or a non-tensor leaf, whose tensors are each of a kind."""
    for kind in KINDS:
        if kind.recognise(value):
            return kind
    return None


def refuse(kind: Kind, value: Any, where: str, verb: str,
           error: type[HookscopeError] = HookscopeError) -> None:
    """Raise ``error`` when ``kind`` (the kind of ``value``) refuses ``verb``: the message
    names ``where``, the kind, the dtype and the fix."""
    fix = kind.refuses.get(verb)
    if fix is not None:
        dtype = f", {value.dtype}" if isinstance(value, Tensor) else ""
        raise error(f"cannot {_DOING.get(verb, verb)} '{where}': it is {kind.what} "
                    f"[kind: {kind.name}{dtype}]; {fix}")


_DOING = {"save": "save", "stats": "take statistics of", "extract": "store", "edit": "edit",
          "compare": "compare", "nonfinite": "check for NaN/Inf", "capture": "keep"}


def values_for(value: Any, where: str, verb: str,
               error: type[HookscopeError] = HookscopeError) -> Tensor:
    """``value``'s numbers as one strided tensor for ``verb``.

    Raises:
        HookscopeError (or ``error``): the kind refuses ``verb``, or holds no values.
    """
    kind = kind_of(value)
    if kind is None:
        raise error(f"cannot {_DOING.get(verb, verb)} '{where}': it is a {type(value).__name__}, "
                    f"not a tensor; name the part to use (e.g. '{where}[0]')")
    if kind.name == "meta/fake":
        v.check_has_values(value, where, _DOING.get(verb, verb), error)
    refuse(kind, value, where, verb, error)
    if kind.values is None:
        raise error(f"cannot {_DOING.get(verb, verb)} '{where}': it is {kind.what}")
    return kind.values(value)


def comparable(t: Tensor, where: str) -> Tensor:
    """``t``'s values as a real tensor to compare elementwise: the values its kind reads
    (dequantized, global, a nested tensor's real tokens, a sparse tensor's dense values),
    complex ones as ``torch.view_as_real`` (``(..., 2)``: real and imaginary parts).

    Raises:
        HookscopeError: ``t`` holds no values (a meta tensor or a FakeTensor).
    """
    t = values_for(t, where, "compare")
    return torch.view_as_real(t) if t.is_complex() else t


def rows_for(value: Any) -> tuple[Tensor, Tensor] | None:
    """``(flat tokens, lengths)`` in input order when ``value``'s kind has rows of their own
    (nested tensor, PackedSequence), else None (a batch-first tensor, or a structure)."""
    kind = kind_of(value)
    return None if kind is None or kind.rows is None else kind.rows(value)


def apply_edit(fn: Edit, value: Any, where: str, error: type[HookscopeError] = HookscopeError) -> Any:
    """``fn`` applied to ``value`` as its kind says (``Kind.apply``); a structure is given to
    ``fn`` as it is.

    Raises:
        HookscopeError (or ``error``): the kind refuses edits (None, no values), before ``fn``.
    """
    kind = kind_of(value)
    if kind is None:
        return fn(value)
    if kind.name == "meta/fake":
        v.check_has_values(value, where, "edit", error)
    refuse(kind, value, where, "edit", error)
    return kind.apply(fn, value)


def inside(value: Any, parts: tuple[int | str, ...], name: str) -> bool:
    """True when the part ``parts`` of ``value`` lies inside a value of kind ``name`` (the
    ``.data`` of a PackedSequence: ``lstm[0][0]``)."""
    for depth in range(len(parts)):
        kind = kind_of(value)
        if kind is not None and kind.name == name:
            return True
        if isinstance(value, Tensor):  # a heads part: a view of this tensor, no deeper kind
            return False
        try:
            value = value[parts[depth]]
        except (IndexError, KeyError, TypeError):
            return False
    return False


def describe(value: Any) -> str:
    """A value's shape in a few characters: ``2x5x8`` for a tensor, ``nested[5x8, 3x8]``,
    ``PackedSequence 10x6 (3 sequences)``, ``sparse COO 4x4``, else its type name."""
    kind = kind_of(value)
    if kind is None or kind.name == "None":
        return type(value).__name__
    if kind.rows is not None:
        if isinstance(value, PackedSequence):
            return (f"PackedSequence {'x'.join(map(str, value.data.shape))} "
                    f"({int(value.batch_sizes[0])} sequences)")
        return "nested[" + ", ".join("x".join(map(str, c.shape)) for c in value.unbind()) + "]"
    shape = "x".join(map(str, value.shape))
    return f"{kind.name} {shape}" if kind.name.startswith("sparse") else shape
