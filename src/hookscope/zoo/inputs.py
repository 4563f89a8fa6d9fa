"""Input specs: strings such as ``"sample:chelsea"`` or ``"randn:2,3,32,32"`` -> a model batch.

One spec is one of

- an image file (``.png``, ``.jpg``, ``.jpeg``, ``.bmp``, ``.gif``, ``.webp``, ``.tif``): read
  with Pillow as RGB, resized and normalised as the model expects; several images form one batch;
- ``sample:NAME``: a photo bundled with scikit-image (``sample:chelsea``, ``sample:astronaut``,
  ``sample:coffee``, ...; see ``SAMPLES``), treated as an image file;
- a tensor file: ``.pt``/``.pth`` (``torch.load(weights_only=True)``), ``.npy``
  (``allow_pickle=False``) or ``.safetensors``; a file holding several tensors needs
  ``FILE:KEY``; each tensor spec is one positional argument of the model;
- ``randn:SHAPE``: standard-normal noise, e.g. ``randn:2,3,32,32``, from a generator seeded 0;
- for text models, any other string is a sentence; all sentences are tokenized together with
  padding.
"""

from __future__ import annotations

import math
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm import tqdm

from hookscope.engine import index, locate_error
from hookscope.errors import HookscopeError, ModelCodeError, SpecError
from hookscope.util import require
from hookscope.zoo.models import IMAGENET_MEAN, IMAGENET_STD, ImagePreprocess, LoadedModel

__all__ = ["Inputs", "load_inputs", "check_takes_images", "preprocess_image", "SAMPLES", "IMAGE_SUFFIXES",
           "TENSOR_SUFFIXES", "split_tensor_spec", "image_files", "expand_folder",
           "RANDN_MAX_ELEMENTS", "read_tensor_file"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
TENSOR_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")
RANDN_SEED = 0
RANDN_MAX_ELEMENTS = 2**28  # randn:SHAPE refuses more values: 1 GiB of float32
_PROGRESS_FROM = 16  # show a progress bar from this many inputs on

# scikit-image's bundled pictures (no download needed): name -> function name in skimage.data.
SAMPLES: dict[str, str] = {
    "astronaut": "astronaut", "brick": "brick", "camera": "camera", "cat": "cat",
    "cell": "cell", "chelsea": "chelsea", "clock": "clock", "coffee": "coffee",
    "coins": "coins", "colorwheel": "colorwheel", "grass": "grass", "gravel": "gravel",
    "horse": "horse", "hubble_deep_field": "hubble_deep_field",
    "immunohistochemistry": "immunohistochemistry", "logo": "logo",
    "microaneurysms": "microaneurysms", "moon": "moon", "motorcycle": "stereo_motorcycle",
    "page": "page", "retina": "retina", "rocket": "rocket", "text": "text",
}

Category = Literal["image", "tensor", "text"]


@dataclass(frozen=True)
class Inputs:
    """A batch ready for ``module(*args, **kwargs)``, with what it was made from.

    Attributes:
        args: positional arguments: one ``(batch, 3, height, width)`` tensor for images, one
            tensor per tensor spec, nothing for text.
        kwargs: keyword arguments: the tokenizer's ``input_ids``, ``attention_mask``, ... for
            text (each ``(batch, seq)`` int64), nothing otherwise.
        specs: the input specs as given.
        descriptions: one line per spec saying what was read and how it was turned into input.
        images: for image inputs, each picture as the model sees it (resized, before
            normalisation): ``(height, width, 3)`` uint8 RGB, one per batch row; else empty.
        texts: for text inputs, the sentences, one per batch row; else empty.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    specs: tuple[str, ...] = ()
    descriptions: tuple[str, ...] = ()
    images: tuple[np.ndarray, ...] = ()
    texts: tuple[str, ...] = ()

    def call(self, module: torch.nn.Module) -> Any:
        """Run ``module(*args, **kwargs)`` under ``torch.no_grad()`` and return its output.

        Raises:
            ModelCodeError: the forward pass raised (most often: an input this model cannot
                take); the message names the innermost module that was running, and chains the
                error. (The CLI exits 1: the run failed, not the command line.)
        """
        try:
            with torch.no_grad():
                return module(*self.args, **self.kwargs)
        except HookscopeError:
            raise
        except Exception as err:  # any failure inside user or library model code
            locate_error(index(module), err)
            where = "; ".join(dict.fromkeys(getattr(err, "__notes__", [])))
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ModelCodeError(f"the model failed on input {', '.join(self.specs)}: "
                            f"{type(err).__name__}: {first}{' (' + where + ')' if where else ''}"
                            ) from err


def load_inputs(specs: Sequence[str], model: LoadedModel) -> Inputs:
    """Turn input specs (grammar in the module docstring) into one batch for ``model``.

    Args:
        specs: one or more input specs, all images, all tensors or all sentences.
        model: the loaded model; its ``kind``, ``preprocess``, ``tokenizer`` and ``dtype``
            decide how inputs are prepared (floating tensors are cast to ``model.dtype``).

    Returns:
        An ``Inputs``; ``inputs.call(model.module)`` runs the model on it.

    Raises:
        SpecError: no spec; a missing or unreadable file; an unknown ``sample:`` name (the
            message lists the valid ones); a bad ``randn:`` shape; a tensor whose shape the
            model cannot take; specs of different categories mixed; text for a non-text model.
        MissingExtraError: Pillow, scikit-image or transformers is needed and missing.
    """
    if isinstance(specs, str) or not specs:
        raise SpecError("no input given: pass at least one, e.g. --input sample:chelsea, "
                        "--input photo.jpg, --input 'a sentence' or --input randn:1,3,224,224")
    specs = [name for spec in specs for name in expand_folder(spec)]
    category = _category_of(specs, model)
    if category == "image":
        return _load_images(list(specs), model)
    if category == "text":
        return _load_texts(list(specs), model)
    return _load_tensors(list(specs), model)


def preprocess_image(rgb: np.ndarray, preprocess: ImagePreprocess,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, np.ndarray]:
    """Resize an RGB picture with Pillow and normalise it.

    Args:
        rgb: ``(height, width, 3)`` uint8 picture.
        preprocess: target ``size`` (height, width), ``mean``/``std`` and resampling filter.
        dtype: dtype of the returned tensor.

    Returns:
        ``(tensor, resized)``: the ``(3, height, width)`` normalised tensor, and the resized
        picture as ``(height, width, 3)`` uint8.
    """
    image_module = require("PIL.Image", "reading images")
    height, width = preprocess.size
    resample = getattr(image_module.Resampling, preprocess.resample.upper())
    resized = np.asarray(image_module.fromarray(rgb).resize((width, height), resample))
    scaled = resized.astype(np.float32) / 255.0
    normalised = (scaled - np.asarray(preprocess.mean, np.float32)) / np.asarray(preprocess.std,
                                                                                  np.float32)
    tensor = torch.from_numpy(np.ascontiguousarray(normalised.transpose(2, 0, 1)))  # (3, h, w)
    return tensor.to(dtype), resized


def image_files(folder: Path) -> list[Path]:
    """Every image file (``IMAGE_SUFFIXES``, any case) below ``folder``, sub-folders included,
    sorted by the path relative to ``folder``: the order of ``--input DIR`` and ``--data DIR``.
    Hidden files and folders (a name starting with ``.``: ``.ipynb_checkpoints/``, ``.git/``,
    macOS's ``._cat.jpg``) are left out, as ``ls`` leaves them out: they are no class, no input."""
    return sorted((p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                   and p.is_file()), key=lambda p: p.relative_to(folder).as_posix())


def expand_folder(spec: str) -> list[str]:
    """``[spec]``, or for a folder the image files in it (``image_files``) as specs.

    Raises:
        SpecError: ``spec`` is a folder without any image file.
    """
    folder = Path(spec)
    if not folder.is_dir():
        return [spec]
    files = image_files(folder)
    if not files:
        raise SpecError(f"input folder '{spec}' holds no image file "
                        f"({', '.join(IMAGE_SUFFIXES)}): give a folder of images, or files")
    return [str(f) for f in files]


# ------------------------------------------------------------------------------ categories
def _category_of(specs: list[str], model: LoadedModel) -> Category:
    categories = {spec: _category(spec, model) for spec in specs}
    kinds = set(categories.values())
    if len(kinds) > 1:
        listing = ", ".join(f"'{s}' ({c})" for s, c in categories.items())
        raise SpecError(f"inputs of different kinds cannot form one batch: {listing}; pass only "
                        "images, only tensors, or only sentences")
    return kinds.pop()


def _category(spec: str, model: LoadedModel) -> Category:
    lowered = spec.lower()
    if lowered.startswith("sample:") or lowered.endswith(IMAGE_SUFFIXES):
        return "image"
    if (lowered.startswith("randn:")
            or split_tensor_spec(spec)[0].lower().endswith(TENSOR_SUFFIXES)):
        return "tensor"
    if model.kind == "text":
        return "text"
    if "/" in spec or "\\" in spec or Path(spec).suffix:
        raise SpecError(f"input '{spec}' is not a file hookscope can read: use an image "
                        f"({', '.join(IMAGE_SUFFIXES[:3])}, ...) or a tensor file "
                        f"({', '.join(TENSOR_SUFFIXES)})")
    raise SpecError(f"input '{spec}' is not an image, tensor or sample, and '{model.spec}' does "
                    f"not take text; {_takes(model)}")


def _takes(model: LoadedModel) -> str:
    if model.kind == "image" and model.preprocess is not None:
        height, width = model.preprocess.size
        return (f"it takes images (png/jpg files, sample:NAME) or tensors "
                f"(randn:1,3,{height},{width}, .pt, .npy, .safetensors)")
    if model.kind == "text":
        return "it takes sentences (any other string) or token-id tensors"
    return "it takes tensors: randn:SHAPE, .pt, .npy or .safetensors files"


# ---------------------------------------------------------------------------------- images
def check_takes_images(model: LoadedModel, given: str) -> ImagePreprocess:
    """The one check (and message) of every verb given images: ``--input`` files, ``--data``
    folders.

    Args:
        model: the loaded model.
        given: what the user gave, for the message (``"a.png, b.png"``, ``"--data photos/"``).

    Returns:
        The model's image preprocessing.

    Raises:
        SpecError: ``model`` has no image preprocessing (a user model loaded without
            ``--image-size``); the message names every fix.
    """
    if model.kind == "image" and model.preprocess is not None:
        return model.preprocess
    raise SpecError(f"'{model.spec}' does not take images ({given}): "
                    f"{_takes(model)}. To give it images, say how they become its input: "
                    f"--image-size N (and --mean R,G,B --std R,G,B; load_model(spec, "
                    f"image_size=N) in Python), or a factory that returns hookscope.zoo."
                    f"models.LoadedModel(module, kind='image', preprocess=ImagePreprocess("
                    f"size=(N, N)))")


def _load_images(specs: list[str], model: LoadedModel) -> Inputs:
    preprocess = check_takes_images(model, ", ".join(specs[:3]))
    rows, pictures, descriptions = [], [], []
    for spec in _progress(specs, "reading images"):
        rgb = _read_sample(spec[len("sample:"):]) if spec.lower().startswith("sample:") \
            else _read_image_file(Path(spec))
        tensor, resized = preprocess_image(rgb, preprocess, model.dtype)
        rows.append(tensor)
        pictures.append(resized)
        descriptions.append(_describe_image(spec, rgb, preprocess))
    batch = torch.stack(rows)  # (batch, 3, height, width)
    return Inputs(args=(batch,), specs=tuple(specs), descriptions=tuple(descriptions),
                  images=tuple(pictures))


def _describe_image(spec: str, rgb: np.ndarray, preprocess: ImagePreprocess) -> str:
    height, width = preprocess.size
    imagenet = (preprocess.mean, preprocess.std) == (IMAGENET_MEAN, IMAGENET_STD)
    return (f"{spec}: {rgb.shape[1]}x{rgb.shape[0]} RGB picture, resized to {width}x{height} "
            f"({preprocess.resample}), {'ImageNet mean/std' if imagenet else 'mean/std'} normalised")


def _read_sample(name: str) -> np.ndarray:
    if name not in SAMPLES:
        raise SpecError(f"unknown sample '{name}': choose one of {', '.join(sorted(SAMPLES))} "
                        "(pictures bundled with scikit-image)")
    data = require("skimage.data", f"sample:{name}")
    picture = getattr(data, SAMPLES[name])()
    if isinstance(picture, tuple):  # stereo_motorcycle: (left, right, disparity)
        picture = picture[0]
    return _as_rgb_uint8(np.asarray(picture))


def _read_image_file(path: Path) -> np.ndarray:
    image_module = require("PIL.Image", "reading images")
    if not path.is_file():
        raise SpecError(f"image '{path}' does not exist (looked in {path.resolve().parent})")
    try:
        with image_module.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError) as err:
        raise SpecError(f"cannot read image '{path}': {err}") from err


def _as_rgb_uint8(picture: np.ndarray) -> np.ndarray:
    if picture.dtype == bool:
        picture = picture.astype(np.uint8) * 255
    elif picture.dtype != np.uint8:  # float pictures in [0, 1]
        picture = (np.clip(picture, 0.0, 1.0) * 255).round().astype(np.uint8)
    if picture.ndim == 2:  # grayscale
        picture = np.stack([picture] * 3, axis=-1)
    return np.ascontiguousarray(picture[..., :3])  # drop an alpha channel


# ----------------------------------------------------------------------------------- texts
def _load_texts(specs: list[str], model: LoadedModel) -> Inputs:
    if model.tokenizer is None:
        raise SpecError(f"'{model.spec}' has no tokenizer, so it cannot take text")
    encoded = model.tokenizer(specs, padding=True, return_tensors="pt")
    kwargs = {key: value for key, value in encoded.items()}
    mask = kwargs.get("attention_mask")
    lengths = mask.sum(dim=1).tolist() if mask is not None else [kwargs["input_ids"].shape[1]] * len(specs)
    descriptions = tuple(f"{text!r}: {n} tokens" for text, n in zip(specs, lengths))
    return Inputs(args=(), kwargs=kwargs, specs=tuple(specs), descriptions=descriptions,
                  texts=tuple(specs))


# --------------------------------------------------------------------------------- tensors
def _load_tensors(specs: list[str], model: LoadedModel) -> Inputs:
    tensors, descriptions = [], []
    for spec in _progress(specs, "reading tensors"):
        tensor = _randn(spec) if spec.lower().startswith("randn:") else read_tensor_file(spec)
        if tensor.is_floating_point():
            tensor = tensor.to(model.dtype)
        _check_shape(spec, tensor, model)
        shape = "x".join(str(n) for n in tensor.shape)
        seeded = f" (seed {RANDN_SEED})" if spec.lower().startswith("randn:") else ""
        descriptions.append(f"{spec}: tensor {shape} {str(tensor.dtype).removeprefix('torch.')}"
                            f"{seeded}")
        tensors.append(tensor)
    if model.kind == "image" and len(tensors) != 1:
        raise SpecError(f"'{model.spec}' takes one image batch, got {len(tensors)} tensors; "
                        "stack them into one (batch, 3, height, width) tensor")
    return Inputs(args=tuple(tensors), specs=tuple(specs), descriptions=tuple(descriptions))


def _randn(spec: str) -> torch.Tensor:
    text = spec[len("randn:"):]
    try:
        shape = tuple(int(n) for n in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(n <= 0 for n in shape):
        raise SpecError(f"'{spec}' needs a shape of positive integers, e.g. randn:2,3,32,32")
    if math.prod(shape) > RANDN_MAX_ELEMENTS:
        raise SpecError(f"'{spec}' asks for {math.prod(shape):,} values, over the randn: limit of "
                        f"{RANDN_MAX_ELEMENTS:,} (RANDN_MAX_ELEMENTS, 1 GiB of float32): give a "
                        f"smaller shape, or save a larger tensor to a .pt/.npy/.safetensors file "
                        f"and pass that")
    return torch.randn(shape, generator=torch.Generator().manual_seed(RANDN_SEED))


def split_tensor_spec(spec: str) -> tuple[str, str | None]:
    """Split ``FILE:KEY`` into the file and the key (``None`` when there is no key): the one
    reading of ``FILE:KEY`` for ``--input`` and ``--data``."""
    head, sep, key = spec.rpartition(":")
    if sep and head.lower().endswith(TENSOR_SUFFIXES) and key:
        return head, key
    return spec, None


def read_tensor_file(spec: str) -> torch.Tensor:
    """The tensor in file ``spec`` (``FILE`` or ``FILE:KEY``; ``.pt``/``.pth`` read with
    ``torch.load(weights_only=True)``, ``.npy``, ``.safetensors``).

    Raises:
        SpecError: no such file, an unreadable one, one holding Python objects, or a key that
            names no tensor (or several tensors and no key).
    """
    name, key = split_tensor_spec(spec)
    path = Path(name)
    if not path.is_file():
        raise SpecError(f"tensor file '{path}' does not exist (looked in {path.resolve().parent})")
    try:
        content = _read_any(path)
    except pickle.UnpicklingError:  # torch refused an object: never unpickled here
        raise SpecError(f"'{path}' holds Python objects, not plain tensors; hookscope reads .pt "
                        f"files with torch.load(weights_only=True) and never runs the code a "
                        f"pickle may carry. Save the tensors themselves (torch.save(tensor) or "
                        f"safetensors) and pass that file") from None
    except Exception as err:  # corrupt file, ...
        raise SpecError(f"cannot read tensor file '{path}': {type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}") from None
    if isinstance(content, torch.Tensor):
        if key is not None:
            raise SpecError(f"'{path}' holds one tensor, not a dict of them, so ':{key}' names "
                            f"nothing in it: drop ':{key}' and pass {path}")
        return content
    tensors = {k: v for k, v in content.items() if isinstance(v, torch.Tensor)} \
        if isinstance(content, dict) else {}
    if key is not None:
        if key not in tensors:
            raise SpecError(f"'{path}' has no tensor '{key}'; it holds {_keys(tensors)}")
        return tensors[key]
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    if not tensors:
        raise SpecError(f"'{path}' holds no tensor (an empty checkpoint?): pass a file that "
                        f"holds the values, e.g. torch.save(tensor, '{path.stem}.pt')")
    raise SpecError(f"'{path}' holds {len(tensors)} tensors; pick one with '{path}:KEY' "
                    f"(keys: {_keys(tensors)})")


def _read_any(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return torch.from_numpy(np.load(path, allow_pickle=False))
    if suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _keys(tensors: dict[str, torch.Tensor]) -> str:
    names = list(tensors)
    return ", ".join(names[:8]) + (" …" if len(names) > 8 else "") if names else "no tensors"


def _check_shape(spec: str, tensor: torch.Tensor, model: LoadedModel) -> None:
    if model.kind != "image" or model.preprocess is None:
        return
    if tensor.dim() != 4 or tensor.shape[1] != 3 or not tensor.is_floating_point():
        height, width = model.preprocess.size
        raise SpecError(f"'{model.spec}' takes images as a float (batch, 3, height, width) tensor, "
                        f"but {spec} is {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}; "
                        f"e.g. randn:1,3,{height},{width}")


def _progress(items: list[str], description: str) -> Any:
    return tqdm(items, desc=description, file=sys.stderr, leave=False,
                disable=len(items) < _PROGRESS_FROM)
