"""Output helpers shared by the verbs: aligned tables on stdout, JSON, progress on stderr."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookscope.errors import SpecError
from hookscope.zoo import LoadedModel, load_model

__all__ = ["add_image_arguments", "add_layer_argument", "add_model_arguments",
           "add_parents_argument", "add_positional", "add_several", "byte_count", "check_output_path",
           "device", "dimension", "image_options", "image_size", "load_model_timed", "non_negative_float",
           "non_negative_int", "positive_float", "positive_int", "print_json", "print_table",
           "refuse_repeats", "say"]

MODEL_HELP = ("efficientnet-lite0, minilm, pkg.module:factory, file.py:factory, hf:DIR, timm:NAME; "
              "suffixes @bf16/@fp16/@fp32, @weights.safetensors")
INPUT_HELP = ("input, repeatable or several after one flag (images and sentences are batched): "
              "image file, sample:NAME, text, .pt/.npy/.safetensors (FILE:KEY), randn:1,3,224,224")


def add_model_arguments(parser: argparse.ArgumentParser, *, input_required: bool = True) -> None:
    """Add the positional ``MODEL``, ``--input X [X ...]`` and the image options that the verbs
    share."""
    add_positional(parser, "model", "MODEL", MODEL_HELP)
    add_several(parser, "--input", required=input_required, metavar="X", help=INPUT_HELP)
    add_image_arguments(parser)


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--image-size``, ``--mean``, ``--std``: how images become the model's input."""
    parser.add_argument("--image-size", type=image_size, metavar="N",
                        help="the model takes images resized to N x N (or HxW) pixels; needed "
                             "to give images to your own model (pkg.mod:factory, file.py:fn)")
    parser.add_argument("--mean", type=_rgb("mean"), metavar="R,G,B",
                        help="per-channel mean of pixels in [0, 1] (default: the model's own, "
                             "else ImageNet's 0.485,0.456,0.406)")
    parser.add_argument("--std", type=_rgb("std"), metavar="R,G,B",
                        help="per-channel std (default: the model's own, else ImageNet's "
                             "0.229,0.224,0.225)")


def image_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``load_model`` keywords of the image options given on the command line."""
    return {name: getattr(args, name, None) for name in ("image_size", "mean", "std")}


def image_size(text: str) -> tuple[int, int]:
    """Parse ``32`` or ``32x48`` (height x width) into ``(height, width)``."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", text)
    if match is None or int(match[1]) <= 0 or int(match[2] or match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an image size; give a side in "
                                         f"pixels, e.g. 32, or HEIGHTxWIDTH, e.g. 32x48")
    return int(match[1]), int(match[2] or match[1])


def _rgb(name: str) -> Callable[[str], tuple[float, ...]]:
    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != 3 or not all(math.isfinite(v) for v in values) or (
                name == "std" and min(values) <= 0):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not three numbers R,G,B{' > 0' if name == 'std' else ''}; give "
                f"e.g. {'0.229,0.224,0.225' if name == 'std' else '0.485,0.456,0.406'}")
        return values
    parse.__name__ = f"--{name}"
    return parse


def add_positional(parser: argparse.ArgumentParser, dest: str, metavar: str, help: str) -> None:
    """Add a required positional that may also come last, after an option taking several values
    (``--input a b MODEL``): the command hands such trailing values back (``cli.main``)."""
    parser.add_argument(dest, metavar=metavar, nargs="?", help=help)
    positionals = parser.get_default("positionals") or ()
    parser.set_defaults(positionals=(*positionals, (dest, metavar)))


def add_several(parser: argparse.ArgumentParser, flag: str, **options: Any) -> None:
    """Add ``flag`` taking one or more values, repeatable (``--layers A B --layers C``)."""
    parser.add_argument(flag, action="extend", nargs="+", **options)
    several = parser.get_default("several") or ()
    parser.set_defaults(several=(*several, flag))


def add_layer_argument(parser: argparse.ArgumentParser, *, required: bool, help: str) -> None:
    """Add ``--layers PATTERN [PATTERN ...]`` (repeatable)."""
    add_several(parser, "--layers", required=required, metavar="PATTERN", help=help)


class _StoreOnce(argparse._StoreAction):
    """A single-value flag given twice is a usage error, not "the last one wins" silently
    (``gradcam --layers 0 --layers 1`` once drew layer 1 only)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen: set[str] = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in seen:
            parser.error(f"{option_string} was given twice; it takes one value (give it once)")
        seen.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def refuse_repeats(parser: argparse.ArgumentParser) -> None:
    """Make every single-value option of ``parser`` (``--out DIR``, ``--layers PATH`` where one
    is taken) refuse a repetition; options of several values (``add_several``) still extend."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = _StoreOnce


# ------------------------------------------------------------------------ numbers, parse time
def _number(kind: Callable[[str], Any], test: Callable[[Any], bool], what: str,
            example: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not test(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; give e.g. {example}")
        return value
    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive whole number", "32")
non_negative_int = _number(int, lambda v: v >= 0, "a whole number >= 0", "2")
dimension = _number(lambda t: t if t == "auto" else int(t), lambda v: True,
                    "'auto' or a dimension", "1 or -1")
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a positive number", "60")
non_negative_float = _number(float, lambda v: math.isfinite(v) and v >= 0,
                             "a finite number >= 0", "1e-5")


def byte_count(text: str) -> int:
    """Parse ``268435456``, ``256M``, ``64KiB``, ``1G`` into a positive number of bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)i?[bB]?\s*", text)
    value = int(match[1]) << 10 * " kmg".index((match[2] or " ").lower()) if match else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive byte count; give e.g. "
                                         f"268435456 or 256M")
    return value


def device(text: str) -> str:
    """``--device``: a device torch knows and this machine has; a usage error (exit 2) otherwise,
    at parse time: ``nonsense`` (torch cannot parse it), ``cuda:7`` on a machine with fewer CUDA
    devices or a CPU build, ``mps`` where MPS is missing."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda, cuda:N or "
                                         f"mps") from None
    if parsed.type == "cuda" and (not torch.cuda.is_available() or
                                  (parsed.index or 0) >= torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has "
                                         f"{torch.cuda.device_count()} CUDA device(s); use cpu, "
                                         f"or cuda:N below that count")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: MPS is not available here; use cpu")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text!r}: hookscope runs models on cpu, cuda or mps")
    return text


def add_parents_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--parents``: create the missing folders above an output path (refused otherwise)."""
    parser.add_argument("--parents", action="store_true",
                        help="create missing parent folders of the output path (like mkdir -p); "
                             "without it a missing parent folder is an error")


def check_output_path(path: str | os.PathLike[str] | None, flag: str, *, parents: bool,
                 folder: bool = False) -> None:
    """Refuse an output path whose parent folder is missing (unless ``parents``), is a file, or
    cannot be written, before anything is loaded: a typo in a path does not silently make a
    folder chain, and a run does not fail after its work because it cannot write. ``folder``:
    ``path`` is a folder the verb writes into (it may exist; then it must be writable).

    Raises:
        SpecError: naming ``flag``, the path, the folder at fault and the fix.
    """
    if path is None:
        return
    target = os.path.abspath(os.fspath(path))
    parent = target if folder and os.path.isdir(target) else os.path.dirname(target)
    existing = parent
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise SpecError(f"cannot use {path} ({flag}): a part of the path is a file, not a "
                        f"folder ('{existing}'): choose another path")
    if existing != parent and not parents:
        raise SpecError(f"{flag} {path}: the folder '{parent}' does not exist; create it first, "
                        f"or pass --parents to have hookscope create it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecError(f"{flag} {path}: the folder '{existing}' is not writable; choose a "
                        f"folder you may write to, or change its permissions")


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print ``rows`` as a left-aligned table with a header, one row a line, on stdout."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON with stable key order on stdout."""
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def load_model_timed(spec: str, **options: Any) -> LoadedModel:
    """``load_model(spec, **options)``, saying on stderr what is loading and how long it took."""
    started = time.perf_counter()
    say(f"loading {spec} ...")
    loaded = load_model(spec, **options)
    say(f"loaded {spec} in {time.perf_counter() - started:.1f} s")
    return loaded


def say(message: str) -> None:
    """Print a progress or status line on stderr (stdout carries data only)."""
    print(message, file=sys.stderr, flush=True)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (tuple, list)):
        return "x".join(str(v) for v in value) if all(isinstance(v, int) for v in value) else str(value)
    return str(value)
