"""Token-level reading for training on activations (sparse autoencoders): ``TokenView``, a flat
``(tokens, *shape)`` view over the rows of a ragged layer (``store.tokens(layer)``), and
``TokenStream``, a shuffled, resumable stream of its tokens that a ``DataLoader`` reads
(``store.tokens(layer).stream()``); ``pad_rows``, the collate function for whole ragged rows.

A ragged layer keeps each row's real tokens only (padding was dropped by the attention mask at
extraction), and the ``token`` column keeps their token ids in the same order, so token ``k`` of
the flat view is token ``k`` of the flat id column: leaving special tokens out is a mask on ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hookscope.errors import ArgumentTypeError, PositionError, StoreError
from hookscope.store.layers import LayerInfo, _as_tensor
from hookscope.store.token_stream import TokenLoader, TokenStream

if TYPE_CHECKING:
    from hookscope.store.reader import Store

__all__ = ["TokenLoader", "TokenStream", "TokenView", "pad_rows"]

Tensor = torch.Tensor


class TokenView:
    """The tokens of a per-token layer ``info`` of ``store`` as one flat sequence, in row order.

    A per-token layer is a ragged one (padding dropped by the attention mask at extraction), or
    a fixed one of packed windows: rows ``(seq, *shape)`` extracted from ``(batch, seq)`` token
    ids without a mask, which the store keeps beside them as its ``token`` column of ``(seq,)``
    rows (every token of a window is real, so row ``i`` holds tokens ``i * seq ...``).

    ``view[k]`` is a ``(*shape)`` tensor (``shape`` the layer's row shape without its token
    axis, e.g. ``(d,)``), ``view[i:j]`` a ``(j - i, *shape)`` tensor, ``len(view)`` the number
    of tokens kept; ``view.ids`` are their token ids (``(tokens,)`` int64) and ``view.rows``
    the row each came from (``(tokens,)`` int64). Padding is never stored; the token ids in
    ``exclude`` (e.g. BOS/EOS) are left out too. Reads copy only the tokens asked for (the
    shards are memory-mapped and checked chunk by chunk as any read is).
    """

    def __init__(self, store: Store, info: LayerInfo, exclude: Sequence[int] = ()):
        """Raises:
            StoreError: the layer is neither ragged nor of packed windows with stored token
                ids, or ``exclude`` is given and the store holds no token ids (its data gave no
                ``input_ids``).
        """
        exclude = _check_exclude(exclude)
        self.seq = 0 if info.ragged else _packed_length(store, info)  # tokens a fixed row holds
        if self.seq is None:
            raise StoreError(f"layer {info.path!r} is not ragged (rows of shape "
                             f"{tuple(info.shape)}) and the store keeps no token ids of that "
                             f"length, so it has no token axis to flatten; store.tokens() reads "
                             f"layers extracted per token (reduce=None, from an attention_mask "
                             f"or from (batch, seq) token ids); read this one with "
                             f"store[{info.path!r}]")
        self.store, self.info = store, info
        self._row_shape = tuple(int(n or 0) for n in info.shape[1:])
        shards = store._shards
        self._counts = np.array([(s.info.rows[1] - s.info.rows[0]) * self.seq if self.seq else
                                 int(s.offsets(info.path)[-1]) for s in shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._counts)])  # raw token -> shard
        self._keep: np.ndarray | None = None  # kept raw token indices, when some are excluded
        if len(exclude):
            ids = self._token_ids()
            if ids is None:
                raise StoreError(f"store {store.path} holds no token ids, so tokens cannot be "
                                 f"left out by id (exclude={list(exclude)!r:.60}); extract from "
                                 f"batches with input_ids and attention_mask to store them, or "
                                 f"pass no exclude")
            self._keep = np.flatnonzero(~np.isin(ids, np.asarray(exclude, dtype=np.int64)))

    def __len__(self) -> int:
        return int(self._starts[-1]) if self._keep is None else len(self._keep)

    def __getitem__(self, index: int | slice) -> Tensor:
        """Raises:
            PositionError: (an ``IndexError``) a slice with a step other than 1, an index that
                is not an int or a slice, or one out of range.
        """
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise PositionError("token views take a slice with step 1, an int, or "
                                    "read(indices)")
            return self.read(np.arange(start, max(start, stop)))
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise PositionError(f"a token is indexed by an int or a slice, not "
                                f"{type(index).__name__}")
        k = int(index) + (len(self) if index < 0 else 0)
        if not 0 <= k < len(self):
            raise PositionError(f"token {index} is out of range for {len(self)} tokens")
        return self.read(np.array([k]))[0]

    def read(self, indices: np.ndarray) -> Tensor:
        """Return the tokens at ``indices`` (kept-token numbers, ascending) as a
        ``(len(indices), *shape)`` tensor; reads the stored span from the first to the last
        (the tokens between that ``exclude`` left out included), so keep them close.

        Raises:
            PositionError: ``indices`` is not a 1-dim integer array, not ascending, or out of
                range.
        """
        indices = _check_indices(indices, len(self))
        raw = indices if self._keep is None else self._keep[indices]
        if not len(raw):
            return torch.empty(0, *self._row_shape, dtype=self.info.dtype)
        first, last = int(raw[0]), int(raw[-1]) + 1
        span = self._raw(first, last)
        return span if len(raw) == last - first else span[torch.from_numpy(raw - first)]

    def _raw(self, start: int, stop: int) -> Tensor:
        """Raw (stored) tokens ``start:stop`` of the layer across shards, one tensor."""
        pieces = []
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            shard, base = self.store._shards[k], int(self._starts[k])
            end = min(stop, int(self._starts[k + 1]))
            if end > start and self.seq:  # packed windows: the rows that hold the tokens
                a, b = (start - base) // self.seq, -(-(end - base) // self.seq)
                rows = _as_tensor(shard.array(self.info.path, a, b), self.info.dtype,
                                  ((b - a) * self.seq, *self._row_shape))
                pieces.append(rows[start - base - a * self.seq:end - base - a * self.seq])
            elif end > start:
                a, b = start - base, end - base
                pieces.append(_as_tensor(shard.array(self.info.path, a, b), self.info.dtype,
                                         (b - a, *self._row_shape)))
            start, k = end, k + 1
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    @property
    def ids(self) -> Tensor | None:
        """The token id of each token (``(tokens,)`` int64), or ``None`` without a token column."""
        ids = self._token_ids()
        if ids is None:
            return None
        return torch.from_numpy(ids if self._keep is None else ids[self._keep])

    @property
    def rows(self) -> Tensor:
        """The row each token came from (``(tokens,)`` int64)."""
        if not self.store._shards:
            lengths = np.zeros(0, np.int64)
        elif self.seq:
            lengths = np.full(len(self.store), self.seq, dtype=np.int64)
        else:
            lengths = np.concatenate([np.diff(s.offsets(self.info.path))
                                      for s in self.store._shards])
        rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        return torch.from_numpy(rows if self._keep is None else rows[self._keep])

    def _token_ids(self) -> np.ndarray | None:
        info = self.store.columns.get("token")
        if info is None:
            return None
        return TokenView(self.store, info)._raw(0, int(self._starts[-1])).numpy() \
            if self._starts[-1] else np.zeros(0, np.int64)

    def stream(self, *, buffer_tokens: int = 2**16, block_tokens: int = 256, seed: int = 0,
               batch_size: int | None = None) -> TokenStream:
        """A shuffled, resumable stream of these tokens (``TokenStream``)."""
        return TokenStream(self, buffer_tokens=buffer_tokens, block_tokens=block_tokens,
                           seed=seed, batch_size=batch_size)


def _check_indices(indices: Any, count: int) -> np.ndarray:
    """``indices`` as an int64 array, checked: 1-dim, integers, ascending, in ``[0, count)``."""
    if isinstance(indices, Tensor):
        indices = indices.numpy()
    array = np.asarray(indices) if isinstance(indices, (np.ndarray, list, tuple, range)) else None
    if array is None or array.ndim != 1 or (len(array) and array.dtype.kind not in "iu"):
        raise PositionError(f"read(indices) takes a 1-dim array of token numbers (ints), e.g. "
                            f"np.arange(0, 10); got {type(indices).__name__} {indices!r:.60}")
    array = array.astype(np.int64)
    if len(array) and (array[0] < 0 or array[-1] >= count or (np.diff(array) < 0).any()):
        raise PositionError(f"read(indices) takes ascending token numbers in [0, {count}); got "
                            f"{array[:8].tolist()}{' ...' if len(array) > 8 else ''}: sort them "
                            f"(np.sort) and keep them in range")
    return array


def _check_exclude(exclude: Any) -> Sequence[int]:
    """``exclude`` checked: a sequence of int token ids (a str or a float is refused)."""
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, (list, tuple, range,
                                                                     np.ndarray, Tensor)):
        raise ArgumentTypeError(f"exclude must be a list of token ids, e.g. exclude=[0, 2]; got "
                                f"{type(exclude).__name__} {exclude!r:.40}")
    values = exclude.tolist() if isinstance(exclude, (np.ndarray, Tensor)) else list(exclude)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise ArgumentTypeError(f"exclude holds token ids, ints; got {values!r:.60}")
    return [int(v) for v in values]


def _packed_length(store: Store, info: LayerInfo) -> int | None:
    """``seq`` when fixed layer ``info`` holds packed windows: its rows are ``(seq, ...)`` and
    the store's ``token`` column holds ``(seq,)`` token ids per row; else ``None``."""
    token = store.columns.get("token")
    if token is None or token.ragged or len(token.shape) != 1 or not info.shape or \
            info.shape[0] != token.shape[0] or not token.shape[0]:
        return None
    return int(token.shape[0])


def pad_rows(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Collate ragged rows (``(tokens_i, *shape)`` tensors) into ``(padded, mask)``:
    ``padded`` is ``(batch, max tokens, *shape)`` with zeros after each row's tokens, ``mask``
    ``(batch, max tokens)`` bool, True on real tokens. ``DataLoader(store.dataset(layer,
    ragged=True), collate_fn=pad_rows)``."""
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    lengths = torch.tensor([len(r) for r in rows])
    return padded, torch.arange(padded.shape[1])[None, :] < lengths[:, None]
