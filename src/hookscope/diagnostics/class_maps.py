"""Grad-CAM, Grad-CAM++ and LayerCAM: where in the picture a network looks for a class.

Selvaraju, Cogswell, Das, Vedantam, Parikh and Batra, "Grad-CAM: Visual Explanations from Deep
Networks via Gradient-based Localization", ICCV 2017 (arXiv:1610.02391). For a layer with
feature maps ``A^k`` (``channels`` of them, each ``height x width``) and the score ``y^c`` of
class ``c`` (the logit, before softmax):

    alpha_k^c = mean over (i, j) of d y^c / d A^k_ij     (global-average-pooled gradients)
    L^c       = ReLU(sum_k alpha_k^c A^k)                (a height x width map)

``L^c`` is upsampled (bilinear) to the input's size and scaled to [0, 1] per image here. The
feature maps and their gradients come from ``capture(..., grads=True)``: tensor hooks, so an
in-place activation after the layer (pytorch/pytorch#61519) does not break it, and the backward pass
is ``torch.autograd.grad`` with respect to the input, so no parameter's ``.grad`` changes.

With ``g = d y^c / d A^k_ij`` the two variants replace the weights:

- Grad-CAM++ (Chattopadhay, Sarkar, Howlader and Balasubramanian, "Grad-CAM++: Generalized
  Gradient-based Visual Explanations for Deep Convolutional Networks", WACV 2018,
  arXiv:1710.11063, eq. 19 with the exponential score of section 3.3):

  ```text
  a_ij^kc = g^2 / (2 g^2 + sum_ab A^k_ab g^3)     (0 where the denominator is 0)
  w_k^c   = sum_ij a_ij^kc ReLU(g)                 L^c = ReLU(sum_k w_k^c A^k)
  ```

- LayerCAM (Jiang, Zhang, Hou, Cheng and Wei, "LayerCAM: Exploring Hierarchical Class
  Activation Maps for Localization", IEEE TIP 30, 2021, eq. 4-5):

  ```text
  L^c_ij = ReLU(sum_k ReLU(g_ij) A^k_ij)           (a weight per location, not per channel)
  ```

Token models (a vision transformer) give ``(batch, tokens, channels)``: the leading class and
register tokens are dropped and the patch tokens laid out on their grid, ``(batch, channels, h,
w)``, before the same formulas (as pytorch-grad-cam's ``reshape_transform`` does by hand).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hookscope.engine import check_int, check_tensor, index, one_index_per_call, resolve, untouched
from hookscope.errors import ArgumentTypeError, ArgumentValueError, GradcamError
from hookscope.record import Capture, capture, grad_leaf, gradient_pass
from hookscope.util import DPI, check_new_file, require, save_figure

__all__ = ["gradcam", "save_gradcam_overlay", "class_scores", "check_class_target"]

Tensor = torch.Tensor
Method = Literal["gradcam", "gradcam++", "layercam"]
#: class, distillation and register tokens tried before the patch tokens when no grid is known
MAX_PREFIX_TOKENS = 8


@one_index_per_call
def gradcam(model: nn.Module, x: Tensor, layers: str,
            target: int | Sequence[int] | Tensor | None = None, *, call: int | None = None,
            method: Method = "gradcam", grid: tuple[int, int] | None = None) -> Tensor:
    """Class activation map of ``layers`` (one module) for class ``target`` (Selvaraju et al., 2017).

    ```python
    cam = hookscope.gradcam(model.eval(), x, "_conv_head")   # (batch, 224, 224) in [0, 1]
    cam = hookscope.gradcam(vit.eval(), x, "vit.layers.11.layernorm_before")  # a ViT
    ```

    Call ``model.eval()`` first: in training mode dropout makes the map random (the pass runs in
    the model's current mode). The model is left as it was found (BatchNorm statistics,
    spectral norm, train/eval flags, ``requires_grad`` and ``.grad`` of every weight, the RNG
    state: ``engine.run.untouched``).

    Works with frozen weights (the gradient flows from the input, not the weights), under
    ``torch.no_grad()`` (gradients are switched on for its own pass) and under
    ``torch.inference_mode()`` (switched off for its own pass, which runs on an ordinary copy
    of ``x``; the returned map is an ordinary tensor).

    Args:
        model: a classifier returning logits ``(batch, classes)`` (or an object with ``.logits``).
        x: input images, ``(batch, channels, height, width)``, preprocessed for the model.
        layers: a pattern selecting one module whose output is a feature map ``(batch, channels,
            h, w)``, usually the last convolutional layer (``"layer4"`` in a ResNet), or tokens
            ``(batch, tokens, channels)`` (a ViT: the last block's ``layernorm_before``, since
            the classifier reads only the class token of the last block's output, so the patch
            tokens there have zero gradient); a part of a structured output as ``"block[0]"``.
        target: class index per image: ``None`` (default) the predicted class, an int for every
            image, or one int per image.
        call: which call of that module, if the model runs it more than once per forward pass.
        method: ``"gradcam"``, ``"gradcam++"`` (Chattopadhay et al., 2018) or ``"layercam"``
            (Jiang et al., 2021): the formulas are in this module's docstring.
        grid: ``(h, w)`` patch grid of a token output; ``None``: ``x``'s size over the config's
            ``patch_size`` (``model.config``) when that many tokens are there, else the grid
            of ``x``'s aspect ratio that the tokens fill after 0 … 8 leading tokens (a Swin
            stage). The tokens before the last ``h * w`` (class, register) are left out.

    Returns:
        ``(batch, height, width)`` float32, the input's height and width, in [0, 1] per image
        (all zeros where no feature has a positive weighted sum).

    Raises:
        SelectorError: ``layers`` matches no module.
        ArgumentTypeError, ArgumentValueError: at the call: ``target`` not an int, ints or an
            integer tensor, or as many classes as neither 1 nor the batch; ``grid`` not two
            ints >= 1; ``call`` not an int.
        GradcamError: ``x`` is not 4-D; ``layers`` matches several modules, runs several times
            and ``call`` is not given, or does not give a 4-D map or 3-D tokens; the tokens fit
            no grid (give ``grid=(h, w)``); ``method`` is unknown; the model's output is not
            ``(batch, classes)`` scores; a target class is out of range.
        HookNeverFiredError: the module never ran in the forward pass.
        GradcamError: a parameter or buffer is an inference tensor (the model was built or
            loaded under ``torch.inference_mode()``): no gradient can pass through it.
    """
    key = _one_target(model, layers)
    check_class_target(target, x.shape[0] if isinstance(x, Tensor) and x.dim() else None)
    if grid is not None:
        _check_grid(grid)
    if call is not None:
        check_int("call", call)
    if method not in _WEIGHTINGS:
        raise GradcamError(f"method={method!r} is not one of {sorted(_WEIGHTINGS)}")
    check_tensor("x", x, "images of shape (batch, channels, height, width)")
    if x.dim() != 4:
        raise GradcamError(f"x must be images (batch, channels, height, width); got shape "
                           f"{tuple(x.shape)}: {_not_images(x)}")
    with untouched(model), gradient_pass(model, GradcamError):
        acts = _pass(model, key, x, target)
    calls = acts.counts[key]
    if call is None and calls > 1:
        raise GradcamError(f"'{key}' ran {calls} times in one forward pass; choose one with "
                           f"call=k (0 … {calls - 1}, -1 for the last)")
    k = 0 if call is None else call
    features, grads = acts[key, k], acts.grad(key, k)
    if isinstance(features, Tensor) and features.dim() == 3:
        patches = grid or _token_grid(model, features.shape[1], tuple(x.shape[-2:]), key)
        features, grads = _on_grid(features, patches, key), _on_grid(grads, patches, key)
    if not isinstance(features, Tensor) or features.dim() != 4:
        shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise GradcamError(f"'{key}' gives {shape}, not a feature map (batch, channels, h, w) "
                           f"nor tokens (batch, tokens, channels): choose a convolutional layer "
                           f"or a transformer block's part, or a tensor part of its output")
    _check_gradient_reaches(model, key, grads)
    cam = _WEIGHTINGS[method](features.float(), grads.float())[:, None]  # (batch, 1, h, w)
    cam = F.interpolate(cam, size=tuple(x.shape[-2:]), mode="bilinear", align_corners=False)[:, 0]
    return _unit_range(cam)


def _not_images(x: Tensor) -> str:
    """The fix for an input that is not a batch of images, by its number of dimensions."""
    if x.dim() == 3:
        return "one image without its batch dimension: pass x[None]"
    if x.dim() == 5:
        return "a video or a stack of batches: pass one batch of frames, x.flatten(0, 1)"
    return (f"{x.dim()}-D input has no height and width to map (a batch of vectors or token ids "
            f"is not an image): Grad-CAM explains image models. For a vector or token model use "
            f"hookscope.attribution_patching (which input position or module matters) or, with "
            f"attention, hookscope.rollout")


def _check_gradient_reaches(model: nn.Module, key: str, grads: Tensor) -> None:
    """Refuse a layer whose map (or patch tokens) gets an identically zero gradient: the class
    score does not depend on its positions (a ViT block's output, of which the classifier reads
    only the class token), so every weighting gives an all-zero map. A map that is zero after
    the ReLU of real gradients is not refused: this looks at the gradient, not the map."""
    if bool(grads.any()):
        return
    module = index(model).modules.get(key.split("[")[0])
    children = [name for name, _ in module.named_children()] if module is not None else []
    inside = next((n for n in children if "norm" in n.lower()), children[0] if children else None)
    example = f" such as '{key}.{inside}'" if inside is not None else ""
    raise GradcamError(
        f"no gradient reaches the spatial/patch positions of '{key}': the class score does not "
        "depend on them (a ViT block's output, of which the classifier reads only the class "
        "token of the last layernorm), so the map would be all zeros; choose a layer inside the "
        f"block{example} (in a ViT, a block's 'layernorm_before')")


def _gradcam(features: Tensor, grads: Tensor) -> Tensor:
    weights = grads.mean(dim=(2, 3), keepdim=True)  # (batch, channels, 1, 1): alpha_k^c
    return F.relu((weights * features).sum(dim=1))


def _gradcam_plus_plus(features: Tensor, grads: Tensor) -> Tensor:
    squared = grads.pow(2)
    denominator = 2 * squared + features.sum(dim=(2, 3), keepdim=True) * grads.pow(3)
    alpha = torch.where(denominator != 0, squared / torch.where(denominator != 0, denominator, 1),
                        torch.zeros_like(squared))
    weights = (alpha * F.relu(grads)).sum(dim=(2, 3), keepdim=True)  # (batch, channels, 1, 1)
    return F.relu((weights * features).sum(dim=1))


def _layercam(features: Tensor, grads: Tensor) -> Tensor:
    return F.relu((F.relu(grads) * features).sum(dim=1))


_WEIGHTINGS = {"gradcam": _gradcam, "gradcam++": _gradcam_plus_plus, "layercam": _layercam}


def _token_grid(model: nn.Module, tokens: int, size: tuple[int, ...], key: str
                ) -> tuple[int, int]:
    """The ``(h, w)`` patch grid of ``tokens``: the config's patch grid, else the grid of the
    image's aspect ratio left after 0 … ``MAX_PREFIX_TOKENS`` leading tokens."""
    patch = getattr(getattr(model, "config", None), "patch_size", None)
    if isinstance(patch, int) and patch > 0:
        h, w = size[0] // patch, size[1] // patch
        if 0 < h * w <= tokens:
            return h, w
    for prefix in range(min(MAX_PREFIX_TOKENS, tokens - 1) + 1):
        h = round(((tokens - prefix) * size[0] / size[1]) ** 0.5)
        if h > 0 and (tokens - prefix) % h == 0 and h * size[1] == (tokens - prefix) // h * size[0]:
            return h, (tokens - prefix) // h
    raise GradcamError(f"'{key}' gives {tokens} tokens, which fill no patch grid of the "
                       f"{size[0]}x{size[1]} image's aspect ratio after 0 … {MAX_PREFIX_TOKENS} "
                       f"class/register tokens: give the grid, gradcam(..., grid=(h, w))")


def _on_grid(tokens: Tensor, grid: tuple[int, int], key: str) -> Tensor:
    """``(batch, tokens, channels)`` -> ``(batch, channels, h, w)``, the last ``h * w`` tokens."""
    h, w = grid
    if not 0 < h * w <= tokens.shape[1]:
        raise GradcamError(f"grid={grid} needs {h * w} patch tokens, but '{key}' gives "
                           f"{tokens.shape[1]}: give a grid of at most that many")
    patches = tokens[:, tokens.shape[1] - h * w:]
    return patches.reshape(tokens.shape[0], h, w, tokens.shape[2]).permute(0, 3, 1, 2)


def save_gradcam_overlay(image: np.ndarray | Tensor | str | os.PathLike[str], cam: np.ndarray | Tensor,
                         path: str | os.PathLike[str], *, title: str | None = None,
                         overwrite: bool = True) -> Path:
    """Draw ``cam`` over ``image`` and write the PNG atomically (temporary file, then rename).

    Two panels: the photo, and the photo under the map (jet colours, half transparent) with a
    colour bar. Uses matplotlib's Agg canvas (no display, no pyplot state).

    Args:
        image: ``(height, width, 3)`` RGB, uint8 or float in [0, 1], as the model saw it (e.g.
            ``Inputs.images[0]``: resized, before normalisation); or the path of an image file
            (read with Pillow, converted to RGB; the map is resized to its size).
        cam: ``(height, width)`` in [0, 1], e.g. ``gradcam(...)[0]``; resized to the image if
            its size differs.
        path: the PNG to write; its folder is created if missing.
        title: drawn above the panels.
        overwrite: replace an existing file; if False, an existing file is an error.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        GradcamError: ``image`` is not ``(height, width, 3)`` or ``cam`` is not 2-D; ``image``
            is a path that does not exist or is not an image Pillow reads.
        OutputExistsError: ``path`` is a folder, or exists and ``overwrite`` is False
            (``util.check_new_file``, as every ``save``).
        MissingExtraError: matplotlib is not installed (``pip install 'hookscope[viz]'``).
    """
    path = check_new_file(path, overwrite=overwrite, example="gradcam.png")
    picture = _as_picture(image)
    heat = _as_map(cam, picture.shape[:2])
    figure_module = require("matplotlib.figure", "save_gradcam_overlay")
    figure = figure_module.Figure(figsize=(10, 4.6), dpi=DPI, layout="constrained")
    left, right = figure.subplots(1, 2)
    left.imshow(picture)
    left.set_title("input")
    right.imshow(picture)
    shown = right.imshow(heat, cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
    right.set_title("Grad-CAM")
    figure.colorbar(shown, ax=right, fraction=0.046, pad=0.04)
    for axes in (left, right):
        axes.set_axis_off()
    if title:
        figure.suptitle(title)
    return save_figure(figure, Path(path))


def _pass(model: nn.Module, key: str, x: Tensor, target: Any) -> Capture:
    """Capture ``key``'s output and gradient over one forward of ``x`` and the backward of the
    ``target`` class scores; ``x`` is made a gradient leaf, so gradients reach the layer even
    when the weights are frozen."""
    x = grad_leaf(x)
    acts = capture(model, key, grads=True, on_unfired="error")
    with acts:
        output = model(x)
    torch.autograd.grad(class_scores(output, target), x)
    return acts


def check_class_target(target: object, batch: int | None) -> None:
    """Raise at the call unless ``target`` is ``None``, an ``int`` (not a ``bool``), a sequence
    of ints or an integer tensor, with one class or one per image of a batch of ``batch``
    (when known): Grad-CAM and gradient-weighted rollout index the class scores by it.

    Raises:
        ArgumentTypeError: another type (``1.5``, ``True``, ``"cat"``, a float tensor).
        ArgumentValueError: as many classes as neither 1 nor the batch size.
    """
    if target is None:
        return
    if isinstance(target, Tensor):
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise ArgumentTypeError(f"target must hold integer class indices; got a {target.dtype} "
                                    f"tensor: pass target=torch.tensor([3]) (torch.long)")
        count = target.numel()
    else:
        items = [target]
        if isinstance(target, Sequence) and not isinstance(target, (str, bytes)):
            items = list(target)
        for item in items:
            check_int("target", item, minimum=-(2**63), maximum=2**63 - 1)  # torch.long
        count = len(items)
    if batch is not None and count not in (1, batch):
        raise ArgumentValueError(f"target gives {count} classes for a batch of {batch}: give one "
                                 f"int for every image, or one per image")


def _check_grid(grid: object) -> None:
    if not isinstance(grid, (tuple, list)) or len(grid) != 2:
        raise ArgumentTypeError(f"grid must be a pair (h, w) of patch rows and columns, e.g. "
                                f"grid=(14, 14); got {grid!r}")
    for value in grid:
        check_int("grid", value, minimum=1)


def class_scores(output: Any, target: int | Sequence[int] | Tensor | None) -> Tensor:
    """The summed logit of class ``target`` of each batch row (``None``: the predicted class)
    of a classifier's ``output`` ``(batch, classes)`` (a tensor or an output with ``.logits``):
    the scalar Grad-CAM and the gradient-weighted rollout differentiate.

    Raises:
        GradcamError: the output is not class scores, or ``target`` is out of range or gives
            another number of classes than the batch has rows.
    """
    logits = _logits(output)
    return logits.gather(1, _classes(target, logits)[:, None]).sum()


# ------------------------------------------------------------------------------- internals
def _one_target(model: nn.Module, layer: str) -> str:
    targets = resolve(model, [layer])
    if len(targets) != 1:
        names = ", ".join(t.key for t in targets[:6]) + (" …" if len(targets) > 6 else "")
        raise GradcamError(f"layer '{layer}' matches {len(targets)} modules ({names}); Grad-CAM "
                           f"needs one: give its exact path")
    return targets[0].key


def _logits(output: Any) -> Tensor:
    logits = output if isinstance(output, Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        what = tuple(logits.shape) if isinstance(logits, Tensor) else type(output).__name__
        raise GradcamError(f"the model returned {what}; Grad-CAM and gradient-weighted "
                           f"rollout need class scores (batch, classes), as a tensor or an "
                           f"output with .logits")
    return logits


def _classes(target: int | Sequence[int] | Tensor | None, logits: Tensor) -> Tensor:
    batch, count = logits.shape
    if target is None:
        return logits.detach().argmax(dim=1)
    classes = torch.as_tensor(target, dtype=torch.long, device=logits.device).reshape(-1)
    if classes.numel() == 1:
        classes = classes.expand(batch)
    if classes.numel() != batch:
        raise GradcamError(f"target gives {classes.numel()} classes for a batch of {batch}: give "
                           f"one int, or one per image")
    if bool(((classes < 0) | (classes >= count)).any()):
        raise GradcamError(f"target {classes.tolist()} is out of range: the model has {count} "
                           f"classes (0 … {count - 1})")
    return classes


def _unit_range(cam: Tensor) -> Tensor:
    """Scale each ``(height, width)`` map to [0, 1]; a constant map becomes zeros."""
    low = cam.amin(dim=(1, 2), keepdim=True)
    span = cam.amax(dim=(1, 2), keepdim=True) - low
    return torch.where(span > 0, (cam - low) / span.clamp_min(torch.finfo(cam.dtype).tiny),
                       torch.zeros_like(cam))


def _as_picture(image: np.ndarray | Tensor | str | os.PathLike[str]) -> np.ndarray:
    if isinstance(image, (str, os.PathLike)):
        return _read_picture(image)
    picture = image.detach().cpu().numpy() if isinstance(image, Tensor) else np.asarray(image)
    if picture.ndim != 3 or picture.shape[2] != 3:
        raise GradcamError(f"image must be (height, width, 3) RGB; got shape {picture.shape} "
                           f"(a (3, height, width) tensor: use image.permute(1, 2, 0))")
    if picture.dtype != np.uint8:
        picture = np.clip(picture.astype(np.float32), 0.0, 1.0)
    return picture


def _read_picture(file: str | os.PathLike[str]) -> np.ndarray:
    """The image file ``file`` as ``(height, width, 3)`` uint8 RGB (Pillow)."""
    pil = require("PIL.Image", "save_gradcam_overlay")
    try:
        with pil.open(file) as opened:
            return np.asarray(opened.convert("RGB"))
    except (OSError, ValueError) as err:  # missing, a folder, not an image (UnidentifiedImageError)
        raise GradcamError(f"image={os.fspath(file)!r} cannot be read as a picture ({err}); give "
                           f"the path of a PNG/JPEG file, or a (height, width, 3) array") from None


def _as_map(cam: np.ndarray | Tensor, size: tuple[int, ...]) -> np.ndarray:
    heat = torch.as_tensor(cam.detach().cpu() if isinstance(cam, Tensor) else np.asarray(cam))
    if heat.dim() != 2:
        raise GradcamError(f"cam must be one (height, width) map; got shape {tuple(heat.shape)} "
                           f"(take one image of the batch: cam[0])")
    if tuple(heat.shape) != tuple(size):
        heat = F.interpolate(heat[None, None].float(), size=tuple(size), mode="bilinear",
                             align_corners=False)[0, 0]
    return heat.float().numpy()
