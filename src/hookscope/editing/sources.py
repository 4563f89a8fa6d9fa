"""Private: read recorded values back by (module, part, call, tensor position), from a
``Capture``, ``Records`` that ``hookscope.load`` returned, a ``{key: tensor}`` dict, or a
safetensors file that ``save`` wrote.

``patch`` and ``ablate`` take their values from such a source. A file holds flat keys (``fc1``,
``relu:2``, ``lstm[1][0]``, see ``hookscope.records``); loading rebuilds the structure, and the
live output being edited decides which tensor is taken, so any output structure can be patched
from a file.
"""

from __future__ import annotations

import os
from typing import Any, Union

import torch

from hookscope.engine import Target, Tokens
from hookscope.errors import CaptureError, EditError
from hookscope.record import Capture, Records, load
from hookscope.util import get_part

__all__ = ["Source", "SourceReader"]

Tensor = torch.Tensor
Keys = tuple[int | str, ...]
Source = Union[Capture, Records, dict[str, Tensor], str, "os.PathLike[str]"]


class SourceReader:
    """Values recorded for the modules of one model, in the same call order as the live run.

    Args:
        source: a ``Capture`` (after its ``with`` block), ``Records`` from ``hookscope.load``,
            ``{key: tensor}`` as a file holds them, or the path of a file written by ``save``.
        role: the argument's name for messages (``"source"``, ``"reference"``).

    Raises:
        EditError: ``source`` is none of these.
    """

    def __init__(self, source: Source, role: str):
        if isinstance(source, (str, os.PathLike)):
            source = load(source)
        if isinstance(source, Capture):
            source = source.records
        if isinstance(source, dict):
            source = Records.from_tensors(source)
        if not isinstance(source, Records):
            raise EditError(f"{role} must be a hookscope Capture, Records from hookscope.load(), "
                            f"or a .safetensors file written by save; got {type(source).__name__}")
        self.source = source
        self.role = role

    def keys(self) -> list[str]:
        """Record names (paths with parts, no call suffix) that the source holds."""
        return [name for name, n in self.source.counts.items() if n]

    def count(self, target: Target) -> int:
        """Number of calls recorded for ``target`` (by its record name, or its module's)."""
        counts = self.source.counts
        return counts.get(target.key, 0) or counts.get(target.path, 0)

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
        value = self._value(target, call)
        try:
            leaf = get_part(value, keys)
        except KeyError as err:
            raise EditError(f"the {self.role}'s record of call {call} of '{target.key}' has a "
                            f"different structure from this run's output: {err.args[0]}") from None
        if not isinstance(leaf, Tensor):
            raise EditError(f"the {self.role}'s record of call {call} of '{target.key}'"
                            f"{_suffix(keys)} is a {type(leaf).__name__}, not a tensor")
        return leaf

    def tokens(self, target: Target, call: int) -> Tokens:
        """The ``Tokens`` (the mask its capture saw) of the forward that made call ``call``."""
        name = target.key if self.source.counts.get(target.key) else target.path
        return self.source.tokens(name, call)

    def _value(self, target: Target, call: int) -> Any:
        name = target.key if self.source.counts.get(target.key) else target.path
        try:
            return get_part(self.source[name, call], () if name == target.key else target.parts)
        except (KeyError, CaptureError) as err:
            raise EditError(f"cannot take '{target.key}' from the {self.role}: {err.args[0]}") from None


def _suffix(keys: Keys) -> str:
    return "".join(f"[{k}]" for k in keys)


def _listing(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8])
    return (shown + (" …" if len(keys) > 8 else "")) if keys else "nothing"
