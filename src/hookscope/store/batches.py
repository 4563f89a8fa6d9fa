"""Data for extraction: batches by index.

Resume and torchrun rest on batch ``k`` of the data being the same batch in every run and every
process, so ``BatchSource`` hands out batches by index, and rebuilds a DataLoader over the batch
range asked for instead of loading and dropping the batches before it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler

from hookscope.errors import ExtractError

__all__ = ["BatchSource"]

Tensor = torch.Tensor


class _Slice(Sampler[Any]):
    """Items ``start:stop`` of another sampler, without touching the data before ``start``."""

    def __init__(self, base: Iterable[Any], start: int, stop: int | None):
        self.base, self.start, self.stop = base, start, stop

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.base), self.start, self.stop)

    def __len__(self) -> int:
        if self.stop is None:
            raise TypeError("the sampler has no length")
        return self.stop - self.start


class BatchSource:
    """The batches of ``data`` by index: batch ``k`` is always the same batch, and reading can
    start at any batch without loading the ones before it when ``data`` is a map-style Dataset
    or a DataLoader over one (other iterables are read and skipped).

    Raises:
        ExtractError: ``data`` is not iterable, or is a DataLoader that shuffles.
    """

    def __init__(self, data: Any, batch_size: int):
        if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            data = DataLoader(data, batch_size=batch_size)
        elif isinstance(data, (str, bytes, os.PathLike)) or not isinstance(data, Iterable):
            raise ExtractError(f"data is a {type(data).__name__}; pass a DataLoader, a Dataset or "
                               f"an iterable of batches (from the command line: --data PATH)")
        self.data = data
        self.loader = data if isinstance(data, DataLoader) and \
            not isinstance(data.dataset, IterableDataset) else None
        if self.loader is not None and isinstance(self.loader.sampler, RandomSampler):
            raise ExtractError("the DataLoader shuffles (shuffle=True); extraction needs a fixed "
                               "row order to resume and to join ranks: pass shuffle=False")
        # rows per batch when known (a DataLoader's batch_size; None for other iterables)
        self.batch_size: int | None = self.loader.batch_size if self.loader is not None else None
        try:
            self.count: int | None = len(data)
        except TypeError:
            self.count = None

    def batches(self, start: int, stop: int | None) -> Iterator[tuple[int, Any, list[Any] | None]]:
        """Yield ``(index, batch, ids)`` for batches ``start:stop`` (``stop=None``: to the
        end); ``ids`` are its rows' data-set indices, or ``dataset.row_id(i)`` of each when the
        data set defines ``row_id`` (``None`` when the data is not a DataLoader over a map-style
        data set with a batch sampler)."""
        return ((i, batch, ids) for (i, batch), ids in zip(self._batches(start, stop),
                                                           self._ids(start, stop)))

    def _ids(self, start: int, stop: int | None) -> Iterator[list[Any] | None]:
        loader = self.loader
        if loader is None or loader.batch_sampler is None:
            return itertools.repeat(None)
        name = getattr(loader.dataset, "row_id", None)
        indices = itertools.islice(iter(loader.batch_sampler), start, stop)
        return ([name(i) for i in batch] if callable(name) else list(batch) for batch in indices)

    def _batches(self, start: int, stop: int | None) -> Iterator[tuple[int, Any]]:
        if self.loader is None or (start == 0 and stop in (None, self.count)):
            return enumerate(itertools.islice(iter(self.data), start, stop), start)
        loader = self.loader
        end = self.count if stop is None else stop
        sampler: dict[str, Any]
        if loader.batch_sampler is not None:
            sampler = {"batch_sampler": _Slice(loader.batch_sampler, start, end)}
        else:  # automatic batching off: each dataset item is a batch
            sampler = {"sampler": _Slice(loader.sampler, start, end), "batch_size": None}
        workers = {"prefetch_factor": loader.prefetch_factor} if loader.num_workers else {}
        sliced = DataLoader(loader.dataset, num_workers=loader.num_workers,
                            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                            timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                            multiprocessing_context=loader.multiprocessing_context,
                            **sampler, **workers)  # type: ignore[arg-type]
        return enumerate(sliced, start)

    def rows(self, start: int, stop: int | None) -> int | None:
        """Rows in batches ``start:stop`` when the DataLoader says (for the progress bar)."""
        loader = self.loader
        if loader is None or loader.batch_size is None or loader.drop_last:
            return None
        size, n = loader.batch_size, len(loader.dataset)  # type: ignore[arg-type]
        end = self.count if stop is None else stop
        return max(0, min(n, end * size) - start * size) if end is not None else None


# ------------------------------------------------------------------- data from a path (CLI)
