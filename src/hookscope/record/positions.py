"""Token positions: which ``(batch row, sequence index)`` pairs a ``positions=`` argument means.

One resolution serves the edits (``patch``, ``ablate``, ``steer``) and extraction's
``"first"``/``"last"`` reductions, so an edit and a stored row always agree on what "the last
token" is.

A position is counted among the **real tokens** of each row whenever an attention mask
``(batch, seq)`` is known (1 = real token, 0 = padding): ``-1`` is the last real token of each row
of a right-padded batch, and ``0`` the first real token of a left-padded one. A padding position is
never selected. Pass ``absolute=True`` to index dim 1 as it is, padding included, on purpose.
Without a mask, positions index dim 1 as it is (negative from its end), as Python indexing does.

**Which axis holds the tokens**, and which tokens are real, is the value's ``Layout``
(``hookscope.engine.values.layout``: one description, read by every verb): dim 1 of a module output,
the query axis (dim 2) of ``scaled_dot_product_attention``'s ``(batch, heads, query,
head_dim)``, ``seq_dim=`` for any other function's value; the mask is that of the forward that
produced the value (a capture keeps it with each record, so a capture used as ``source=``
brings its own). ``heads=`` selects heads where the layout has a heads axis.

**Under a KV cache** (``generate()``), positions count the tokens of each forward pass by
default (``over="forward"``): ``positions=0`` is the first token of every forward, i.e. every
new token after the prompt. ``over="sequence"`` counts over the whole sequence so far, the
cached tokens included: ``0`` is the prompt's first token only, ``-1`` the newest token.

Forms of ``positions``:

- ``int``: one position per row, e.g. ``-1``;
- a sequence of ints, e.g. ``[0, -1]``: those positions of every row, in that order;
- ``slice``: e.g. ``slice(-3, None)``, the last three real tokens of each row;
- a boolean tensor ``(seq,)`` or ``(batch, seq)``: the ``True`` entries (absolute by nature; with
  a known mask it may not mark a padding position unless ``absolute=True``);
- ``None``: every position (every real one when a mask is known).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Literal

import torch

from hookscope.engine import Layout, Target, Tokens, brief, check_no_unmasked_padding, layout_of
from hookscope.errors import ArgumentValueError, PositionError

__all__ = ["Positions", "Heads", "Over", "resolve_positions", "take_positions", "layout_positions",
           "selected", "resolve_heads", "tokens_first", "real_tokens", "padding_dropped",
           "check_over"]

Tensor = torch.Tensor
Positions = int | Sequence[int] | slice | Tensor | None
Heads = int | Sequence[int] | None
#: what positions count: the tokens of each forward pass, or the whole sequence so far
Over = Literal["forward", "sequence"]

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


def layout_positions(positions: Positions, layout: Layout, key: str, *, absolute: bool = False,
                     over: Over = "forward") -> tuple[Tensor, Tensor]:
    """The ``(rows, columns)`` that ``positions`` selects on the token axis of a value of
    ``layout``: counted among the real tokens of ``layout.mask`` (the mask of the forward that
    produced the value) unless ``absolute``; columns index the value's token axis.

    ``over="forward"`` counts the tokens of this forward pass (under a KV cache, only the new
    ones: ``0`` is each forward's first token). ``over="sequence"`` counts the whole sequence
    so far, the cached tokens included (``layout.sequence_mask``, or ``past + seq`` positions
    without a mask): ``0`` is the prompt's first token, edited only in the forward that
    computes it, and ``-1`` the last token, the new one in every forward; positions outside
    this forward, or that the sequence has not reached yet (``positions=10`` before the 11th
    token), select nothing in it.

    Raises:
        PositionError: as ``resolve_positions``; the input looks padded but no mask was given
            (``engine.values.layout.check_no_unmasked_padding``) and ``positions`` is not ``None``.
    """
    if not absolute and positions is not None:
        check_no_unmasked_padding(layout.tokens, f"positions={positions!r} on '{key}'")
    if over == "forward":
        return resolve_positions(positions, (layout.rows, layout.length), layout.mask,
                                 absolute=absolute)
    mask = layout.sequence_mask
    width = layout.past + layout.length
    if isinstance(positions, Tensor) and positions.dtype == torch.bool and \
            positions.shape[-1] == layout.length:
        raise PositionError(f"a boolean positions mask with over='sequence' covers the whole "
                            f"sequence so far, ({layout.rows}, {width}) on '{key}'; got "
                            f"{tuple(positions.shape)}")
    if isinstance(positions, Tensor) and positions.dtype == torch.bool or \
            positions is None or isinstance(positions, slice):
        rows, columns = resolve_positions(positions, (layout.rows, width), mask, absolute=absolute)
    else:  # each position on its own: one the sequence has not reached yet selects nothing
        found = [resolve_positions(p, (layout.rows, width), mask, absolute=absolute)
                 for p in _ints(positions) if _reached(p, width, mask, absolute)]
        if not found:
            return (torch.zeros(0, dtype=torch.long),) * 2
        rows, columns = torch.cat([r for r, _ in found]), torch.cat([c for _, c in found])
        order = torch.sort(rows, stable=True).indices  # row-major, positions in the order given
        rows, columns = rows[order], columns[order]
    here = columns >= layout.past
    return rows[here], columns[here] - layout.past


def _reached(position: int, width: int, mask: Tensor | None, absolute: bool) -> bool:
    """True when every row of a sequence of ``width`` tokens so far has ``position``."""
    counts = [width] if mask is None or absolute else (mask != 0).sum(dim=1).tolist()
    return all(-n <= position < n for n in counts)


def check_over(over: object) -> None:
    """Refuse an ``over=`` that is neither ``"forward"`` nor ``"sequence"``, at the call."""
    if over not in ("forward", "sequence"):
        raise ArgumentValueError(f"over={over!r}: give over='forward' (positions count the tokens "
                                 f"of each forward pass) or over='sequence' (the whole sequence "
                                 f"so far, a KV cache's tokens included)")


def selected(layout: Layout, positions: Positions, heads: Heads, key: str, *,
             absolute: bool = False, over: Over = "forward") -> Tensor:
    """A boolean tensor that broadcasts to ``layout.shape``: True where ``positions`` (on the
    token axis, as ``layout_positions`` resolves them; ``None``: all of it) and ``heads`` (on
    the heads axis; ``None``: all) meet; CPU.

    Raises:
        PositionError: as ``layout_positions`` and ``resolve_heads``.
    """
    shape = layout.shape
    batch, seq = layout.rows, layout.length
    sizes = [1] * len(shape)
    sizes[layout.batch], sizes[layout.seq] = batch, seq
    tokens = torch.ones(batch, seq, dtype=torch.bool)
    if positions is not None:
        rows, columns = layout_positions(positions, layout, key, absolute=absolute, over=over)
        tokens = torch.zeros(batch, seq, dtype=torch.bool)
        tokens[rows.cpu(), columns.cpu()] = True
    chosen = (tokens if layout.batch < layout.seq else tokens.T).reshape(sizes)
    if heads is not None and layout.heads is not None:
        count = int(shape[layout.heads])
        head_sizes = [1] * len(shape)
        head_sizes[layout.heads] = count
        picked = torch.zeros(count, dtype=torch.bool)
        picked[resolve_heads(heads, count, key)] = True
        chosen = chosen & picked.reshape(head_sizes)
    return chosen


def tokens_first(t: Tensor, layout: Layout) -> Tensor:
    """A view of ``t`` as ``(batch, seq, heads, ...)`` (``(batch, seq, ...)`` without heads);
    writing into it writes into ``t``."""
    if layout.heads is None:
        return t.movedim((layout.batch, layout.seq), (0, 1))
    return t.movedim((layout.batch, layout.seq, layout.heads), (0, 1, 2))


def real_tokens(t: Tensor, layout: Layout) -> Tensor:
    """The real tokens of ``t`` (of ``layout``), ``(tokens, [heads,] ...)`` row-major, by
    ``layout.mask``; ``t`` itself when the forward had no mask of its ``(batch, seq)``."""
    mask = layout.mask
    if mask is None or tuple(mask.shape) != (layout.rows, layout.length):
        return t
    return tokens_first(t, layout)[mask.to(t.device).bool()]


def padding_dropped(t: Tensor, target: Target | None, tokens: Tokens,
                    keys: tuple[int | str, ...] = ()) -> Tensor:
    """The real tokens of ``t`` (part ``keys`` of what ``target`` selects; ``None``: the root's
    output), ``(tokens, [heads,] ...)``, by its layout (``engine.values.layout.layout_of``) and the
    forward's mask ``tokens``; ``t`` itself without a mask, or for a value with no token axis:
    ``(batch, features)``, an RNN's final state, and a module output of 4 dims or more, whose
    dim 1 is channels or attention heads. A function's value of unknown layout is read as
    ``(batch, seq, ...)``."""
    if tokens.mask is None or t.dim() < 2:
        return t
    op, parts = (None, keys) if target is None else (target.op, (*target.parts, *keys))
    module = None if target is None else target.module
    try:
        layout = layout_of("value", op, t.shape, tokens=tokens, module=module, parts=parts)
    except PositionError:  # no token axis, or a function's value of unknown layout
        if op is None:
            return t
        layout = Layout(tuple(t.shape), 1, None, tokens)
    if op is None and t.dim() > 3 and layout.heads is None and (layout.batch, layout.seq) == (0, 1):
        return t
    return real_tokens(t, layout)


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
        raise PositionError(f"positions={brief(positions)} is not a position: give an int, a list of "
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
        raise PositionError(f"{name}={brief(positions)} is not a {name[:-1]}: give an int, "
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
