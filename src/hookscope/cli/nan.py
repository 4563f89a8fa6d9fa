"""``hookscope nan MODEL --input X``: the first module whose output (or gradient) is NaN/Inf."""

from __future__ import annotations

import argparse
import dataclasses

from hookscope.cli._common import add_model_arguments, image_options, print_json, say
from hookscope.diagnostics import INPUT, find_nonfinite
from hookscope.zoo import load_inputs, load_model

__all__ = ["HELP", "add_arguments", "run"]

HELP = ("find the first module whose output (or, with --backward, gradient) holds NaN or Inf "
        "from finite inputs; exit 1 when there is one")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the verb's options to ``parser``."""
    add_model_arguments(parser)
    parser.add_argument("--backward", action="store_true",
                        help="when the forward is finite, also check the gradients of the sum of "
                             "the outputs")
    parser.add_argument("--json", action="store_true", help="print the finding as JSON")


def run(args: argparse.Namespace) -> int:
    """Load the model and input, run ``find_nonfinite``, print what it found."""
    loaded = load_model(args.model, **image_options(args))
    inputs = load_inputs(args.input, loaded)
    found = find_nonfinite(loaded.module, *inputs.args, backward=args.backward, **inputs.kwargs)
    if args.json:
        print_json(dataclasses.asdict(found) if found is not None else None)
    elif found is None:
        checked = "output and gradient" if args.backward else "output"
        print(f"no NaN or Inf: every module {checked} is finite on {', '.join(args.input)}")
    else:
        print(found)
    if found is not None:
        where = (f"the input {found.bad_label}" if found.path == INPUT
                 else f"'{found.path}' ({found.class_name})")
        say(f"{args.model}: non-finite values start in {where}")
        return 1
    return 0
