"""``hookscope probe STORE``: a logistic probe per layer of a store, held-out accuracy and the
control task's (``hookscope.store.probes``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hookscope.cli._common import add_several, positive_int, print_table
from hookscope.errors import SpecError
from hookscope.store import probe

_TENSOR_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")

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
                        help="a tensor file (.pt, .npy, .safetensors; FILE:KEY) or a text file "
                             "(one label a line) of one label per row, per token with --tokens "
                             "(default: the store's labels)")
    parser.add_argument("--test-fraction", type=float, default=0.2, metavar="F",
                        help="share of rows held out (default 0.2)")
    parser.add_argument("--C", type=float, default=1.0, dest="C",
                        help="inverse L2 strength, as scikit-learn's LogisticRegression (default 1)")
    parser.add_argument("--chunk", type=positive_int, default=4096, metavar="ROWS",
                        help="rows read at once: the memory bound (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="split and control-task seed")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="also draw accuracy per layer to this PNG")


def _labels(spec: str) -> Any:
    """The labels in ``spec``: a tensor file (``read_tensor_file``), or a text file of one
    label a line (ints when every line is one, else strs).

    Raises:
        SpecError: the file is missing, unreadable, or holds no label.
    """
    from hookscope.zoo import read_tensor_file  # zoo: heavy imports, on demand
    name = spec.split(":", 1)[0] if ":" in spec and not Path(spec).exists() else spec
    if Path(name).suffix.lower() in _TENSOR_SUFFIXES or not Path(name).is_file():
        return read_tensor_file(spec)
    try:
        lines = Path(name).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"--labels {name}: not a tensor file (.pt, .npy, .safetensors) nor a "
                        f"UTF-8 text file of one label a line ({type(err).__name__})") from None
    labels = [line.strip() for line in lines if line.strip()]
    if not labels:
        raise SpecError(f"--labels {name} holds no label: write one label a line, one per row")
    return [int(v) for v in labels] if all(_is_int(v) for v in labels) else labels


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    """Probe each layer, print one row per layer."""
    labels = None if args.labels is None else _labels(args.labels)
    result = probe(args.store, args.layers, labels=labels, test_fraction=args.test_fraction,
                   C=args.C, chunk=args.chunk, seed=args.seed, tokens=args.tokens)
    print_table([{"layer": p.layer, "accuracy": p.accuracy, "control": p.control_accuracy,
                  "selectivity": p.selectivity, "train": p.train_accuracy, "chance": p.chance,
                  "features": p.features} for p in result.layers],
                ("layer", "accuracy", "control", "selectivity", "train", "chance", "features"))
    if args.plot is not None:
        result.plot(args.plot)
    return 0
