"""``hookscope tree MODEL``: every module's path, class and parameters; with --input, also how
often each ran and what it returned. Containers and modules that never ran are marked."""

from __future__ import annotations

import argparse

from hookscope.cli._common import (
    add_model_arguments,
    image_options,
    load_model_timed,
    non_negative_int,
    print_json,
    say,
)
from hookscope.diagnostics import filter_rows, format_tree, tree, tree_of_call
from hookscope.errors import SpecError
from hookscope.zoo import load_inputs

__all__ = ["HELP", "add_arguments", "run"]

HELP = "list every module: path, class, parameters; with --input, calls and output shapes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tree`` options to ``parser``."""
    add_model_arguments(parser, input_required=False)
    parser.add_argument("--filter", metavar="PATTERN",
                        help="show only modules this pattern selects ('_blocks.*', '**.bn1', "
                             "'type:Conv2d', 're:...')")
    parser.add_argument("--depth", type=non_negative_int, metavar="N",
                        help="show modules down to depth N (0 is the model itself)")
    parser.add_argument("--ops", action="store_true",
                        help="with --input, list each module's own function calls (F.relu, "
                             "softmax, scaled_dot_product_attention, ...) as 'path::name' "
                             "addresses with their output shapes")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the module tree of ``args.model``; exit code 0."""
    loaded = load_model_timed(args.model, **image_options(args))
    if args.input:
        inputs = load_inputs(args.input, loaded)
        for line in inputs.descriptions:
            say(f"input {line}")
        rows = tree_of_call(loaded.module, lambda: inputs.call(loaded.module), ops=args.ops)
    else:
        if args.ops:
            raise SpecError("--ops lists the calls made in an example forward pass: give one "
                            "with --input (e.g. --input sample:chelsea, or a sentence)")
        rows = tree(loaded.module)
    rows = filter_rows(rows, loaded.module, args.filter, args.depth)
    if args.json:
        print_json([row.as_dict() for row in rows])
    else:
        print(format_tree(rows), end="")
    return 0
