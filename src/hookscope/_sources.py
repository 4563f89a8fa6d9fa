"""Private: read recorded values back by (module, part, call, tensor position), from a ``Capture``,
a dict that ``hookscope.load`` returned, or a safetensors file ``Capture.save`` wrote.

``patch`` and ``ablate`` take their values from such a source. A file holds flat keys (``fc1``,
``relu:2``, ``lstm[1][0]``, see ``hookscope.records``); the structure comes from the live output
being edited, so any output structure can be patched from a file.
"""

from __future__ import annotations

import os
import re
from typing import Any, Union

import torch

from hookscope._nested import get_part
from hookscope.capture import Capture
from hookscope.errors import EditError
from hookscope.records import load
from hookscope.select import Target

__all__ = ["Source", "Records"]

Tensor = torch.Tensor
Keys = tuple[int | str, ...]
Source = Union[Capture, dict[str, Tensor], str, "os.PathLike[str]"]


class Records:
    """Values recorded for the modules of one model, in the same call order as the live run.

    Args:
        source: a ``Capture`` (after its ``with`` block), ``{key: tensor}`` from
            ``hookscope.load``, or the path of a file written by ``Capture.save``.
        role: the argument's name for messages (``"source"``, ``"reference"``).

    Raises:
        EditError: ``source`` is none of these.
    """

    def __init__(self, source: Source, role: str):
        if isinstance(source, (str, os.PathLike)):
            source = load(source)
        if not isinstance(source, (Capture, dict)):
            raise EditError(f"{role} must be a hookscope Capture, a dict from hookscope.load(), or "
                            f"a .safetensors file written by Capture.save; got {type(source).__name__}")
        self.source = source
        self.role = role

    def keys(self) -> list[str]:
        """Record names (paths with parts, no call suffix) that the source holds."""
        if isinstance(self.source, Capture):
            return list(self.source)
        stems = (re.sub(r"(:\d+)?(\[[^\]]*\])*$", "", key) for key in self.source)
        return list(dict.fromkeys(stems))

    def count(self, target: Target) -> int:
        """Number of calls recorded for ``target`` (by its record name, or its module's)."""
        if isinstance(self.source, Capture):
            counts = self.source.counts
            return counts.get(target.key, 0) or counts.get(target.path, 0)
        return len(_file_stems(self.source, target.key) or _file_stems(self.source, target.path))

    def calls(self, target: Target, keys: Keys) -> list[Tensor]:
        """The tensor at position ``keys`` of every recorded call of ``target``, in order."""
        return [self.leaf(target, call, keys) for call in range(self.count(target))]

    def leaf(self, target: Target, call: int, keys: Keys) -> Tensor:
        """The tensor at position ``keys`` (inside the target's output part) of call ``call``.

        Raises:
            EditError: the source holds no record of the module, fewer calls, or no tensor there.
        """
        recorded = self.count(target)
        if recorded == 0:
            raise EditError(f"the {self.role} holds no record of '{target.key}' (it has "
                            f"{_listing(self.keys())}); capture that module in the {self.role} run")
        if call >= recorded:
            raise EditError(
                f"'{target.key}' reached call {call} in this run, but the {self.role} holds "
                f"{recorded} call{'s' if recorded != 1 else ''} of it: the runs differ (another "
                f"input, or the model ran more than once inside the block; enter the edit once "
                f"per forward pass)")
        if isinstance(self.source, Capture):
            value = _captured(self.source, target, call, self.role)
        else:
            value = _stored(self.source, target, call, keys, self.role)
            keys = ()
        try:
            leaf = get_part(value, keys)
        except KeyError as err:
            raise EditError(f"the {self.role}'s record of call {call} of '{target.key}' has a "
                            f"different structure from this run's output: {err.args[0]}") from None
        if not isinstance(leaf, Tensor):
            raise EditError(f"the {self.role}'s record of call {call} of '{target.key}'"
                            f"{_suffix(keys)} is a {type(leaf).__name__}, not a tensor")
        return leaf


def _captured(source: Capture, target: Target, call: int, role: str) -> Any:
    if target.key in source:
        return source[target.key, call]
    try:
        return get_part(source[target.path, call], target.parts)
    except KeyError as err:
        raise EditError(f"cannot take '{target.key}' from the {role}: {err.args[0]}") from None


def _stored(stored: dict[str, Tensor], target: Target, call: int, keys: Keys, role: str) -> Tensor:
    """The saved tensor of call ``call`` of ``target`` at ``keys``: under the record name
    (``lstm[0]:1``), else under the module's (``lstm:1[0]``)."""
    for base, inner in ((target.key, keys), (target.path, (*target.parts, *keys))):
        stems = _file_stems(stored, base)
        if stems:
            key = stems[call] + _suffix(inner)
            if key in stored:
                return stored[key]
            raise EditError(f"the {role} has no tensor '{key}' (it has "
                            f"{_listing([k for k in stored if k.startswith(base)])}): it was "
                            f"saved from an output of another structure")
    raise EditError(f"the {role} holds no record of '{target.key}'")


def _file_stems(stored: dict[str, Tensor], base: str) -> list[str]:
    """Key stems of each saved call of record ``base``: ``[base]`` for a module that ran once
    (keys ``base``, ``base[..]``), ``[base:0, base:1, ...]`` for one that ran several times."""
    pattern = re.compile(re.escape(base) + r":(\d+)(?:\[|$)")
    calls = [int(m.group(1)) for key in stored if (m := pattern.match(key))]
    if calls:
        return [f"{base}:{k}" for k in range(max(calls) + 1)]
    return [base] if base in stored or any(key.startswith(base + "[") for key in stored) else []


def _suffix(keys: Keys) -> str:
    return "".join(f"[{k}]" for k in keys)


def _listing(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8])
    return (shown + (" …" if len(keys) > 8 else "")) if keys else "nothing"
