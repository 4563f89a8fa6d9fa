"""Private: a value written as its tensors and one spec string, the form a compiled graph hands out.

``engine.compile.graph.flatten`` writes a value (a module's output, a call's ``(args, kwargs)``)
as its tensors in order and a Python literal with ``...`` for each tensor (``_spec``); the sink
of ``hookscope::keep`` fills the literal with the real tensors again (``_filled``). Numbers travel
as 0-d tensors, namedtuples, structseqs and Hugging Face ``ModelOutput``s as their fields with a
code for their class (``_code``), any other object as its type's name (``NotKept``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NotKept"]

Tensor = torch.Tensor


def _spec(value: Any, values: list[Tensor]) -> str:
    if isinstance(value, Tensor):
        values.append(value)
        return "..."
    kind = type(value)
    if value is None or kind is str:
        return repr(value)
    if kind is int and not -2**63 <= value < 2**63:  # a constant: no dynamic size is so large
        return repr(value)
    if kind is bool or kind is int or kind is float:
        values.append(torch.scalar_tensor(value, dtype=_NUMBERS[kind]))
        return "b'#'"
    if kind is tuple or kind is list:
        inner = "".join([_spec(v, values) + ", " for v in value])
        return f"({inner})" if kind is tuple else f"[{inner}]"
    if kind is dict and all(type(k) is str for k in value):
        return "{" + "".join([f"{k!r}: {_spec(v, values)}, " for k, v in value.items()]) + "}"
    code = _class_code[0](kind)  # a constant of the trace (prepare)
    if code >= 0:  # {b'@': the class's code, b'=': {field: spec}}
        if isinstance(value, tuple):  # a structseq's fields by position (_code)
            names = getattr(kind, "_fields", None) or [str(k) for k in range(len(value))]
            fields = dict(zip(names, value))
        else:
            fields = dict(value.items())
        return f"{{b'@': {code}, b'=': {_spec(fields, values)}}}"
    return "{" + repr(kind.__name__) + "}"  # an object: not in the graph's hands


_NUMBERS = {bool: torch.bool, int: torch.int64, float: torch.float64}
MAKE, BY_NAME, SEQUENCE = 0, 1, 2  # how the sink builds a class again (_code)
_CLASSES: list[tuple[type, int]] = []  # code -> (class, how it is built): see _code


def _code(kind: type) -> int:
    """The code of ``kind`` in ``_CLASSES`` when ``flatten`` writes its values as fields and
    the sink builds it again: a namedtuple (by position, ``_make``), torch's structseq results
    (``torch.return_types.max``: ``values, indices``, built from the sequence; found by an
    attack, they came back as ``NotKept``), a Hugging Face ``ModelOutput`` (by name,
    ``_output``); -1 for any other class. Dynamo runs it once per class while it traces, and
    the graph holds the number (``torch._dynamo.assume_constant_result``, in ``prepare``)."""
    if issubclass(kind, tuple):
        how = MAKE if isinstance(getattr(kind, "_fields", None), tuple) else \
            SEQUENCE if isinstance(getattr(kind, "n_sequence_fields", None), int) else -1
    else:
        how = BY_NAME if issubclass(kind, dict) and any(
            c.__name__ == "ModelOutput" for c in kind.__mro__) else -1
    if how < 0:
        return -1
    if (kind, how) not in _CLASSES:
        _CLASSES.append((kind, how))
    return _CLASSES.index((kind, how))


_class_code: list[Callable[[type], int]] = [_code]  # wrapped for dynamo by prepare


class NotKept:
    """What a capture inside a ``torch.compile`` graph records in place of a value that is no
    tensor, number, string, ``None`` or plain tuple/list/dict of them (``flatten``): a graph
    hands out tensors only. ``name`` is the value's type (``"DynamicCache"``); the eager model
    (``compiled._orig_mod``) keeps the object itself."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"NotKept({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NotKept) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


@functools.lru_cache(maxsize=1024)
def _template(spec: str) -> Any:
    return ast.literal_eval(spec)  # Ellipsis for a tensor, b"#" for a number, {name} NotKept


def _filled(values: list[Tensor], spec: str) -> Any:
    """The value ``flatten`` wrote as ``spec``, with ``values`` in place of its tensors."""
    if spec == "...":  # a module's output: one tensor
        return values[0]
    return _fill(_template(spec), iter(values))


def _fill(template: Any, values: Any) -> Any:
    if template is Ellipsis:
        return next(values)
    kind = type(template)
    if kind is bytes:  # b"#": a number, handed out as a 0-d tensor
        return next(values).item()
    if kind is set:
        return NotKept(next(iter(template)))
    if kind is tuple or kind is list:
        return kind(_fill(v, values) for v in template)
    if kind is dict:
        if b"@" in template:  # a namedtuple or ModelOutput, by its code (_code)
            cls, how = _CLASSES[template[b"@"]]
            fields = _fill(template[b"="], values)
            if how == BY_NAME:
                return _output(cls, fields)
            return cls._make(fields.values()) if how == MAKE else cls(list(fields.values()))
        return {k: _fill(v, values) for k, v in template.items()}
    return template


def _output(cls: type, fields: dict[str, Any]) -> Any:
    """The ``ModelOutput`` ``cls`` holding ``fields``, each set as the model set it (keys in
    order, ``None`` fields left out); ``NotKept`` when ``cls`` cannot be built so."""
    try:
        try:
            built = cls()  # every field optional, as transformers' own outputs
        except TypeError:  # a required first field (transformers allows one)
            first = dataclasses.fields(cls)[0].name
            built = cls(**{first: fields[first]})
        for name, field in fields.items():
            built[name] = field
    except Exception:  # noqa: BLE001 - a class of the user's own: its constructor is theirs
        return NotKept(cls.__name__)
    return built
