"""Output helpers shared by the verbs: aligned tables on stdout, JSON, progress on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

MODEL_HELP = ("efficientnet-lite0, minilm, pkg.module:factory, file.py:factory, hf:DIR, timm:NAME; "
              "suffixes @bf16/@fp16/@fp32, @weights.safetensors")
INPUT_HELP = ("input, repeatable or several after one flag (images and sentences are batched): "
              "image file, sample:NAME, text, .pt/.npy/.safetensors (FILE:KEY), randn:1,3,224,224")


def add_model_arguments(parser: argparse.ArgumentParser, *, input_required: bool = True) -> None:
    """Add the positional ``MODEL`` and ``--input X [X ...]`` that the verbs share."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--input", action="extend", nargs="+", required=input_required,
                        metavar="X", help=INPUT_HELP)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print ``rows`` as a left-aligned table with a header, one row a line, on stdout."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON with stable key order on stdout."""
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def say(message: str) -> None:
    """Print a progress or status line on stderr (stdout carries data only)."""
    print(message, file=sys.stderr, flush=True)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (tuple, list)):
        return "x".join(str(v) for v in value) if all(isinstance(v, int) for v in value) else str(value)
    return str(value)
