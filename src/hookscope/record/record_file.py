"""The records file: how a safetensors file holds what a capture recorded.

A saved file (safetensors, no pickle) holds one tensor per key, the key without ``:call`` when
the record has one call, and the metadata ``hookscope.calls``: a JSON object ``{record name:
number of calls}``, plus any caller-given strings; ``hookscope.record.records.load`` reads both
back. ``Records.save`` writes it.
"""

from __future__ import annotations

import json
from typing import Any

import safetensors.torch
import torch

from hookscope.engine import Part, values_for
from hookscope.errors import HookscopeError

__all__: list[str] = []

Tensor = torch.Tensor


def _savable(key: str, t: Tensor) -> Tensor:
    """``t``'s values as its kind keeps them for a file (``engine.values.kinds``: a sparse tensor's
    dense values, a quantized one's dequantized values).

    Raises:
        HookscopeError: its kind cannot be saved (no values; a nested tensor), or safetensors
            has no type for its dtype (``torch.complex128``).
    """
    t = values_for(t, key, "save")
    if t.dtype not in _SAVABLE:
        fix = ("capture with dtype=torch.complex64, or save torch.view_as_real of it yourself"
               if t.is_complex() else "capture with dtype=torch.float32")
        raise HookscopeError(f"cannot save '{key}': it is {t.dtype}, which safetensors files "
                             f"cannot hold; {fix}")
    return t


# the dtypes a safetensors file holds (its torch adapter's table; complex128 is not among them)
_SAVABLE = frozenset(getattr(safetensors.torch, "_TYPES", {}).values()) or frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
     torch.int16, torch.int8, torch.uint8, torch.bool})


def _rebuild(leaves: dict[tuple[Part, ...], Tensor]) -> Any:
    """The structure that ``leaves`` (``{parts: tensor}``) came from: a tensor, or tuples for
    integer parts (missing positions None) and dicts for named parts."""
    if () in leaves:
        return leaves[()]
    children: dict[Part, dict[tuple[Part, ...], Tensor]] = {}
    for parts, tensor in leaves.items():
        children.setdefault(parts[0], {})[parts[1:]] = tensor
    built = {k: _rebuild(v) for k, v in children.items()}
    positions = [k for k in built if isinstance(k, int)]
    if len(positions) == len(built):
        return tuple(built.get(i) for i in range(max(positions) + 1))
    return built


def _aliases(text: str, names: list[str]) -> dict[str, str]:
    """A saved file's ``hookscope.aliases`` metadata (``{standard name or other path: record
    name}``), keeping the entries whose record the file holds; a damaged one is dropped (the
    records still read by their paths)."""
    try:
        aliases = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(aliases, dict):
        return {}
    return {k: v for k, v in aliases.items() if isinstance(k, str) and v in names}


def _call_names(text: str) -> list[str]:
    """The record names of a saved file's ``hookscope.calls`` metadata (``{name: calls}``).

    Raises:
        HookscopeError: the metadata is not such a JSON object (a damaged or foreign file).
    """
    try:
        calls = json.loads(text)
    except (ValueError, RecursionError):
        calls = None
    if not (isinstance(calls, dict) and all(type(n) is int for n in calls.values())):
        raise HookscopeError(f"the file's hookscope.calls metadata is not {{record name: calls}} "
                             f"(got {text!r:.60}): it is damaged or was not written by hookscope; "
                             f"read its tensors with safetensors.torch.load_file")
    return list(calls)
