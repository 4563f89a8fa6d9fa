"""Private: walk and rebuild nested outputs (tensors in tuples, lists, dicts, dataclasses).

Module outputs come in every shape: a tensor, ``(output, attn_weights)``, an LSTM's
``(output, (h, c))``, a dict, a dataclass, transformers' ``ModelOutput`` (an ordered dict that is
also a dataclass). ``map_tensors`` rebuilds the same structure with each tensor replaced;
non-tensor leaves (``None``, ints, strings) are kept as they are.

A part of a tensor may be a **heads part** (``heads_part``), the per-head view of an attention
projection's ``(batch, seq, features)`` output: ``"heads:8"`` is ``(batch, seq, heads,
8)`` (``features`` cut into heads of 8), ``"heads:8:1/3"`` the second of three equal chunks
of the features (GPT-2's fused ``c_attn``: q, k, v) cut so, ``"heads:8:1%3"`` the second of
three pieces interleaved inside each head (GPT-NeoX's ``query_key_value``: per head q, k, v),
``"heads"`` a value already ``(batch, seq, heads, head_dim)``. ``get_part`` returns the view;
``set_part`` writes a new value through it into a copy of the tensor (autograd follows both).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Keys", "describe_keys", "get_part", "heads_part", "iter_tensors", "iter_tensors_with_keys",
           "map_tensors", "map_tensors_with_keys", "set_part"]

Tensor = torch.Tensor

HEADS_PART = re.compile(r"heads(?::(\d+)(?::(\d+)([/%])(\d+))?)?")


def heads_part(head_dim: int | None, piece: int = 0, pieces: int = 1, *,
               interleaved: bool = False) -> str:
    """The heads part (module docstring) of piece ``piece`` of ``pieces`` of a projection's
    features, heads of ``head_dim``; ``head_dim=None``: the value is already split."""
    if head_dim is None:
        return "heads"
    if pieces == 1:
        return f"heads:{head_dim}"
    return f"heads:{head_dim}:{piece}{'%' if interleaved else '/'}{pieces}"


def _heads_view(t: Tensor, key: str) -> Tensor:
    """``t[..., features]`` as ``(..., heads, head_dim)`` by heads part ``key`` (a view).

    Raises:
        KeyError: the last axis does not split so.
    """
    match = HEADS_PART.fullmatch(key)
    assert match is not None
    if match.group(1) is None:
        return t
    head_dim, features = int(match.group(1)), int(t.shape[-1]) if t.dim() else 0
    pieces = int(match.group(4) or 1)
    if t.dim() < 2 or head_dim == 0 or features % (head_dim * pieces):
        raise KeyError(f"part [{key!r}] cuts the last axis into {pieces} piece(s) of heads of "
                       f"{head_dim}, but the value has shape {tuple(t.shape)}")
    piece = int(match.group(2) or 0)
    if match.group(3) == "%":  # (..., heads, pieces, head_dim): per head q, k, v
        return t.view(*t.shape[:-1], -1, pieces, head_dim)[..., piece, :]
    size = features // pieces
    return t[..., piece * size:(piece + 1) * size].view(*t.shape[:-1], -1, head_dim)


def map_tensors(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """Return ``obj`` rebuilt with ``fn(t)`` in place of every tensor ``t`` inside it."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(fn, v) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple (its own __new__ aside)
            return type(obj)._make(items)  # type: ignore[attr-defined]
        return type(obj)(items) if type(obj) in (list, tuple) else _rebuild_sequence(obj, items)
    if isinstance(obj, dict):
        mapped = {k: map_tensors(fn, v) for k, v in obj.items()}
        return _rebuild_mapping(obj, mapped)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name))
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def map_tensors_with_keys(fn: Callable[[Tensor, Keys], Any], obj: Any) -> Any:
    """``map_tensors`` whose function also gets each tensor's keys (``get_part(obj, keys)``)."""
    keys = iter([k for k, _ in iter_tensors_with_keys(obj)])
    return map_tensors(lambda t: fn(t, next(keys)), obj)


def iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Yield every tensor inside ``obj``, depth first, in the order ``map_tensors`` visits them."""
    for _, tensor in iter_tensors_with_keys(obj):
        yield tensor


def get_part(obj: Any, keys: tuple[int | str, ...]) -> Any:
    """Return ``obj[k0][k1]...``: a part of a structured output, as in the pattern ``lstm[1][0]``.

    Raises:
        KeyError: a key is missing; the message lists the keys that exist at that level.
    """
    for depth, key in enumerate(keys):
        obj = _index(obj, key, keys[:depth])
    return obj


def set_part(obj: Any, keys: tuple[int | str, ...], value: Any) -> Any:
    """Return a copy of ``obj`` whose part ``keys`` is ``value`` (the rest shared, not copied)."""
    if not keys:
        return value
    head, rest = keys[0], keys[1:]
    new_child = set_part(_index(obj, head, ()), rest, value)
    if isinstance(obj, Tensor):  # a heads part: write through the view into a copy
        new = obj.clone()
        _heads_view(new, str(head)).copy_(new_child)
        return new
    if isinstance(obj, tuple):
        items = list(obj)
        items[head] = new_child  # type: ignore[index]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        items = list(obj)
        items[head] = new_child  # type: ignore[index]
        return items
    if isinstance(obj, dict):
        return _rebuild_mapping(obj, {**obj, head: new_child})
    return dataclasses.replace(obj, **{str(head): new_child})


def describe_keys(obj: Any) -> str:
    """Name the parts of ``obj`` one level down, for error messages: ``[0]..[2]`` or ``['a', 'b']``."""
    if isinstance(obj, (list, tuple)):
        return f"[0]..[{len(obj) - 1}]" if obj else "no parts (empty)"
    if isinstance(obj, dict):
        return str(list(obj.keys()))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return str([f.name for f in dataclasses.fields(obj)])
    return f"no parts (a {type(obj).__name__})"


def _index(obj: Any, key: int | str, where: tuple[int | str, ...]) -> Any:
    if isinstance(obj, Tensor) and isinstance(key, str) and HEADS_PART.fullmatch(key):
        return _heads_view(obj, key)
    try:
        if isinstance(obj, (list, tuple)) and isinstance(key, int):
            return obj[key]
        if isinstance(obj, dict):
            return obj[key]
        if dataclasses.is_dataclass(obj) and isinstance(key, str):
            return getattr(obj, key)
    except (IndexError, KeyError, AttributeError):
        pass
    at = "".join(f"[{k!r}]" for k in where) or "the output"
    raise KeyError(f"{at} has no part [{key!r}]; it has {describe_keys(obj)}")


def _rebuild_sequence(obj: Any, items: list[Any]) -> Any:
    try:
        return type(obj)(items)
    except TypeError:
        return items


def _rebuild_mapping(obj: dict[Any, Any], mapped: dict[Any, Any]) -> Any:
    if type(obj) is dict:
        return mapped
    try:  # OrderedDict, transformers' ModelOutput (takes keyword fields)
        return type(obj)(**mapped) if dataclasses.is_dataclass(obj) else type(obj)(mapped)
    except TypeError:
        return mapped


Keys = tuple[int | str, ...]


def iter_tensors_with_keys(obj: Any, keys: Keys = ()) -> Iterator[tuple[Keys, Tensor]]:
    """Yield ``(keys, tensor)`` for every tensor inside ``obj``; ``get_part(obj, keys)`` is it."""
    if isinstance(obj, Tensor):
        yield keys, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors_with_keys(v, (*keys, i))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors_with_keys(v, (*keys, k))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors_with_keys(getattr(obj, f.name), (*keys, f.name))
