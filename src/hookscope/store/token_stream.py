"""``TokenStream``, a shuffled, resumable stream of a token view's tokens that a ``DataLoader``
reads, and ``TokenLoader``, the loader that reads it with worker processes
(``stream.loader(num_workers=N)``) while the stream's state stays the state the loader reached.

Where a stream stands: ``state_dict()`` is ``{"seed", "epoch", "position"}``, ``position``
the tokens the newest iteration has delivered (counted as they leave the stream, or, through a
``TokenLoader``, as they reach this process). An iteration begins where the stream was set:
by ``load_state_dict``, by ``set_epoch`` (its start), or at the end of a finished pass; so a
look at the first batch (``next(iter(loader))``) consumes nothing, and saving ``state_dict()``
then loading it into a new stream (a new process) continues after exactly the tokens that were
delivered. A pass that ran to the end moves the next one to the next epoch, by itself (its
first token is read from another order; ``set_epoch`` still picks one).

Workers: a ``DataLoader``'s worker processes hold copies of the stream whose progress the
parent's stream never sees, so a stream read by them would save a position of 0 and a resume
would yield every token again. A plain ``DataLoader(stream, num_workers>0)`` is therefore
refused; ``TokenLoader`` shares the batches out instead (worker ``w`` of ``W`` makes batches
``w, w + W, ...`` of the pass; the ``DataLoader`` hands them on in order, so the batches, their
tokens and their order are those of ``num_workers=0``) and counts each batch delivered here.
Each worker reads every window of the pass (the reads are whole windows) and gathers only its
own batches, so workers parallelise the gathers and the copies to the loader, not the reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hookscope.errors import ArgumentValueError, StoreError

if TYPE_CHECKING:
    from hookscope.store.tokens import TokenView

__all__ = ["TokenLoader", "TokenStream"]

Tensor = torch.Tensor
_Read = Callable[[], Tensor]  # reads one window's tokens when called


class TokenStream(torch.utils.data.IterableDataset[Tensor]):
    """The tokens of a ``TokenView``, shuffled with a seed, each once per epoch;
    ``DataLoader(stream, batch_size=B)`` gives ``(B, *shape)`` batches.

    The shuffle (a buffer shuffle whose state is one number): the tokens are cut into blocks of
    ``block_tokens`` (contiguous on disk, so reads stay sequential); the blocks are permuted by
    ``numpy.random.default_rng([seed, epoch])``; consecutive runs of ``buffer_tokens //
    block_tokens`` permuted blocks make a window, read whole into memory and yielded in the
    order ``numpy.random.default_rng([seed, epoch, w]).permutation`` gives for window ``w``. So
    at most one window, ``buffer_tokens`` tokens, is in memory, a token's neighbours come from
    blocks all over the store, and ``state_dict()`` is enough to continue the same sequence
    after a restart (``load_state_dict``), reading only the window the position falls in again.
    Window ``w``'s tokens are its blocks' tokens concatenated in the permuted order
    (``windows()``), then indexed by that permutation. Where an iteration starts and how
    epochs advance: the module docstring.

    With ``batch_size=B`` the stream yields ``(B, *shape)`` tensors itself (the same tokens in
    the same order, the last batch shorter), one gather per batch instead of one item per token:
    read it with ``DataLoader(stream, batch_size=None)``, many times faster than a ``DataLoader``
    collating single tokens (``bench/throughput.py``), or with worker processes through
    ``stream.loader(num_workers=N)``.

    A ``DataLoader`` with ``num_workers > 0`` over the stream itself is refused (``StoreError``
    from its first batch): its workers' progress would never reach this stream's state.
    """

    def __init__(self, view: TokenView, *, buffer_tokens: int, block_tokens: int, seed: int,
                 batch_size: int | None = None):
        """Raises:
            ArgumentValueError: (a ``ValueError``) ``seed`` is not an int >= 0, ``block_tokens``,
                ``buffer_tokens`` or ``batch_size`` is not a positive
                int, or the buffer holds less than one block.
        """
        if type(seed) is not int or seed < 0:
            raise ArgumentValueError(f"seed must be an int >= 0, not {seed!r:.40}")
        if batch_size is not None and (type(batch_size) is not int or batch_size <= 0):
            raise ArgumentValueError(f"batch_size must be None or a positive int, not {batch_size!r:.40}")
        self.batch_size = batch_size
        for name, value in (("buffer_tokens", buffer_tokens), ("block_tokens", block_tokens)):
            if type(value) is not int or value <= 0:
                raise ArgumentValueError(f"{name} must be a positive int, not {value!r:.40}")
        if buffer_tokens < block_tokens:
            raise ArgumentValueError(f"buffer_tokens ({buffer_tokens}) must hold at least one block "
                             f"(block_tokens={block_tokens}); pass a larger buffer_tokens")
        self.view, self.seed, self.block = view, int(seed), block_tokens
        self.blocks_per_window = buffer_tokens // block_tokens
        self.position, self.epoch = 0, 0
        self._start = 0  # where the next iteration begins
        self._newest = 0  # the iteration whose delivered tokens ``position`` counts
        self._buffer: Tensor | None = None  # the window's tokens, reused window after window

    def __len__(self) -> int:
        return len(self.view)

    def state_dict(self) -> dict[str, int]:
        """``{"seed", "epoch", "position"}``: where the stream is (tokens delivered so far)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (``state_dict()`` of a stream over the same store): the next
        iteration begins after the tokens it counts.

        Raises:
            StoreError: ``state`` is not a dict with int ``seed`` >= 0, ``position`` in
                ``[0, len(stream)]`` and (optionally) ``epoch`` >= 0 (nothing is changed).
        """
        if not isinstance(state, dict) or "seed" not in state or "position" not in state:
            raise StoreError(f"load_state_dict takes what state_dict() returned, a dict with "
                             f"'seed', 'epoch' and 'position'; got {state!r:.80}")
        seed, epoch, position = state["seed"], state.get("epoch", 0), state["position"]
        limits = (("seed", seed, 2**63), ("epoch", epoch, 2**63), ("position", position, len(self)))
        for name, value, most in limits:
            if type(value) is not int or not 0 <= value <= most:
                raise StoreError(f"state[{name!r}] is {value!r:.40}: it must be an int in "
                                 f"[0, {most}] (this stream holds {len(self)} tokens); pass "
                                 f"the state_dict() of a stream over the same store")
        self.seed, self.epoch = seed, epoch
        self.position = self._start = position

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (another order of the same tokens) from its beginning.

        Raises:
            StoreError: ``epoch`` is not an int >= 0.
        """
        if type(epoch) is not int or epoch < 0:
            raise StoreError(f"set_epoch({epoch!r:.40}): an epoch is an int >= 0")
        self.epoch, self.position, self._start = epoch, 0, 0

    def loader(self, *, num_workers: int = 0, **options: Any) -> TokenLoader:
        """A loader of this stream's batches with ``num_workers`` worker processes whose
        progress this stream's ``state_dict()`` follows (``TokenLoader``)."""
        return TokenLoader(self, num_workers=num_workers, **options)

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
        if info is not None:  # a TokenLoader's workers iterate their _Share, not the stream
            raise StoreError(
                f"a TokenStream read by DataLoader(num_workers={info.num_workers}) would lose "
                f"its place: the workers' progress never reaches this stream's state_dict(), "
                f"so a resume would yield every token again. Read it with "
                f"stream.loader(num_workers={info.num_workers}) (a stream made with "
                f"store.tokens(layer).stream(batch_size=B)), or with num_workers=0")
        return self._iterate()

    def _iterate(self) -> Iterator[Tensor]:
        start, generation = self._begin()
        if self.batch_size is None:
            for read, order in self._windows(start):
                window = read()
                for k in order:
                    self._delivered(generation, 1)
                    yield window[int(k)].clone()  # the buffer is reused
        else:
            for batch in self._batches(start, lambda j: True):
                self._delivered(generation, len(batch))
                yield batch
        self._finished(generation)

    def _begin(self) -> tuple[int, int]:
        """Start an iteration: ``(its first token, its number)``; a finished pass moves on to
        the next epoch first."""
        if 0 < len(self.view) <= self._start:
            self.epoch, self._start = self.epoch + 1, 0  # the pass before ran to its end
        self._newest += 1
        self.position = self._start
        return self._start, self._newest

    def _delivered(self, generation: int, tokens: int) -> None:
        if generation == self._newest:
            self.position += tokens

    def _finished(self, generation: int) -> None:
        if generation == self._newest:
            self._start = self.position  # the pass is used up: the next one is a new epoch

    def _batches(self, start: int, keep: Callable[[int], bool]) -> Iterator[Tensor]:
        """Batches ``j`` (counted from ``start``) of ``batch_size`` tokens for which ``keep(j)``,
        in order; the windows none of them needs are not read."""
        size, pending, have, j = self.batch_size or 1, [], 0, 0
        for read, order in self._windows(start):
            window, at = None, 0
            while at < len(order):
                take = min(size - have, len(order) - at)
                if keep(j):
                    window = read() if window is None else window
                    pending.append(window[torch.from_numpy(order[at:at + take])])
                at, have = at + take, have + take
                if have == size:
                    if keep(j):
                        yield pending[0] if len(pending) == 1 else torch.cat(pending)
                    pending, have, j = [], 0, j + 1
        if have and keep(j):
            yield pending[0] if len(pending) == 1 else torch.cat(pending)

    def _windows(self, start: int) -> Iterator[tuple[_Read, np.ndarray]]:
        """Each window from token ``start`` on: a function that reads its tokens (the only ones
        in memory) and the order of those still to yield."""
        done = 0
        for w, blocks in enumerate(self.windows()):
            size = sum(len(b) for b in blocks)
            if done + size > start:
                order = np.random.default_rng([self.seed, self.epoch, w]).permutation(size)
                yield functools.partial(self._read_window, blocks, size), order[max(start - done, 0):]
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


class _Share(torch.utils.data.IterableDataset[Tensor]):
    """What a ``TokenLoader``'s worker iterates: its share of the batches of one pass from
    token ``start`` (worker ``w`` of ``W``: batches ``w, w + W, ...``)."""

    def __init__(self, stream: TokenStream, start: int):
        self.stream, self.start = stream, start

    def __iter__(self) -> Iterator[Tensor]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.stream._batches(self.start, lambda j: j % workers == worker)


class TokenLoader:
    """Batches of a ``TokenStream`` made by ``num_workers`` worker processes (a ``DataLoader``
    over shares of the pass: module docstring); iterating it moves the stream as iterating the
    stream does, counting each batch once it reaches this process, so ``stream.state_dict()``
    is where the loader is and a resume from it yields each remaining token once.

    The batches and their order are the stream's own (``DataLoader(stream, batch_size=None)``),
    whatever ``num_workers``.
    """

    def __init__(self, stream: TokenStream, *, num_workers: int = 0, **options: Any):
        """Args:
            stream: a ``TokenStream`` made with ``batch_size``.
            num_workers: worker processes (0: this process makes the batches).
            options: more ``DataLoader`` options (``pin_memory``, ``prefetch_factor``,
                ``persistent_workers``, ``multiprocessing_context``, ``timeout``...); not
                ``batch_size``, ``shuffle``, ``sampler`` or ``collate_fn`` (the stream makes
                the batches).

        Raises:
            StoreError: ``stream`` has no ``batch_size``, ``num_workers`` is not an int >= 0,
                or ``options`` names one the stream decides.
        """
        if not isinstance(stream, TokenStream) or stream.batch_size is None:
            raise StoreError("a TokenLoader reads a TokenStream that makes its own batches: "
                             "store.tokens(layer).stream(batch_size=B).loader(num_workers=N)")
        if type(num_workers) is not int or num_workers < 0:
            raise StoreError(f"num_workers must be an int >= 0, not {num_workers!r:.40}")
        taken = sorted(set(options) & {"batch_size", "shuffle", "sampler", "batch_sampler",
                                       "collate_fn", "drop_last"})
        if taken:
            raise StoreError(f"TokenLoader options {taken}: the stream makes the batches "
                             f"(store.tokens(layer).stream(batch_size=B)); leave them out")
        self.stream, self.num_workers, self.options = stream, num_workers, options

    def __iter__(self) -> Iterator[Tensor]:
        stream = self.stream
        if self.num_workers == 0:
            yield from stream._iterate()
            return
        start, generation = stream._begin()
        loader = torch.utils.data.DataLoader(_Share(stream, start), batch_size=None,
                                             num_workers=self.num_workers, **self.options)
        for batch in loader:
            stream._delivered(generation, len(batch))
            yield batch
        stream._finished(generation)
