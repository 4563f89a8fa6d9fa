"""``hookscope extract MODEL --data PATH --layer P --out DIR``: a data set's activations to a store.

Runs under torchrun unchanged: ``torchrun --nproc_per_node=2 -m hookscope extract ...``.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import torch

from hookscope.cli._common import (
    add_image_arguments,
    add_layer_argument,
    add_parents_argument,
    add_positional,
    byte_count,
    check_output_path,
    device,
    image_options,
    positive_float,
    positive_int,
    say,
)
from hookscope.cli.show import print_store
from hookscope.errors import ExtractInterrupted
from hookscope.record.reductions import NAMES
from hookscope.store.extract import SHARD_BYTES, SHARD_SECONDS, check_output, extract
from hookscope.zoo.data import load_data
from hookscope.zoo.models import load_model

HELP = "run a model over a data set and store chosen layers' activations (resumable, torchrun)"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_positional(parser, "model", "MODEL",
                   "model spec: efficientnet-lite0, minilm, pkg.mod:factory, file.py:fn")
    add_image_arguments(parser)
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="a folder of images, a text file with one input a line, or a "
                             "tensor file (.pt/.npy/.safetensors; FILE:KEY for one tensor of "
                             "several) with rows along dim 0")
    add_layer_argument(parser, required=True,
                       help="module paths or patterns, one or more; each becomes a store layer")
    parser.add_argument("--out", required=True, metavar="DIR", help="store folder to create")
    parser.add_argument("--reduce", choices=("none", *NAMES), default="none",
                        help="none: whole rows (tokens without padding); mean: over dim 1 of "
                             "(batch, seq, d) tokens, over dims 2.. (pixels) of (batch, c, h, w) "
                             "maps, (batch, d) kept; first/last: first (CLS) / last real token, "
                             "dim 1 of (batch, seq, d) only (refused without a token axis)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), help="store floats in this dtype")
    parser.add_argument("--batch-size", type=positive_int, default=32, metavar="N",
                        help="default 32")
    parser.add_argument("--shard-bytes", type=byte_count, default=SHARD_BYTES, metavar="N",
                        help="bytes per shard file at most; K/M/G suffixes allowed (default 256M)")
    parser.add_argument("--shard-seconds", type=positive_float, default=SHARD_SECONDS,
                        metavar="S", help="close a shard after S seconds at most, so a killed "
                                          f"run loses at most about S seconds (default "
                                          f"{SHARD_SECONDS:g})")
    parser.add_argument("--device", default=None, type=device,
                        help="device to run on (default: cuda:LOCAL_RANK when CUDA is there, "
                             "else cpu)")
    again = parser.add_mutually_exclusive_group()  # --resume keeps the store, --overwrite deletes it
    again.add_argument("--resume", action="store_true", help="continue an interrupted run")
    again.add_argument("--overwrite", action="store_true", help="replace an existing store")
    add_parents_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--early-stop", action="store_true",
                        help="stop each forward once every selected layer has returned")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    check_output_path(args.out, "--out", parents=args.parents, folder=True)
    check_output(Path(args.out), resume=args.resume, overwrite=args.overwrite)
    loaded = load_model(args.model, **image_options(args))
    data = load_data(args.data, loaded, batch_size=args.batch_size)
    model = loaded.module.to(args.device or _default_device())
    try:
        store = extract(model, data, args.layer, args.out,
                        reduce=None if args.reduce == "none" else args.reduce,
                        dtype=_DTYPES[args.dtype] if args.dtype else None,
                        batch_size=args.batch_size, shard_bytes=args.shard_bytes,
                        shard_seconds=args.shard_seconds, resume=args.resume,
                        overwrite=args.overwrite, progress=not args.no_progress,
                        model_spec=args.model, early_stop=args.early_stop)
    except ExtractInterrupted as stopped:
        say(f"interrupted: {stopped.rows} rows kept in {stopped.out} (the open shard's "
            f"included); resume with:\n  {resume_command(args)}")
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        print_store(store, as_json=args.json)
    return 0


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run: its arguments, ``--resume`` instead of
    ``--overwrite`` (prefixed ``torchrun ... -m`` under torchrun)."""
    words = [args.model, "--data", args.data, "--layer", *args.layer, "--out", args.out]
    if args.image_size:
        words += ["--image-size", "x".join(str(n) for n in args.image_size)]
    for flag, value in (("--mean", args.mean), ("--std", args.std)):
        if value:
            words += [flag, ",".join(str(v) for v in value)]
    words += ["--reduce", args.reduce, "--batch-size", str(args.batch_size),
              "--shard-bytes", str(args.shard_bytes), "--shard-seconds", f"{args.shard_seconds:g}"]
    words += ["--dtype", args.dtype] if args.dtype else []
    words += ["--device", args.device] if args.device else []
    words += [flag for flag, on in (("--no-progress", args.no_progress),
                                    ("--early-stop", args.early_stop), ("--json", args.json)) if on]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    runner = f"torchrun --nproc_per_node={world} -m hookscope" if world > 1 else "hookscope"
    return f"{runner} extract {shlex.join([*words, '--resume'])}"


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"

