"""Token-level reading for training on activations (sparse autoencoders): ``TokenView``, a flat
``(tokens, *shape)`` view over the rows of a ragged layer (``store.tokens(layer)``), and
``TokenStream``, a shuffled, resumable stream of its tokens that a ``DataLoader`` reads
(``store.token_stream(layer)``); ``pad_rows``, the collate function for whole ragged rows.

A ragged layer keeps each row's real tokens only (padding was dropped by the attention mask at
extraction), and the ``token`` column keeps their token ids in the same order, so token ``k`` of
the flat view is token ``k`` of the flat id column: leaving special tokens out is a mask on ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from hookscope.errors import StoreError
from hookscope.store.reader import LayerInfo, _as_tensor

if TYPE_CHECKING:
    from hookscope.store.reader import Store

__all__ = ["TokenStream", "TokenView", "pad_rows"]

Tensor = torch.Tensor


class TokenView:
    """The tokens of ragged layer ``info`` of ``store`` as one flat sequence, in row order.

    ``view[k]`` is a ``(*shape)`` tensor (``shape`` the layer's row shape without its token
    axis, e.g. ``(d,)``), ``view[i:j]`` a ``(j - i, *shape)`` tensor, ``len(view)`` the number
    of tokens kept; ``view.ids`` are their token ids (``(tokens,)`` int64) and ``view.rows``
    the row each came from (``(tokens,)`` int64). Padding is never stored; the token ids in
    ``exclude`` (e.g. BOS/EOS) are left out too. Reads copy only the tokens asked for (the
    shards are memory-mapped and checked chunk by chunk as any read is).
    """

    def __init__(self, store: Store, info: LayerInfo, exclude: Sequence[int] = ()):
        """Raises:
            StoreError: the layer is not ragged, or ``exclude`` is given and the store holds
                no token ids (its data gave no ``input_ids`` beside the ``attention_mask``).
        """
        if not info.ragged:
            raise StoreError(f"layer {info.path!r} is not ragged (rows of shape "
                             f"{tuple(info.shape)}), so it has no token axis to flatten; "
                             f"store.tokens() reads layers extracted per token (reduce=None "
                             f"with an attention_mask); read this one with store[{info.path!r}]")
        self.store, self.info = store, info
        self._row_shape = tuple(int(n or 0) for n in info.shape[1:])
        shards = store._shards
        self._counts = np.array([int(s.offsets(info.path)[-1]) for s in shards], dtype=np.int64)
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
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("token views take a slice with step 1, an int, or read(indices)")
            return self.read(np.arange(start, max(start, stop)))
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise IndexError(f"a token is indexed by an int or a slice, not "
                             f"{type(index).__name__}")
        k = int(index) + (len(self) if index < 0 else 0)
        if not 0 <= k < len(self):
            raise IndexError(f"token {index} is out of range for {len(self)} tokens")
        return self.read(np.array([k]))[0]

    def read(self, indices: np.ndarray) -> Tensor:
        """Return the tokens at ``indices`` (kept-token numbers, ascending) as a
        ``(len(indices), *shape)`` tensor; reads the stored span from the first to the last
        (the tokens between that ``exclude`` left out included), so keep them close."""
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
            if end > start:
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
        lengths = np.concatenate([np.diff(s.offsets(self.info.path)) for s in self.store._shards]) \
            if self.store._shards else np.zeros(0, np.int64)
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


class TokenStream(torch.utils.data.IterableDataset[Tensor]):
    """The tokens of a ``TokenView``, shuffled with a seed, each once; ``DataLoader(stream,
    batch_size=B)`` gives ``(B, *shape)`` batches.

    The shuffle (a buffer shuffle whose state is one number): the tokens are cut into blocks of
    ``block_tokens`` (contiguous on disk, so reads stay sequential); the blocks are permuted by
    ``numpy.random.default_rng(seed)``; consecutive runs of ``buffer_tokens // block_tokens``
    permuted blocks make a window, read whole into memory and yielded in the order
    ``numpy.random.default_rng([seed, w]).permutation`` gives for window ``w``. So at most one
    window, ``buffer_tokens`` tokens, is in memory, a token's neighbours come from blocks all
    over the store, and ``state_dict()`` (``{"seed", "position"}``: tokens yielded so far) is
    enough to continue the same sequence after a restart (``load_state_dict``), reading only
    the window the position falls in again. Window ``w``'s tokens are its blocks' tokens
    concatenated in the permuted order (``windows()``), then indexed by that permutation.
    ``set_epoch(e)`` gives another order per epoch.

    With ``batch_size=B`` the stream yields ``(B, *shape)`` tensors itself (the same tokens in
    the same order, the last batch shorter), one gather per batch instead of one item per token:
    read it with ``DataLoader(stream, batch_size=None)``, many times faster than a ``DataLoader``
    collating single tokens (``bench/throughput.py``).

    Read with one DataLoader worker at most (the default, ``num_workers=0``): several would each
    yield every token.
    """

    def __init__(self, view: TokenView, *, buffer_tokens: int, block_tokens: int, seed: int,
                 batch_size: int | None = None):
        """Raises:
            ValueError: ``block_tokens``, ``buffer_tokens`` or ``batch_size`` is not a positive
                int, or the buffer holds less than one block.
        """
        if batch_size is not None and (type(batch_size) is not int or batch_size <= 0):
            raise ValueError(f"batch_size must be None or a positive int, not {batch_size!r:.40}")
        self.batch_size = batch_size
        for name, value in (("buffer_tokens", buffer_tokens), ("block_tokens", block_tokens)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, not {value!r:.40}")
        if buffer_tokens < block_tokens:
            raise ValueError(f"buffer_tokens ({buffer_tokens}) must hold at least one block "
                             f"(block_tokens={block_tokens}); pass a larger buffer_tokens")
        self.view, self.seed, self.block = view, int(seed), block_tokens
        self.blocks_per_window = buffer_tokens // block_tokens
        self.position, self.epoch = 0, 0
        self._buffer: Tensor | None = None  # the window's tokens, reused window after window

    def __len__(self) -> int:
        return len(self.view)

    def state_dict(self) -> dict[str, int]:
        """``{"seed", "epoch", "position"}``: where the stream is (tokens yielded so far)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (``state_dict()`` of a stream over the same store)."""
        self.seed, self.epoch, self.position = int(state["seed"]), int(state.get("epoch", 0)), \
            int(state["position"])

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (another order of the same tokens) from its beginning."""
        self.epoch, self.position = int(epoch), 0

    def windows(self) -> list[list[np.ndarray]]:
        """The token numbers of each window: its blocks, each a run of consecutive numbers,
        in the permuted order they are read and concatenated (before the window's shuffle)."""
        n = len(self.view)
        blocks = np.random.default_rng([self.seed, self.epoch]).permutation(-(-n // self.block))
        runs = [np.arange(b * self.block, min((b + 1) * self.block, n)) for b in blocks]
        per = self.blocks_per_window
        return [runs[w:w + per] for w in range(0, len(runs), per)]

    def __iter__(self) -> Iterator[Tensor]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise StoreError(f"a TokenStream is read by one DataLoader worker (each of "
                             f"{info.num_workers} would yield every token): pass num_workers=0 "
                             f"or 1")
        if self.batch_size is None:
            for window, order in self._windows():
                for k in order:
                    self.position += 1
                    yield window[int(k)].clone()  # the buffer is reused
            return
        pending: list[Tensor] = []  # tokens of a batch that a window's end cut short
        for window, order in self._windows():
            at = 0  # into order
            while at < len(order):
                need = self.batch_size - sum(len(p) for p in pending)
                pending.append(window[torch.from_numpy(order[at:at + need])])
                at += len(pending[-1])
                if sum(len(p) for p in pending) == self.batch_size:
                    yield self._batch(pending)
        if pending:
            yield self._batch(pending)

    def _batch(self, pending: list[Tensor]) -> Tensor:
        batch = pending[0] if len(pending) == 1 else torch.cat(pending)
        pending.clear()
        self.position += len(batch)
        return batch

    def _windows(self) -> Iterator[tuple[Tensor, np.ndarray]]:
        """Each window from ``position`` (when iteration starts) on: its tokens (the only ones
        in memory) and the order of those still to yield."""
        done, start = 0, self.position
        for w, blocks in enumerate(self.windows()):
            size = sum(len(b) for b in blocks)
            if done + size > start:
                order = np.random.default_rng([self.seed, self.epoch, w]).permutation(size)
                yield self._read_window(blocks, size), order[max(start - done, 0):]
            done += size

    def _read_window(self, blocks: list[np.ndarray], size: int) -> Tensor:
        """The tokens of ``blocks``, concatenated into one buffer kept across windows (fresh
        memory for each window would cost its page faults again: on a 2-core machine they
        took longer than the reads)."""
        shape = (self.blocks_per_window * self.block, *self.view._row_shape)
        if self._buffer is None or self._buffer.shape != shape:
            self._buffer = torch.empty(shape, dtype=self.view.info.dtype)
        at = 0
        for block in blocks:
            self._buffer[at:at + len(block)] = self.view.read(block)
            at += len(block)
        return self._buffer[:size]


def pad_rows(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Collate ragged rows (``(tokens_i, *shape)`` tensors) into ``(padded, mask)``:
    ``padded`` is ``(batch, max tokens, *shape)`` with zeros after each row's tokens, ``mask``
    ``(batch, max tokens)`` bool, True on real tokens. ``DataLoader(store.dataset(layer,
    ragged=True), collate_fn=pad_rows)``."""
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    lengths = torch.tensor([len(r) for r in rows])
    return padded, torch.arange(padded.shape[1])[None, :] < lengths[:, None]
