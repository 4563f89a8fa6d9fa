"""Token positions: which ``(batch row, sequence index)`` pairs a ``positions=`` argument means.

One resolution serves the edits (``patch``, ``ablate``, ``steer``) and extraction's
``"first"``/``"last"`` reductions, so an edit and a stored row always agree on what "the last
token" is.

A position is counted among the **real tokens** of each row whenever an attention mask
``(batch, seq)`` is known (1 = real token, 0 = padding): ``-1`` is the last real token of each row
of a right-padded batch, and ``0`` the first real token of a left-padded one. A padding position is
never selected. Pass ``absolute=True`` to index dim 1 as it is, padding included, on purpose.
Without a mask, positions index dim 1 as it is (negative from its end), as Python indexing does.

**Which axis holds the tokens** (``value_axes``): a module's output is ``(batch, seq, ...)`` by
convention; the value ``scaled_dot_product_attention`` returns is ``(batch, heads, query,
head_dim)`` (its query axis is always the second to last), so its tokens are dim 2 and its heads
dim 1; any other value a function returns (``"path::fn"`` addresses) has no known layout and
needs ``seq_dim=``, else it is refused with its shape named. ``heads=`` selects heads where the
layout has a heads axis.

Forms of ``positions``:

- ``int``: one position per row, e.g. ``-1``;
- a sequence of ints, e.g. ``[0, -1]``: those positions of every row, in that order;
- ``slice``: e.g. ``slice(-3, None)``, the last three real tokens of each row;
- a boolean tensor ``(seq,)`` or ``(batch, seq)``: the ``True`` entries (absolute by nature; with
  a known mask it may not mark a padding position unless ``absolute=True``);
- ``None``: every position (every real one when a mask is known).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.errors import PositionError

__all__ = ["Positions", "Heads", "Axes", "MaskWatcher", "resolve_positions", "take_positions",
           "value_axes", "selected", "resolve_heads", "tokens_first"]

Tensor = torch.Tensor
Positions = int | Sequence[int] | slice | Tensor | None
Heads = int | Sequence[int] | None

#: functions whose value has a known layout: its token axis is the second to last (the queries
#: of ``(batch, heads, query, head_dim)``), its heads axis dim 1 when it has four dims
_QUERY_LAST_BUT_ONE = frozenset({"scaled_dot_product_attention"})


@dataclass(frozen=True)
class Axes:
    """Where the tokens and (if any) the attention heads are in one value.

    Attributes:
        seq: the token axis (``1`` for a ``(batch, seq, ...)`` module output, ``2`` for
            scaled_dot_product_attention's ``(batch, heads, query, head_dim)``).
        heads: the heads axis, or ``None`` when the value has none hookscope knows.
    """

    seq: int
    heads: int | None = None


def value_axes(key: str, op: str | None, shape: Sequence[int], seq_dim: int | None = None,
               *, heads: bool = False) -> Axes:
    """The token (and heads) axes of the value recorded as ``key``, of ``shape``.

    Args:
        key: the record name, for messages (``"h.0.attn::scaled_dot_product_attention"``).
        op: the function of a ``"path::fn"`` address (``"softmax#1"``), ``None`` for a module.
        shape: the value's shape.
        seq_dim: the token axis given by the user (negative counts from the end); wins.
        heads: the caller selects heads, so the value must have a heads axis.

    Raises:
        PositionError: ``seq_dim`` is the batch axis or out of range; ``op`` is a function whose
            layout hookscope does not know and no ``seq_dim`` is given; ``heads`` and the
            value has no heads axis (the message names the shape and the fix).
    """
    dims = len(shape)
    known = op is not None and op.split("#")[0] in _QUERY_LAST_BUT_ONE and dims >= 3
    head_axis = 1 if known and dims == 4 else None
    if seq_dim is not None:
        if not -dims <= seq_dim < dims or seq_dim % dims == 0:
            raise PositionError(f"seq_dim={seq_dim} is not a token axis of '{key}', shape "
                                f"{tuple(shape)}: give one of 1 … {dims - 1} (dim 0 is the batch)")
        axes = Axes(seq_dim % dims, head_axis)
    elif known:
        axes = Axes(dims - 2, head_axis)
    elif op is None:
        if dims < 3:  # (batch, features): dim 1 is features, as reduce="first" refuses it
            raise PositionError(
                f"positions index the token axis, dim 1 of a (batch, seq, ...) module output, but "
                f"'{key}' has shape {tuple(shape)}, without one (dim 1 of a (batch, features) "
                f"output is features, not tokens); select a module that returns (batch, seq, "
                f"features), or give seq_dim=1 if dim 1 really holds the tokens")
        axes = Axes(1)
    else:
        raise PositionError(
            f"positions on '{key}': it is the value of the function {op.split('#')[0]}, shape "
            f"{tuple(shape)}, and hookscope knows the token axis only of module outputs ((batch, "
            f"seq, ...)) and of scaled_dot_product_attention ((batch, heads, query, head_dim)); "
            f"give seq_dim=N, the axis that holds the tokens")
    if heads and axes.heads is None:
        path = key.split("::")[0].split("[")[0]  # the module, without parts
        raise PositionError(
            f"heads= on '{key}', shape {tuple(shape)}: this value has no heads axis (the heads "
            f"of an attention module's output are already mixed); select the attention's "
            f"'{path}::scaled_dot_product_attention', shape (batch, heads, query, head_dim)")
    return axes


def resolve_heads(heads: Heads, count: int, key: str) -> Tensor:
    """``heads`` (an int or a sequence of ints, negative from the end) as int64 indices.

    Raises:
        PositionError: a head that does not exist among ``count``, or not an int.
    """
    wanted = _ints(heads, "heads")
    for h in wanted:
        if not -count <= h < count:
            raise PositionError(f"head {h} does not exist in '{key}', which has {count} heads: "
                                f"use -{count} … {count - 1}")
    return torch.tensor([h % count for h in wanted], dtype=torch.long)


def selected(shape: Sequence[int], axes: Axes, positions: Positions, heads: Heads, key: str,
             attention_mask: Tensor | None = None, *, absolute: bool = False) -> Tensor:
    """A boolean tensor that broadcasts to ``shape``: True where ``positions`` (on the token
    axis; ``None``: all of it) and ``heads`` (on the heads axis; ``None``: all) meet; CPU.

    Raises:
        PositionError: as ``resolve_positions`` and ``resolve_heads``.
    """
    batch, seq = int(shape[0]), int(shape[axes.seq])
    sizes = [1] * len(shape)
    sizes[0], sizes[axes.seq] = batch, seq
    tokens = torch.ones(batch, seq, dtype=torch.bool)
    if positions is not None:
        rows, columns = resolve_positions(positions, (batch, seq), attention_mask,
                                          absolute=absolute)
        tokens = torch.zeros(batch, seq, dtype=torch.bool)
        tokens[rows.cpu(), columns.cpu()] = True
    chosen = tokens.reshape(sizes)
    if heads is not None and axes.heads is not None:
        count = int(shape[axes.heads])
        head_sizes = [1] * len(shape)
        head_sizes[axes.heads] = count
        picked = torch.zeros(count, dtype=torch.bool)
        picked[resolve_heads(heads, count, key)] = True
        chosen = chosen & picked.reshape(head_sizes)
    return chosen


def tokens_first(t: Tensor, axes: Axes) -> Tensor:
    """A view of ``t`` as ``(batch, seq, heads, ...)`` (``(batch, seq, ...)`` without heads);
    writing into it writes into ``t``."""
    if axes.heads is None:
        return t.movedim(axes.seq, 1)
    return t.movedim((axes.seq, axes.heads), (1, 2))


def resolve_positions(positions: Positions, shape: Sequence[int], attention_mask: Tensor | None = None,
                      *, absolute: bool = False) -> tuple[Tensor, Tensor]:
    """Turn ``positions`` into the selected ``(rows, columns)`` of a ``(batch, seq, ...)`` tensor.

    Args:
        positions: see the module docstring.
        shape: the tensor's shape; only ``(batch, seq)`` is read.
        attention_mask: ``(batch, seq)`` (any dtype; nonzero = real token) or ``None``.
        absolute: index dim 1 as it is, padding included, even when a mask is given.

    Returns:
        ``(rows, columns)``: two int64 tensors of the same length ``n`` on the mask's device (CPU
        without a mask), row-major, and within a row in the order ``positions`` gives them, so
        ``t[rows, columns]`` is ``(n, ...)``. For an int, ``n == batch`` and ``columns[b]`` is
        the position in row ``b``.

    Raises:
        PositionError: the tensor has no dim 1; the mask's shape is not ``(batch, seq)``; a
            position is out of range for a row (the message names the row and its real token
            count); a boolean mask of the wrong shape or marking padding; an unknown form.
    """
    if len(shape) < 2:
        raise PositionError(f"positions index dim 1 (the sequence), but the tensor has shape "
                            f"{tuple(shape)}, without one")
    batch, seq = int(shape[0]), int(shape[1])
    mask = None if absolute else _checked_mask(attention_mask, batch, seq)
    device = attention_mask.device if attention_mask is not None else torch.device("cpu")
    if isinstance(positions, Tensor) and positions.dtype == torch.bool:
        return _from_bool(positions, batch, seq, mask, device)
    rows: list[int] = []
    columns: list[int] = []
    for row in range(batch):
        real = list(range(seq)) if mask is None else mask[row].nonzero().flatten().tolist()
        for index in _pick(positions, real, row, seq, mask is not None):
            rows.append(row)
            columns.append(index)
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(columns, dtype=torch.long, device=device))


def take_positions(t: Tensor, positions: Positions, attention_mask: Tensor | None = None, *,
                   absolute: bool = False) -> Tensor:
    """The rows of ``t`` at ``positions``: ``(batch, ...)`` for an int, else ``(n, ...)``.

    ``take_positions(hidden, -1, batch["attention_mask"])`` is the last real token of each row,
    ``(batch, d_model)``, whichever side the batch is padded on; ``0`` gives the first (CLS).

    Raises:
        PositionError: as ``resolve_positions``.
    """
    rows, columns = resolve_positions(positions, t.shape, attention_mask, absolute=absolute)
    return t[rows.to(t.device), columns.to(t.device)]


def _checked_mask(mask: Tensor | None, batch: int, seq: int) -> Tensor | None:
    if mask is None:
        return None
    if tuple(mask.shape) != (batch, seq):
        raise PositionError(
            f"the attention mask has shape {tuple(mask.shape)} but the output's (batch, seq) is "
            f"({batch}, {seq}), so positions cannot be counted among real tokens; give the mask "
            f"of this input (attention_mask=...), or absolute=True to index dim 1 as it is")
    return mask != 0


def _pick(positions: Positions, real: list[int], row: int, seq: int, masked: bool) -> list[int]:
    """Absolute indices in one row; ``real`` lists the row's real token indices."""
    counted = "real tokens" if masked else "positions"
    if positions is None:
        return real
    if isinstance(positions, slice):
        return real[positions]
    if isinstance(positions, bool) or isinstance(positions, Tensor) and positions.dim() > 1:
        raise PositionError(f"positions={positions!r} is not a position: give an int, a list of "
                            f"ints, a slice or a boolean mask")
    wanted = _ints(positions)
    picked = []
    for p in wanted:
        if not -len(real) <= p < len(real):
            raise PositionError(
                f"position {p} does not exist in batch row {row}, which has {len(real)} {counted}"
                f"{f' (of {seq})' if masked else ''}: use -{len(real)} … {len(real) - 1}"
                f"{', or absolute=True to index padding on purpose' if masked else ''}")
        picked.append(real[p])
    return picked


def _ints(positions: Any, name: str = "positions") -> list[int]:
    """``positions`` as Python ints: an int-like (numpy, 0-dim tensor) or a sequence of them."""
    if isinstance(positions, Tensor):
        positions = positions.tolist()
    try:
        values = list(positions)
    except TypeError:
        values = [positions]
    try:
        if any(isinstance(p, bool) for p in values):
            raise TypeError
        return [operator.index(p) for p in values]
    except TypeError:
        forms = "a list of ints, a slice or a boolean mask" if name == "positions" else "a list of ints"
        raise PositionError(f"{name}={positions!r} is not a {name[:-1]}: give an int, "
                            f"{forms}") from None


def _from_bool(selected: Tensor, batch: int, seq: int, mask: Tensor | None,
               device: torch.device) -> tuple[Tensor, Tensor]:
    if tuple(selected.shape) == (seq,):
        selected = selected.expand(batch, seq)
    if tuple(selected.shape) != (batch, seq):
        raise PositionError(f"a boolean positions mask must have shape (seq,) = ({seq},) or "
                            f"(batch, seq) = ({batch}, {seq}); got {tuple(selected.shape)}")
    selected = selected.to(device)
    if mask is not None:
        padding = selected & ~mask.to(device)
        if padding.any():
            row, column = padding.nonzero()[0].tolist()
            raise PositionError(
                f"the boolean positions mask marks padding (row {row}, position {column} has "
                f"attention mask 0); mark real tokens only, or pass absolute=True to edit "
                f"padding on purpose")
    rows, columns = selected.nonzero(as_tuple=True)
    return rows, columns


class MaskWatcher:
    """Keeps the ``attention_mask`` the root module was called with in the current forward pass.

    Register ``watcher.hook`` as a forward pre-hook with ``with_kwargs=True`` on the root; the
    mask is read by name (``attention_mask``) whether passed by keyword or by position.
    ``current`` is ``None`` when the call has none. An explicit mask given at construction wins.
    """

    def __init__(self, model: nn.Module, given: Tensor | None = None):
        self.given = given
        self.current: Tensor | None = given
        self._index = _positional_index(model, "attention_mask")

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.current = self.find(module, args, kwargs)

    def find(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
        """The mask of the call ``(args, kwargs)`` (``given`` when set), or None."""
        if self.given is not None:
            return self.given
        found = kwargs.get("attention_mask")
        if found is None and self._index is not None and len(args) > self._index:
            found = args[self._index]
        return found if isinstance(found, Tensor) else None

    def set(self, mask: Tensor | None) -> None:
        """Make ``mask`` the current one (a compiled call's, ``engine.compiled``)."""
        self.current = mask

    def mask_for(self, shape: Sequence[int]) -> Tensor | None:
        """The mask of an output of ``shape`` ``(batch, seq, ...)``: the current mask, or, when
        it is wider (a KV cache: it covers the past tokens too, as transformers' ``generate()``
        passes it), its last ``seq`` columns, which are the tokens of this forward."""
        mask = self.current
        if (mask is not None and mask.dim() == 2 and len(shape) >= 2 and mask.shape[0] == shape[0]
                and mask.shape[1] > shape[1]):
            return mask[:, mask.shape[1] - shape[1]:]
        return mask


def _positional_index(model: nn.Module, name: str) -> int | None:
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(name) if name in names else None
