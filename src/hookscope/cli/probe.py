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
                help="layers of the store to probe (default every fixed-shape layer, with "
                     "--tokens every ragged one)")
    parser.add_argument("--tokens", action="store_true",
                        help="probe each token of ragged (per-token) layers, through the store's "
                             "token view")
    parser.add_argument("--labels", metavar="FILE", default=None,
                        help="a tensor file (.pt, .npy, .safetensors; FILE:KEY) of one label per "
                             "row, per token with --tokens (default: the store's labels)")
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
    labels = None
    if args.labels is not None:
        from hookscope.zoo import read_tensor_file  # zoo: heavy imports, on demand
        labels = read_tensor_file(args.labels)
    result = probe(args.store, args.layers, labels=labels, test_fraction=args.test_fraction,
                   C=args.C, chunk=args.chunk, seed=args.seed, tokens=args.tokens)
    print_table([{"layer": p.layer, "accuracy": p.accuracy, "control": p.control_accuracy,
                  "selectivity": p.selectivity, "train": p.train_accuracy, "chance": p.chance,
                  "features": p.features} for p in result.layers],
                ("layer", "accuracy", "control", "selectivity", "train", "chance", "features"))
    if args.plot is not None:
        result.plot(args.plot)
    return 0
