"""``hookscope gradcam MODEL --input IMG --layers L``: where in each image the model looks for a
class (Grad-CAM, Grad-CAM++ or LayerCAM of one layer), drawn over the image as one PNG per input
(``OUT/gradcam_<i>.png``) with a table of the class, its logit and the map's peak on stdout.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import hookscope
from hookscope.cli._common import (
    add_model_arguments,
    add_parents_argument,
    check_output_path,
    image_options,
    load_model_timed,
    non_negative_int,
    print_json,
    print_table,
    say,
)
from hookscope.errors import SpecError
from hookscope.zoo import load_inputs, plan_png_files

__all__ = ["HELP", "add_arguments", "run"]

HELP = "Grad-CAM / Grad-CAM++ / LayerCAM of one layer over each input image, as PNG overlays"

COLUMNS = ("input", "class", "name", "logit", "peak_yx", "png")
METHODS = ("gradcam", "gradcam++", "layercam")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``gradcam`` options to ``parser``."""
    add_model_arguments(parser)
    parser.add_argument("--layers", required=True, metavar="PATTERN",
                        help="a pattern selecting one layer: a CNN feature map (_conv_head) or a "
                             "ViT token output (vit.layers.11.layernorm_before)")
    parser.add_argument("--target", type=non_negative_int, metavar="CLASS",
                        help="class index to explain (default: each input's predicted class)")
    parser.add_argument("--method", choices=METHODS, default="gradcam",
                        help="Grad-CAM (default), Grad-CAM++ or LayerCAM")
    parser.add_argument("--out", metavar="DIR", default="gradcam",
                        help="folder for the PNGs, gradcam_<i>.png per input (default: gradcam/)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing PNGs")
    add_parents_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the table as JSON")


def run(args: argparse.Namespace) -> int:
    """Compute, draw and tabulate the maps as ``args`` says; exit code 0."""
    check_output_path(args.out, "--out", parents=args.parents, folder=True)
    loaded = load_model_timed(args.model, **image_options(args))
    hookscope.select(loaded.module, args.layers)  # a bad pattern fails here, before any work
    inputs = load_inputs(args.input, loaded)
    if not inputs.images:
        raise SpecError(f"gradcam draws over input images, and the inputs {list(inputs.specs)} "
                        f"are not images: give an image file, a folder of them or sample:NAME")
    files = plan_png_files(Path(args.out), [f"gradcam_{i}" for i in range(len(inputs.images))],
                           args.overwrite, "--out")
    for line in inputs.descriptions:
        say(f"input {line}")
    x = inputs.args[0]
    logits = _logits(loaded.module, x)
    if args.target is not None and args.target >= logits.shape[1]:
        raise SpecError(f"--target {args.target} is not a class of this model, which has "
                        f"{logits.shape[1]} (0 … {logits.shape[1] - 1})")
    classes = [args.target if args.target is not None else int(c) for c in logits.argmax(dim=1)]
    cams = hookscope.gradcam(loaded.module, x, args.layers, target=classes, method=args.method)
    specs = inputs.specs if len(inputs.specs) == len(inputs.images) else (
        [f"input {i}" for i in range(len(inputs.images))])  # a folder gives several images
    rows = []
    for i, (image, cam, spec, file) in enumerate(zip(inputs.images, cams, specs, files.values())):
        hookscope.save_gradcam_overlay(image, cam, file, title=f"{args.method} of '{args.layers}'"
                                       f", class {classes[i]}, {spec}")
        say(f"wrote {file}")
        rows.append(_row(spec, classes[i], loaded.class_names, float(logits[i, classes[i]]), cam,
                         file))
    if args.json:
        print_json(rows)
    else:
        print_table(rows, COLUMNS)
    return 0


def _logits(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The class scores ``(batch, classes)`` of one forward under ``torch.no_grad()``."""
    with torch.no_grad():
        output = module(x)
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise SpecError(f"the model returned {type(output).__name__}, not class scores (batch, "
                        f"classes): gradcam explains a classifier's logits")
    return logits.float()


def _row(spec: str, target: int, names: tuple[str, ...] | None, logit: float, cam: torch.Tensor,
         file: Path) -> dict[str, Any]:
    """One line: the input, the class explained, its logit and where the map peaks (row, col)."""
    return {"input": spec, "class": target, "name": names[target] if names else None,
            "logit": logit, "peak_yx": peak_yx(cam), "png": str(file)}


PEAK_TOLERANCE = 1e-5  # of a map scaled to [0, 1]: far above float32 rounding, far below a real step


def peak_yx(cam: torch.Tensor) -> list[int]:
    """Where a map ``(height, width)`` peaks: ``[row, col]`` of the first pixel in row-major order
    within ``PEAK_TOLERANCE`` of its maximum.

    Bilinear upsampling makes plateaus: pixels past the last cell centre, or equally far from two
    centres, hold the same value in exact arithmetic. A plain ``argmax`` then picks among them by
    the rounding of the CPU's kernels (11x28 on one machine, 11x29 on another); the first pixel of
    the plateau is the same on every machine.
    """
    near = torch.nonzero(cam >= cam.max() - PEAK_TOLERANCE)
    return [int(near[0, 0]), int(near[0, 1])]
