"""``hookscope stats MODEL --input X...``: streaming statistics of each module's output."""

from __future__ import annotations

import argparse
from typing import Any

from hookscope.cli._common import (
    add_layer_argument,
    add_model_arguments,
    dimension,
    image_options,
    positive_int,
    print_json,
    print_table,
    say,
)
from hookscope.diagnostics.stats import RunningStats, stats
from hookscope.zoo.inputs import Inputs, load_inputs
from hookscope.zoo.models import load_model

HELP = ("count, mean, std, min, max, fraction of zeros and of NaN/Inf of each module's output, "
        "streamed over the inputs without keeping activations")
COLUMNS = ("path", "count", "mean", "std", "min", "max", "frac_zeros", "frac_nonfinite")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the verb's options to ``parser``."""
    add_model_arguments(parser)
    add_layer_argument(parser, required=False,
                       help="modules to watch (one or more; default every module)")
    parser.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                        help="inputs per forward pass (default: all inputs in one batch)")
    parser.add_argument("--per-channel", nargs="?", const="auto", default=None, metavar="DIM",
                        type=dimension,
                        help="one row per channel: dimension 1 of feature maps, the last of "
                             "(batch, seq, d_model) tokens, or the DIM given")
    parser.add_argument("--early-stop", action="store_true",
                        help="stop each forward once every selected layer has returned")
    parser.add_argument("--json", action="store_true", help="print the statistics as JSON")


def run(args: argparse.Namespace) -> int:
    """Load the model, stream the input batches through it, print one row per module."""
    loaded = load_model(args.model, **image_options(args))
    size = args.batch_size or len(args.input)
    chunks = [args.input[i:i + size] for i in range(0, len(args.input), size)]
    batches = (_batch(load_inputs(chunk, loaded)) for chunk in chunks)
    per_channel: bool | int = (False if args.per_channel is None
                               else True if args.per_channel == "auto" else args.per_channel)
    result = stats(loaded.module, batches, layers=args.layer or "**", per_channel=per_channel,
                   early_stop=args.early_stop)
    say(f"{len(chunks)} batch{'es' if len(chunks) != 1 else ''} of up to {size} input(s)")
    if args.json:
        print_json({path: running.as_dict() for path, running in result.items()})
    else:
        print_table([row for path, running in result.items() for row in _rows(path, running)],
                    COLUMNS if per_channel is False else ("path", "channel", *COLUMNS[1:]))
    return 0


def _batch(inputs: Inputs) -> tuple[Any, ...] | dict[str, Any]:
    """One batch for ``stats``: the keyword tensors of text inputs, else the positional ones."""
    return inputs.kwargs if inputs.kwargs else inputs.args


def _rows(path: str, running: RunningStats) -> list[dict[str, Any]]:
    values = running.as_dict()
    if running.channel_dim is None or running.count.dim() == 0:
        return [{"path": path, **values}]
    return [{"path": path, "channel": c, **{k: v[c] for k, v in values.items()}}
            for c in range(len(values["count"]))]
