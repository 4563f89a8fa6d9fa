"""Data sets read from a path for a model spec (the CLI's ``extract --data PATH``): a folder of
images, a text file of lines, a tensor file; each as a DataLoader in a fixed order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hookscope.errors import SpecError, warn
from hookscope.util import require
from hookscope.zoo.models import LoadedModel

__all__ = ["ImageFiles", "load_data"]

Tensor = torch.Tensor


def load_data(path: str | os.PathLike[str], model: LoadedModel, *,
              batch_size: int) -> DataLoader[Any]:
    """Return a DataLoader over the inputs in ``path``, prepared for ``model``, in a fixed order.

    Args:
        path: a folder of images (every image file below it, sorted by relative path; each
            row's id is that path, its label the class folder: ``ImageFiles``), a text
            file with one input a line (blank lines skipped; text models), or a tensor file
            (``.pt``/``.npy``/``.safetensors``) whose dim 0 is the rows.
        model: the loaded model; its preprocessing or tokenizer makes the batches.
        batch_size: rows per batch.

    Raises:
        SpecError: the path is missing, holds no input, holds unreadable images (each image
            is opened and checked first, and all bad ones are named at once, before any shard),
            or does not suit
            the model (text for an image model, ...).
    """
    from hookscope.zoo.inputs import TENSOR_SUFFIXES, load_inputs
    source = Path(path)
    collate: Callable[[list[str]], Any]
    if source.is_dir():
        files = ImageFiles(source, _image_files(source, model))
        return DataLoader(files, batch_size=batch_size, collate_fn=_ImageBatch(model))
    elif source.is_file() and source.suffix.lower() in TENSOR_SUFFIXES:
        rows = load_inputs([str(source)], model).args[0]
        return DataLoader(TensorDataset(rows), batch_size=batch_size)
    elif source.is_file():
        items, collate = _text_lines(source, model), _TextBatch(model)
    else:
        raise SpecError(f"--data {source} does not exist; give a folder of images, a text file "
                        f"with one input a line, or a tensor file ({', '.join(TENSOR_SUFFIXES)})")
    return DataLoader(items, batch_size=batch_size, collate_fn=collate)  # type: ignore[arg-type]


def _image_files(folder: Path, model: LoadedModel) -> list[Path]:
    from hookscope.zoo.inputs import IMAGE_SUFFIXES, check_takes_images, image_files
    check_takes_images(model, f"--data {folder} is a folder of images")
    files = image_files(folder)
    if not files:
        raise SpecError(f"--data {folder} holds no image file ({', '.join(IMAGE_SUFFIXES)})")
    image_module = require("PIL.Image", "reading images")
    bad = []
    for file in files:
        try:
            with image_module.open(file) as image:
                image.verify()
        except Exception as err:  # noqa: BLE001  (Pillow raises many types for a bad file)
            bad.append(f"{file} ({err})")
    if bad:
        raise SpecError(f"cannot read {len(bad)} of the {len(files)} images in {folder}: "
                        f"{'; '.join(bad)}. Fix or remove {'it' if len(bad) == 1 else 'them'}; "
                        f"nothing was extracted yet")
    return files


class ImageFiles(Dataset[tuple[str, str]]):
    """The image files of a folder, in a fixed order: item ``i`` is ``(path, label)``, and
    ``row_id(i)`` the path relative to the folder (``cat/1.jpg``), which ``extract`` stores as
    the row's id. In the class-folder layout (every image in a subfolder, as torchvision's
    ``ImageFolder`` reads it) the label is the top subfolder's name (``cat``); with any image at
    the top level there are no labels (``""`` each).
    """

    def __init__(self, root: Path, files: list[Path]):
        self.names = [f.relative_to(root).as_posix() for f in files]
        self.files = [str(f) for f in files]
        classed = all("/" in name for name in self.names)
        self.labels = [name.split("/")[0] if classed else "" for name in self.names]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[str, str]:
        return self.files[i], self.labels[i]

    def row_id(self, i: int) -> str:
        """The path of image ``i`` relative to the folder, with ``/`` separators."""
        return self.names[i]


def _text_lines(file: Path, model: LoadedModel) -> list[str]:
    from hookscope.zoo.inputs import TENSOR_SUFFIXES
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
        warn(f"--data {file}: skipped {len(every) - len(lines)} blank line(s); row i of "
                      f"the store is the i-th non-blank line", UserWarning)
    if not lines:
        raise SpecError(f"--data {file} has no non-blank line: nothing to extract")
    return lines


class _ImageBatch:
    """collate_fn: image paths -> ``(batch, 3, height, width)`` tensor, as the model expects."""

    def __init__(self, model: LoadedModel):
        if model.preprocess is None:
            raise SpecError(f"'{model.spec}' has no image preprocessing")
        self.preprocess, self.dtype = model.preprocess, model.dtype

    def __call__(self, items: list[tuple[str, str]]) -> Tensor | tuple[Tensor, list[str]]:
        """``(images, labels)`` in the class-folder layout, else the images alone."""
        from hookscope.zoo.inputs import preprocess_image
        image_module = require("PIL.Image", "reading images")
        rows = []
        for file, _ in items:
            with image_module.open(file) as image:
                rgb = np.asarray(image.convert("RGB"))
            rows.append(preprocess_image(rgb, self.preprocess, self.dtype)[0])
        labels = [label for _, label in items]
        return (torch.stack(rows), labels) if all(labels) else torch.stack(rows)


class _TextBatch:
    """collate_fn: lines -> the tokenizer's dict (``input_ids``, ``attention_mask``, ...)."""

    def __init__(self, model: LoadedModel):
        self.tokenizer = model.tokenizer

    def __call__(self, lines: list[str]) -> dict[str, Tensor]:
        encoded = self.tokenizer(lines, padding=True, truncation=True, return_tensors="pt")
        return dict(encoded)
