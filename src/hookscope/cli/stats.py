"""``hookscope stats MODEL --input X... | --data PATH``: streaming statistics of each module's
output over the inputs given (a folder counts as its images) or a whole data set."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
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
from hookscope.diagnostics import RunningStats, stats
from hookscope.errors import SpecError
from hookscope.zoo import Inputs, LoadedModel, expand_folder, load_data, load_inputs, load_model

__all__ = ["HELP", "add_arguments", "run"]

HELP = ("count, mean, std, min, max, fraction of zeros and of NaN/Inf of each module's output, "
        "streamed over the inputs without keeping activations")
COLUMNS = ("path", "count", "mean", "std", "min", "max", "frac_zeros", "frac_nonfinite")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the verb's options to ``parser``."""
    add_model_arguments(parser, input_required=False)
    parser.add_argument("--data", metavar="PATH",
                        help="instead of --input: a data set streamed in batches of --batch-size "
                             "(default 32), as extract reads it: a folder of images, a text file "
                             "with one input a line, or a tensor file with rows along dim 0")
    add_layer_argument(parser, required=False,
                       help="modules to watch (one or more; default every module)")
    parser.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                        help="inputs per forward pass (default: all --input in one batch; 32 "
                             "with --data)")
    parser.add_argument("--per-channel", nargs="?", const="auto", default=None, metavar="DIM",
                        type=dimension,
                        help="one row per channel: dimension 1 of feature maps, the last of "
                             "(batch, seq, d_model) tokens, or the DIM given")
    parser.add_argument("--early-stop", action="store_true",
                        help="stop each forward once every selected layer has returned")
    parser.add_argument("--hist", type=positive_int, default=None, metavar="BINS",
                        help="also a histogram of BINS equal-width bins of each output (equal to "
                             "torch.histc); edges from a first pass over the inputs, or --hist-range")
    parser.add_argument("--hist-range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                        help="the histograms' outer edges (values outside are counted as below/above)")
    parser.add_argument("--json", action="store_true", help="print the statistics as JSON")


def run(args: argparse.Namespace) -> int:
    """Load the model, stream the input batches through it, print one row per module."""
    if (args.input is None) == (args.data is None):
        raise SpecError("stats reads either --input X... or --data PATH: give exactly one of "
                        "them (--data streams a whole folder or file in batches of --batch-size)")
    loaded = load_model(args.model, **image_options(args))
    batches, described = (_data_batches(args, loaded) if args.data is not None
                          else _input_batches(args, loaded))
    per_channel: bool | int = (False if args.per_channel is None
                               else True if args.per_channel == "auto" else args.per_channel)
    if args.hist_range is not None and args.hist is None:
        raise SpecError("--hist-range needs --hist BINS: pass the number of bins too")
    if args.hist is not None and args.hist_range is None:
        batches = list(batches) if args.data is None else batches  # read twice: edges, then counts
    result = stats(loaded.module, batches, layers=args.layers or "**", per_channel=per_channel,
                   early_stop=args.early_stop, hist=args.hist,
                   hist_range=tuple(args.hist_range) if args.hist_range else None)
    say(described)
    if args.json:
        # keyed by the name asked; a standard name's entry gives its module path too
        print_json({name: {**_as_dict(running), **({"path": result.paths[name]}
                                                     if result.paths[name] != name else {})}
                    for name, running in result.items()})
        return 0
    # the name asked first; a column of paths beside it when one differs (a standard name)
    first = ("name", "path") if any(n != p for n, p in result.paths.items()) else ("path",)
    print_table([{"name": name, **row} for name, running in result.items()
                 for row in _rows(result.paths[name], running)],
                (*first, *COLUMNS[1:]) if per_channel is False else (*first, "channel", *COLUMNS[1:]))
    if args.hist is not None:
        print_table([{"name": name, "path": result.paths[name], "lo": h.lo, "hi": h.hi,
                      "below": h.below, "above": h.above, "histogram": h.sparkline()}
                     for name, running in result.items() if (h := running.histogram) is not None],
                    (*first, "lo", "hi", "below", "above", "histogram"))
    return 0


def _as_dict(running: RunningStats) -> dict[str, Any]:
    """``running.as_dict()``, with its histogram's numbers under ``"histogram"`` when it has one."""
    values = running.as_dict()
    if running.histogram is not None:
        values["histogram"] = running.histogram.as_dict()
    return values


def _input_batches(args: argparse.Namespace, loaded: LoadedModel) -> tuple[Iterable[Any], str]:
    """The ``--input`` specs (a folder as its sorted images) in chunks of ``--batch-size``."""
    specs = [name for spec in args.input for name in expand_folder(spec)]
    size = args.batch_size or len(specs)
    chunks = [specs[i:i + size] for i in range(0, len(specs), size)]
    return ((_batch(load_inputs(chunk, loaded)) for chunk in chunks),
            f"{len(chunks)} batch{'es' if len(chunks) != 1 else ''} of up to {size} input(s)")


def _data_batches(args: argparse.Namespace, loaded: LoadedModel) -> tuple[Iterable[Any], str]:
    """``--data PATH`` as ``extract`` reads it (``zoo.data.load_data``), streamed."""
    size = args.batch_size or 32
    data = load_data(args.data, loaded, batch_size=size)
    rows = len(data.dataset)  # type: ignore[arg-type]
    return data, f"{rows} input(s) from {args.data} in {len(data)} batch(es) of up to {size}"


def _batch(inputs: Inputs) -> tuple[Any, ...] | dict[str, Any]:
    """One batch for ``stats``: the keyword tensors of text inputs, else the positional ones."""
    return inputs.kwargs if inputs.kwargs else inputs.args


def _rows(path: str, running: RunningStats) -> list[dict[str, Any]]:
    values = running.as_dict()
    if running.channel_dim is None or running.count.dim() == 0:
        return [{"path": path, **values}]
    return [{"path": path, "channel": c, **{k: v[c] for k, v in values.items()}}
            for c in range(len(values["count"]))]
