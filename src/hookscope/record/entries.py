"""Entries: everything recorded under one record name, with the inputs of one call as read back.

A capture session appends each call's output (and inputs, gradients) to the ``Entry`` of its
record name; ``Records`` (``hookscope.record.records``) reads them, ``CallInputs`` included.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.engine import NO_TOKENS, RecordKey, Tokens, bind_arguments, describe
from hookscope.record.grads import GradRecord

__all__ = ["CallInputs", "Entry"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class CallInputs:
    """The inputs of one call: ``args`` and ``kwargs`` as passed, ``named`` bound to the
    signature of ``forward`` (``{'hidden_states': Tensor, 'attention_mask': Tensor, ...}``).

    ``inputs[0]`` is the first argument and ``inputs["attention_mask"]`` the named one, whether
    the caller passed it by position or by keyword.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    named: dict[str, Any]

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, int):
            return list(self.named.values())[key]
        return self.named[key]

    def __repr__(self) -> str:
        """One line like ``Capture``'s: each named input as its shape and dtype (a tensor) or
        its type (a cache, a list), the first six; never the values."""
        shown = [f"{name}: {_brief(value)}" for name, value in list(self.named.items())[:6]]
        more = f", … {len(self.named) - 6} more" if len(self.named) > 6 else ""
        return f"<hookscope.CallInputs {', '.join(shown)}{more}>"


class Entry:
    """Everything recorded under one record name (``key.name``, ``key`` a ``RecordKey``
    without a call); the capture session appends to the lists."""

    __slots__ = ("_key", "name", "module", "function", "outputs", "inputs", "grads", "grad_inputs",
                 "broken", "runs")

    def __init__(self, key: RecordKey | None, module: nn.Module | None = None,
                 name: str | None = None):
        """``key`` may be None when a subclass builds it on first use (``_make_key``) and the
        caller gives ``name`` (a capture names one record per module, and reads few keys)."""
        self._key = key
        self.name = name if name is not None else key.name if key is not None else ""
        self.module = module
        self.function: Callable[..., Any] | None = None  # for a function-level record
        self.outputs: list[Any] = []
        self.inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.grads: list[GradRecord] = []
        self.grad_inputs: list[GradRecord] = []
        self.broken: set[int] = set()  # calls whose value was overwritten in place
        # (first call, Tokens) of each forward pass that said anything about its tokens (a
        # mask, a KV cache, padding), and of every one after the first such: calls from
        # ``first call`` on were made with those tokens
        self.runs: list[tuple[int, Tokens]] = []

    def tokens(self, call: int) -> Tokens:
        """The ``Tokens`` (mask, cache length) of the forward pass that made call ``call``."""
        found = NO_TOKENS
        for start, tokens in self.runs:
            if start > call:
                break
            found = tokens
        return found

    @property
    def key(self) -> RecordKey:
        """The ``RecordKey`` of this record (no call)."""
        if self._key is None:
            self._key = self._make_key()
        return self._key

    def _make_key(self) -> RecordKey:
        """The key of an entry built without one (a subclass that can build it says how)."""
        raise NotImplementedError(f"{type(self).__name__} was built without a RecordKey")

    def clear(self) -> None:
        for kept in (self.outputs, self.inputs, self.grads, self.grad_inputs, self.runs):
            kept.clear()
        self.broken.clear()


def _brief(value: Any) -> str:
    """A value in a few characters: ``2x5 int64`` for a tensor, ``None``, ``True``, else its type."""
    if isinstance(value, Tensor):
        return f"{describe(value) or 'scalar'} {str(value.dtype).removeprefix('torch.')}"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return type(value).__name__


def _bind(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bind inputs to the parameter names of the module's forward, or of the function called
    for a function-level record (``query``, ``key``, ``value``, ... of SDPA)."""
    if entry.function is not None:
        return bind_arguments(entry.function, args, kwargs)
    try:
        if entry.module is None:
            raise TypeError
        bound = inspect.signature(entry.module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{str(i): a for i, a in enumerate(args)}, **kwargs}
    bound.apply_defaults()
    return dict(bound.arguments)
