"""``hookscope attention MODEL --input X --layers PATTERN``: the attention probabilities of each
selected module (an attention module, or a block holding one), summarised on stdout and drawn as
one PNG per module (heads in a grid, tokens on both axes).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

import hookscope
from hookscope.cli._common import (
    add_layer_argument,
    add_model_arguments,
    add_parents_argument,
    check_output_path,
    image_options,
    load_model_timed,
    non_negative_int,
    print_json,
    print_table,
    say,
)
from hookscope.errors import SpecError
from hookscope.zoo import Inputs, LoadedModel, attention_grid, load_inputs, plan_png_files

__all__ = ["HELP", "add_arguments", "run"]

HELP = "attention probabilities of selected modules (eager softmax or fused SDPA) as heat maps"

COLUMNS = ("path", "shape", "entropy", "max", "top_key", "png")
_UNSAFE = re.compile(r"[^A-Za-z0-9._\-\[\]:]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``attention`` options to ``parser``."""
    add_model_arguments(parser)
    add_layer_argument(parser, required=True,
                       help="attention modules or blocks holding one (one or more, repeatable): "
                            "'encoder.layer.*', 'h.*.attn', 'type:BertSelfAttention'")
    parser.add_argument("--out", metavar="DIR", default="attention",
                        help="folder for the PNGs, one per module (default: attention/)")
    parser.add_argument("--sample", type=non_negative_int, default=0, metavar="ROW",
                        help="batch row (input) to draw (default 0)")
    parser.add_argument("--head", type=non_negative_int, nargs="+", metavar="H",
                        help="only these heads (one or more), in the summary and the PNGs "
                             "(default: every head)")
    parser.add_argument("--no-plot", action="store_true", help="print the summary only")
    parser.add_argument("--overwrite", action="store_true", help="replace existing PNGs")
    add_parents_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    """Compute, summarise and draw the attention maps as ``args`` says; exit code 0."""
    if not args.no_plot:
        check_output_path(args.out, "--out", parents=args.parents, folder=True)
    loaded = load_model_timed(args.model, **image_options(args))
    hookscope.select(loaded.module, *args.layers)  # a bad pattern fails here, before any work
    inputs = load_inputs(args.input, loaded)
    for line in inputs.descriptions:
        say(f"input {line}")
    first = inputs.args[0] if inputs.args else None
    batch = len(inputs.texts or inputs.images) or (first.shape[0] if first is not None
                                                   and first.dim() else 1)
    if args.sample >= batch:
        raise SpecError(f"--sample {args.sample} is not a row of this batch of {batch} "
                        f"input(s): give 0 … {batch - 1}")
    with torch.no_grad():
        probabilities = hookscope.attention(loaded.module, *inputs.args, layers=args.layers,
                                            **inputs.kwargs)
    probabilities = {path: _heads(path, value, args.head) for path, value in probabilities.items()}
    heads = args.head or None
    tokens = _tokens(loaded, inputs, args.sample)
    files = {} if args.no_plot else plan_png_files(Path(args.out), probabilities, args.overwrite, "--out")
    rows = [_summary(path, value[args.sample], tokens, files.get(path))
            for path, value in probabilities.items()]
    for path, file in files.items():
        value = probabilities[path][args.sample]
        count = len(tokens) if tokens else value.shape[-1]
        attention_grid(value[:, :count, :count], file, title=f"{path}  ({args.model}, input "
                       f"{args.sample})", tokens=tokens, heads=heads)
        say(f"wrote {file}")
    if args.json:
        print_json(rows)
    else:
        print_table(rows, COLUMNS)
    return 0


def _heads(path: str, value: torch.Tensor, heads: list[int] | None) -> torch.Tensor:
    """``value`` ``(batch, heads, query, key)`` with only the ``--head`` heads, in their order."""
    if heads is None:
        return value
    count = value.shape[1]
    outside = [h for h in heads if h >= count]
    if outside:
        raise SpecError(f"--head {outside[0]} is not a head of {path} ({count} heads): give "
                        f"0 … {count - 1}")
    return value[:, heads]


def _tokens(loaded: LoadedModel, inputs: Inputs, sample: int) -> list[str] | None:
    """The tokens of batch row ``sample`` without padding, or ``None`` for non-text input."""
    ids = inputs.kwargs.get("input_ids")
    if loaded.tokenizer is None or ids is None:
        return None
    mask = inputs.kwargs.get("attention_mask")
    length = int(mask[sample].sum()) if mask is not None else ids.shape[1]
    return [str(t) for t in loaded.tokenizer.convert_ids_to_tokens(ids[sample, :length].tolist())]




def _summary(path: str, value: torch.Tensor, tokens: list[str] | None, file: Path | None
             ) -> dict[str, Any]:
    """One row: mean entropy (nats) of the query rows, the largest probability, and the key
    that receives the most attention summed over heads and queries."""
    count = len(tokens) if tokens else value.shape[-1]
    value = value[:, :count, :count].float()  # (heads, query, key) without padding
    entropy = -(value * value.clamp_min(1e-12).log()).sum(-1).mean()
    top = int(value.sum(dim=(0, 1)).argmax())
    return {"path": path, "shape": list(value.shape), "entropy": float(entropy),
            "max": float(value.max()), "top_key": f"{top} {tokens[top]}" if tokens else top,
            "png": str(file) if file else None}
