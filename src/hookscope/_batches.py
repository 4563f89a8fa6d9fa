"""Data for extraction: batches by index, and data sets read from a path (the CLI's ``--data``).

Resume and torchrun rest on batch ``k`` of the data being the same batch in every run and every
process, so ``BatchSource`` hands out batches by index, and rebuilds a DataLoader over the batch
range asked for instead of loading and dropping the batches before it.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler, TensorDataset

from hookscope._extras import require
from hookscope.errors import ExtractError, SpecError

if TYPE_CHECKING:  # the model-spec layer loads only when data is read from a path (the CLI)
    from hookscope.models import LoadedModel

__all__ = ["BatchSource", "load_data"]

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
        try:
            self.count: int | None = len(data)
        except TypeError:
            self.count = None

    def batches(self, start: int, stop: int | None) -> Iterator[tuple[int, Any]]:
        """Yield ``(index, batch)`` for batches ``start:stop`` (``stop=None``: to the end)."""
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
def load_data(path: str | os.PathLike[str], model: LoadedModel, *,
              batch_size: int) -> DataLoader[Any]:
    """Return a DataLoader over the inputs in ``path``, prepared for ``model``, in a fixed order.

    Args:
        path: a folder of images (every image file below it, sorted by relative path), a text
            file with one input a line (blank lines skipped; text models), or a tensor file
            (``.pt``/``.npy``/``.safetensors``) whose dim 0 is the rows.
        model: the loaded model; its preprocessing or tokenizer makes the batches.
        batch_size: rows per batch.

    Raises:
        SpecError: the path is missing, holds no input, holds an unreadable image (each image
            is opened and checked first, so this comes before any shard), or does not suit
            the model (text for an image model, ...).
    """
    from hookscope.inputs import TENSOR_SUFFIXES, load_inputs
    source = Path(path)
    collate: Callable[[list[str]], Any]
    if source.is_dir():
        items, collate = _image_files(source, model), _ImageBatch(model)
    elif source.is_file() and source.suffix.lower() in TENSOR_SUFFIXES:
        rows = load_inputs([str(source)], model).args[0]
        return DataLoader(TensorDataset(rows), batch_size=batch_size)
    elif source.is_file():
        items, collate = _text_lines(source, model), _TextBatch(model)
    else:
        raise SpecError(f"--data {source} does not exist; give a folder of images, a text file "
                        f"with one input a line, or a tensor file ({', '.join(TENSOR_SUFFIXES)})")
    return DataLoader(items, batch_size=batch_size, collate_fn=collate)  # type: ignore[arg-type]


def _image_files(folder: Path, model: LoadedModel) -> list[str]:
    from hookscope.inputs import IMAGE_SUFFIXES
    if model.kind != "image" or model.preprocess is None:
        raise SpecError(f"--data {folder} is a folder of images, but '{model.spec}' does not "
                        f"take images")
    files = sorted((p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES),
                   key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise SpecError(f"--data {folder} holds no image file ({', '.join(IMAGE_SUFFIXES)})")
    image_module = require("PIL.Image", "reading images")
    for file in files:
        try:
            with image_module.open(file) as image:
                image.verify()
        except Exception as err:  # noqa: BLE001  (Pillow raises many types for a bad file)
            raise SpecError(f"cannot read image {file}: {err}. Fix or remove it; nothing was "
                            f"extracted yet") from err
    return [str(f) for f in files]


def _text_lines(file: Path, model: LoadedModel) -> list[str]:
    from hookscope.inputs import TENSOR_SUFFIXES
    if model.kind != "text" or model.tokenizer is None:
        raise SpecError(f"--data {file} is read as text, one input a line, but '{model.spec}' "
                        f"does not take text; give a folder of images or a tensor file "
                        f"({', '.join(TENSOR_SUFFIXES)})")
    try:
        every = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"cannot read {file} as UTF-8 text: {err}") from err
    lines = [line for line in every if line.strip()]
    if len(lines) < len(every):
        warnings.warn(f"--data {file}: skipped {len(every) - len(lines)} blank line(s); row i of "
                      f"the store is the i-th non-blank line", UserWarning, stacklevel=2)
    if not lines:
        raise SpecError(f"--data {file} has no non-blank line: nothing to extract")
    return lines


class _ImageBatch:
    """collate_fn: image paths -> ``(batch, 3, height, width)`` tensor, as the model expects."""

    def __init__(self, model: LoadedModel):
        if model.preprocess is None:
            raise SpecError(f"'{model.spec}' has no image preprocessing")
        self.preprocess, self.dtype = model.preprocess, model.dtype

    def __call__(self, files: list[str]) -> Tensor:
        from hookscope.inputs import preprocess_image
        image_module = require("PIL.Image", "reading images")
        rows = []
        for file in files:
            with image_module.open(file) as image:
                rgb = np.asarray(image.convert("RGB"))
            rows.append(preprocess_image(rgb, self.preprocess, self.dtype)[0])
        return torch.stack(rows)


class _TextBatch:
    """collate_fn: lines -> the tokenizer's dict (``input_ids``, ``attention_mask``, ...)."""

    def __init__(self, model: LoadedModel):
        self.tokenizer = model.tokenizer

    def __call__(self, lines: list[str]) -> dict[str, Tensor]:
        encoded = self.tokenizer(lines, padding=True, truncation=True, return_tensors="pt")
        return dict(encoded)
