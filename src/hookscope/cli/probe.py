"""``hookscope probe STORE``: a logistic probe per layer of a store, held-out accuracy and the
control task's (``hookscope.store.probes``)."""

from __future__ import annotations

import argparse

from hookscope.cli._common import add_several, positive_int, print_table
from hookscope.store import probe

__all__ = ["HELP", "add_arguments", "run"]

HELP = ("fit a logistic probe per layer of a store on its labels: held-out accuracy, control "
        "task accuracy and selectivity (Hewitt and Liang 2019)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the verb's options to ``parser``."""
    parser.add_argument("store", help="the folder or URL hookscope extract wrote (with labels)")
    add_several(parser, "--layers", metavar="LAYER",
                help="layers of the store to probe (default every fixed-shape layer)")
    parser.add_argument("--test-fraction", type=float, default=0.2, metavar="F",
                        help="share of rows held out (default 0.2)")
    parser.add_argument("--C", type=float, default=1.0, dest="C",
                        help="inverse L2 strength, as scikit-learn's LogisticRegression (default 1)")
    parser.add_argument("--chunk", type=positive_int, default=4096, metavar="ROWS",
                        help="rows read at once: the memory bound (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="split and control-task seed")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="also draw accuracy per layer to this PNG")


def run(args: argparse.Namespace) -> int:
    """Probe each layer, print one row per layer."""
    result = probe(args.store, args.layers, test_fraction=args.test_fraction, C=args.C,
                   chunk=args.chunk, seed=args.seed)
    print_table([{"layer": p.layer, "accuracy": p.accuracy, "control": p.control_accuracy,
                  "selectivity": p.selectivity, "train": p.train_accuracy, "chance": p.chance,
                  "features": p.features} for p in result.layers],
                ("layer", "accuracy", "control", "selectivity", "train", "chance", "features"))
    if args.plot is not None:
        result.plot(args.plot)
    return 0
