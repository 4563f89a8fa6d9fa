"""``hookscope diff MODEL_A MODEL_B --input X``: compare two runs layer by layer."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from hookscope.cli._common import (
    add_layer_argument,
    add_parents_argument,
    add_positional,
    add_several,
    check_output_path,
    non_negative_float,
    print_json,
    print_table,
    say,
)
from hookscope.diagnostics import OUTPUT, Comparison, LayerDiff, compare, plot_errors
from hookscope.errors import SpecError
from hookscope.zoo import load_inputs, load_model

__all__ = ["HELP", "add_arguments", "run"]

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
    parser.add_argument("--atol", type=non_negative_float, default=None,
                        help="absolute tolerance (default 1e-5; with --pair by each pair's dtype)")
    parser.add_argument("--rtol", type=non_negative_float, default=None,
                        help="tolerance relative to MODEL_A's values (default 1e-4; with --pair "
                             "by each pair's dtype)")
    parser.add_argument("--json", action="store_true", help="print every row as JSON")
    parser.add_argument("--pair", action="append", metavar="auto|A=B",
                        help="pair modules of two implementations: 'auto' (call order, output "
                             "shape, kind) or name patterns 'h.{i}.attn=layers.{i}.attn' "
                             "(repeatable); prints the origin, not only the first difference")
    parser.add_argument("--plot", metavar="DIR", type=Path,
                        help="with --pair: write DIR/diff.png, accumulated and local error per pair")
    add_parents_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Load both models, compare them on the input, print one row per module call."""
    if args.plot is not None and not args.pair:
        raise SpecError("--plot draws the accumulated and local error of each pair, so it needs "
                        "--pair: add --pair auto (or --pair 'NAME_IN_A=NAME_IN_B' rules)")
    check_output_path(args.plot, "--plot", parents=args.parents, folder=True)
    model_a, model_b = load_model(args.model_a), load_model(args.model_b)
    if model_a.kind != model_b.kind:
        raise SpecError(f"'{args.model_a}' takes {model_a.kind} inputs but '{args.model_b}' takes "
                        f"{model_b.kind} inputs: diff runs both models on the same input, so "
                        f"compare two models of the same kind")
    inputs = load_inputs(args.input, model_a)
    pair = _pair(args.pair)
    result = compare(model_a.module, model_b.module, *inputs.args, layers=args.layers or "**",
                     atol=args.atol, rtol=args.rtol, pair=pair, **inputs.kwargs)
    if pair is not None:
        return _report_pairs(result, args)
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
    for diff in result.diffs:
        if diff.structure:  # compared on the parts both have; name the rest
            say(f"{_name(diff)}, call {diff.call_index}: the outputs differ in structure "
                f"({diff.structure}); the figures are of the parts both have")
    if first is None:
        say(f"all {len(rows)} compared calls within atol={result.atol:g}, rtol={result.rtol:g}")
        return 0
    if first.shape_b is not None:
        say(f"first divergent: {_name(first)}, call {first.call_index}: the outputs differ in "
            f"shape, {_shape(first.shape)} in {args.model_a} vs "
            f"{' '.join(map(_shape, first.shape_b))} in {args.model_b}; compare models whose "
            f"outputs have the same shapes, or pick layers that match with --layers")
        return 1
    say(f"first divergent: {_name(first)}, call {first.call_index} (max_abs {first.max_abs:.4g}, "
        f"rel {first.rel:.4g}, cosine {first.cosine:.6f}; atol={result.atol:g}, rtol={result.rtol:g})")
    return 1


def _pair(given: list[str] | None) -> str | dict[str, str] | None:
    if not given:
        return None
    if given == ["auto"]:
        return "auto"
    bad = [g for g in given if g.count("=") != 1]
    if bad:
        raise SpecError(f"--pair {bad[0]!r} is neither 'auto' nor 'NAME_IN_A=NAME_IN_B': give "
                        f"--pair auto, or one --pair per rule, e.g. --pair 'h.{{i}}.attn=layers.{{i}}.attn'")
    return dict(g.split("=") for g in given)


def _report_pairs(result: Comparison, args: argparse.Namespace) -> int:
    """One row per pair (accumulated and local error), the pairing, the first origin."""
    rows = [{"a": p.path_a, "b": p.path_b, "call": p.call, "max_abs": p.accumulated.max_abs,
             "rel": p.accumulated.rel, "cosine": p.accumulated.cosine,
             "local": None if p.local is None else p.local.max_abs,
             "verdict": "origin" if p.origin else "propagated" if p.propagated
             else "close" if p.accumulated.close else "differs"} for p in result.pairs]
    pairing = result.pairing
    assert pairing is not None  # noqa: S101 - compare gives one with pair=
    origin = result.first_origin
    if args.json:
        print_json({"rows": rows, "first_origin": origin.path_a if origin else None,
                    "unpaired_a": list(pairing.unpaired_a), "unpaired_b": list(pairing.unpaired_b),
                    "confidence": pairing.confidence})
    else:
        print_table(rows, ("a", "b", "call", "max_abs", "rel", "cosine", "local", "verdict"))
    say(f"paired {len(rows)} calls ({pairing.how}, confidence {pairing.confidence:.2f}); "
        f"unpaired in A: {_names(pairing.unpaired_a)}, in B: {_names(pairing.unpaired_b)}")
    if args.plot is not None:
        say(f"wrote {plot_errors(result, args.plot / 'diff.png')}")
    first = result.first_divergent
    if origin is not None:
        say(f"first origin: {origin.path_a} (B: {origin.path_b}), local max_abs "
            f"{origin.local.max_abs if origin.local else math.nan:.4g}; first difference: "
            f"{first.path if first else None}")
    elif first is not None:
        say(f"first difference: {first.path}, call {first.call_index} (max_abs "
            f"{first.max_abs:.4g}), and no pair is its origin: each differs only by what it "
            f"was given")
    else:
        say(f"all {len(rows)} paired calls close (each within its tolerance)")
    return 0 if first is None and origin is None else 1


_LISTED = 8  # unpaired names the text lists (--json lists all)


def _names(unpaired: Sequence[str]) -> str:
    """``"2 (h.0.mlp, h.1.mlp)"``: the count, then up to ``_LISTED`` names."""
    if not unpaired:
        return "0"
    rest = f", … {len(unpaired) - _LISTED} more (--json lists all)" if len(unpaired) > _LISTED else ""
    return f"{len(unpaired)} ({', '.join(unpaired[:_LISTED])}{rest})"


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ")"


def _name(diff: LayerDiff) -> str:
    return diff.path if diff.path != OUTPUT else "(output)"
