"""``hookscope extract MODEL --data PATH --layers P --out DIR``: a data set's activations to a store.

Runs under torchrun unchanged: ``torchrun --nproc_per_node=2 -m hookscope extract ...``; with
``--ray`` the batches go to Ray actors (``hookscope.store.ray_engine``).
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
from hookscope.errors import ArgumentValueError, ExtractInterrupted, SpecError, StoreFaultError
from hookscope.record import NAMES
from hookscope.store import SHARD_BYTES, SHARD_SECONDS, RayEngine, check_output, extract, location
from hookscope.zoo import load_data, load_model

__all__ = ["HELP", "add_arguments", "resume_command", "run"]

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
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="store folder to create, or a URL (s3://bucket/path, gs://...); "
                             "for S3 the endpoint and credentials come from the environment: "
                             "AWS_ENDPOINT_URL (e.g. http://127.0.0.1:9000 for MinIO or moto), "
                             "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (or AWS_PROFILE). The "
                             "bucket must exist: it is never created")
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
    parser.add_argument("--ray", action="store_true",
                        help="run the batches on Ray actors that write their own shards (pip "
                             "install 'hookscope[ray]'), one GPU each when --device is CUDA; "
                             "this process writes the manifest. Into a URL (s3://, not "
                             "memory://) each actor uploads its shards: fsspec's config here "
                             "(FSSPEC_S3_KEY, ...) travels to the actors, credentials from the "
                             "environment must be in theirs")
    parser.add_argument("--ray-address", metavar="ADDR", default=None,
                        help="with --ray: the Ray cluster to join (default: RAY_ADDRESS, else "
                             "a new local one)")
    parser.add_argument("--ray-actors", type=positive_int, default=None, metavar="N",
                        help="with --ray: actors, each holding a copy of the model (default 2)")


def run(args: argparse.Namespace) -> int:
    if not args.ray and (args.ray_actors or args.ray_address):
        raise ArgumentValueError("--ray-actors and --ray-address choose how --ray runs: add --ray, "
                                 "or leave them out to extract in this process")
    folder = location(args.out, SpecError)  # a URL's credentials: the environment's
    if isinstance(folder, Path):
        plain = folder == Path(args.out)  # not a file:// URL: the error names what was typed
        check_output_path(args.out if plain else folder, "--out", parents=args.parents,
                          folder=True)
    check_output(folder, resume=args.resume, overwrite=args.overwrite)
    loaded = load_model(args.model, **image_options(args))
    data = load_data(args.data, loaded, batch_size=args.batch_size)
    where = args.device or _default_device()
    model = loaded.module.to(where)
    try:
        store = extract(model, data, args.layers, args.out,
                        reduce=None if args.reduce == "none" else args.reduce,
                        dtype=_DTYPES[args.dtype] if args.dtype else None,
                        batch_size=args.batch_size, shard_bytes=args.shard_bytes,
                        shard_seconds=args.shard_seconds, resume=args.resume,
                        overwrite=args.overwrite, progress=not args.no_progress,
                        model_spec=args.model, early_stop=args.early_stop,
                        engine=_ray_engine(args, where) if args.ray else "local")
    except ExtractInterrupted as stopped:
        say(f"interrupted: {stopped.rows} rows kept in {stopped.out} (the open shard's "
            f"included); resume with:\n  {resume_command(args)}")
        return 130
    except StoreFaultError as err:  # the store failed mid-run: the command that goes on
        if "extract stopped:" not in str(err):
            raise
        raise StoreFaultError(f"{err}; resume with:\n  {resume_command(args)}") from err
    if int(os.environ.get("RANK", "0")) == 0:
        print_store(store, as_json=args.json)
    return 0


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run: its arguments, ``--resume`` instead of
    ``--overwrite`` (prefixed ``torchrun ... -m`` under torchrun)."""
    words = [args.model, "--data", args.data, "--layers", *args.layers, "--out", args.out]
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
                                    ("--early-stop", args.early_stop), ("--json", args.json),
                                    ("--ray", args.ray)) if on]
    words += ["--ray-actors", str(args.ray_actors)] if args.ray_actors else []
    words += ["--ray-address", args.ray_address] if args.ray_address else []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    runner = f"torchrun --nproc_per_node={world} -m hookscope" if world > 1 else "hookscope"
    return f"{runner} extract {shlex.join([*words, '--resume'])}"


def _ray_engine(args: argparse.Namespace, device: str) -> RayEngine:
    """``--ray``'s options; on CUDA each actor takes a GPU of its own (the model's copy on it)."""
    return RayEngine(actors=args.ray_actors or 2, address=args.ray_address,
                     num_gpus=1.0 if str(device).startswith("cuda") else 0.0)


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"

