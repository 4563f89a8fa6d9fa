"""``hookscope extract MODEL --data PATH --layer P --out DIR``: a data set's activations to a store.

Runs under torchrun unchanged: ``torchrun --nproc_per_node=2 -m hookscope extract ...``.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch

from hookscope._store_writer import prepare_output
from hookscope.cli.show import print_store
from hookscope.errors import SpecError
from hookscope.extract import extract, load_data
from hookscope.models import load_model

HELP = "run a model over a data set and store chosen layers' activations (resumable, torchrun)"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="model spec: efficientnet-lite0, minilm, pkg.mod:factory, file.py:fn")
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="a folder of images, a text file with one input a line, or a "
                             "tensor file (.pt/.npy/.safetensors) with rows along dim 0")
    parser.add_argument("--layer", required=True, action="append", metavar="PATTERN",
                        help="module path or pattern; repeat for several layers")
    parser.add_argument("--out", required=True, metavar="DIR", help="store folder to create")
    parser.add_argument("--reduce", choices=("none", "mean", "first", "last"), default="none",
                        help="keep whole rows (none: tokens without padding), or mean over "
                             "tokens/pixels, first (CLS) or last token")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), help="store floats in this dtype")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="default 32")
    parser.add_argument("--shard-bytes", type=_bytes, default=256 * 2**20, metavar="N",
                        help="bytes per shard file; K/M/G suffixes allowed (default 256M)")
    parser.add_argument("--device", default=None,
                        help="device to run on (default: cuda:LOCAL_RANK when CUDA is there, "
                             "else cpu)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing store")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--early-stop", action="store_true",
                        help="stop each forward once every selected layer has returned")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    if args.batch_size <= 0:
        raise SpecError(f"--batch-size {args.batch_size} must be positive")
    prepare_output(Path(args.out), resume=args.resume, overwrite=args.overwrite, check_only=True)
    loaded = load_model(args.model)
    data = load_data(args.data, loaded, batch_size=args.batch_size)
    model = loaded.module.to(args.device or _default_device())
    store = extract(model, data, args.layer, args.out,
                    reduce=None if args.reduce == "none" else args.reduce,
                    dtype=_DTYPES[args.dtype] if args.dtype else None, batch_size=args.batch_size,
                    shard_bytes=args.shard_bytes, resume=args.resume, overwrite=args.overwrite,
                    progress=not args.no_progress, model_spec=args.model,
                    early_stop=args.early_stop)
    if int(os.environ.get("RANK", "0")) == 0:
        print_store(store, as_json=args.json)
    return 0


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def _bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)i?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count such as 268435456 or 256M")
    return int(match[1]) << 10 * " kmg".index((match[2] or " ").lower())
