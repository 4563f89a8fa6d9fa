"""``hookscope diff MODEL_A MODEL_B --input X``: compare two runs layer by layer."""

from __future__ import annotations

import argparse
import dataclasses

from hookscope.cli._common import (
    add_layer_argument,
    add_positional,
    add_several,
    non_negative_float,
    print_json,
    print_table,
    say,
)
from hookscope.diagnostics.compare import OUTPUT, LayerDiff, compare
from hookscope.errors import SpecError
from hookscope.zoo.inputs import load_inputs
from hookscope.zoo.models import load_model

HELP = ("compare two models (or one model in two dtypes: MODEL and MODEL@bf16) layer by layer "
        "on the same input; exit 1 when a layer differs beyond the tolerance")
COLUMNS = ("path", "call", "shape", "max_abs", "rel", "cosine", "close")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the verb's options to ``parser``."""
    add_positional(parser, "model_a", "MODEL_A", "reference model spec")
    add_positional(parser, "model_b", "MODEL_B",
                   "model spec to compare, e.g. the same with @bf16 or @weights.safetensors")
    add_several(parser, "--input", required=True, metavar="X",
                help="input spec (repeatable), prepared for MODEL_A and cast for MODEL_B")
    add_layer_argument(parser, required=False,
                       help="modules to compare (one or more; default every module)")
    parser.add_argument("--atol", type=non_negative_float, default=1e-5,
                        help="absolute tolerance (default 1e-5)")
    parser.add_argument("--rtol", type=non_negative_float, default=1e-4,
                        help="tolerance relative to MODEL_A's values (default 1e-4)")
    parser.add_argument("--json", action="store_true", help="print every row as JSON")


def run(args: argparse.Namespace) -> int:
    """Load both models, compare them on the input, print one row per module call."""
    model_a, model_b = load_model(args.model_a), load_model(args.model_b)
    if model_a.kind != model_b.kind:
        raise SpecError(f"'{args.model_a}' takes {model_a.kind} inputs but '{args.model_b}' takes "
                        f"{model_b.kind} inputs: diff runs both models on the same input, so "
                        f"compare two models of the same kind")
    inputs = load_inputs(args.input, model_a)
    result = compare(model_a.module, model_b.module, *inputs.args, layers=args.layer or "**",
                     atol=args.atol, rtol=args.rtol, **inputs.kwargs)
    rows = [{**dataclasses.asdict(d), "path": _name(d)} for d in result.diffs]
    for row in rows:
        if row["shape_b"] is not None:  # no numbers to compare: say which shapes differ
            row.update(max_abs=None, rel=None, cosine=None,
                       shape=f"{_shape(row['shape'])} vs {' '.join(map(_shape, row['shape_b']))}")
    first = result.first_divergent
    if args.json:
        print_json({"first_divergent": _name(first) if first else None, "rows": rows,
                    "unmatched": list(result.unmatched)})
    else:
        print_table([{**row, "call": row["call_index"],
                      "cosine": None if row["cosine"] is None else f"{row['cosine']:.6f}"}
                     for row in rows], COLUMNS)
    if result.unmatched:
        say(f"ran in one model only: {', '.join(result.unmatched)}")
    if first is None:
        say(f"all {len(rows)} compared calls within atol={args.atol:g}, rtol={args.rtol:g}")
        return 0
    if first.shape_b is not None:
        say(f"first divergent: {_name(first)}, call {first.call_index}: the outputs differ in "
            f"shape, {_shape(first.shape)} in {args.model_a} vs "
            f"{' '.join(map(_shape, first.shape_b))} in {args.model_b}; compare models whose "
            f"outputs have the same shapes, or pick layers that match with --layer")
        return 1
    say(f"first divergent: {_name(first)}, call {first.call_index} (max_abs {first.max_abs:.4g}, "
        f"rel {first.rel:.4g}, cosine {first.cosine:.6f}; atol={args.atol:g}, rtol={args.rtol:g})")
    return 1


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ")"


def _name(diff: LayerDiff) -> str:
    return diff.path if diff.path != OUTPUT else "(output)"
