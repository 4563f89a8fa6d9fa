"""``hookscope lens MODEL --input TEXT|IDS``: the logit lens of a Hugging Face decoder LM, what it
would predict from each block's residual stream (through its own final norm and unembedding):
the top-k tokens per layer at the last real position on stdout, and the heat map as a PNG
(``OUT/logit_lens.png``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import hookscope
from hookscope.cli._common import (
    add_model_arguments,
    add_parents_argument,
    add_several,
    check_output_path,
    image_options,
    load_model_timed,
    non_negative_int,
    positive_int,
    say,
)
from hookscope.errors import SpecError
from hookscope.zoo import Inputs, load_inputs, plan_png_files

__all__ = ["HELP", "add_arguments", "run"]

HELP = "logit lens of a decoder LM: top-k next tokens read from each layer, and its heat map"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``lens`` options to ``parser``."""
    add_model_arguments(parser)
    add_several(parser, "--layers", metavar="PATTERN",
                help="blocks to read, e.g. 'transformer.h.*' (default: every block)")
    parser.add_argument("--top-k", type=positive_int, default=3, metavar="K",
                        help="tokens shown per layer (default 3)")
    parser.add_argument("--sample", type=non_negative_int, default=0, metavar="ROW",
                        help="batch row (input) to show (default 0)")
    parser.add_argument("--out", metavar="DIR", default="lens",
                        help="folder for logit_lens.png (default: lens/)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
    add_parents_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Read the lens, print the table and draw the PNG as ``args`` says; exit code 0."""
    check_output_path(args.out, "--out", parents=args.parents, folder=True)
    loaded = load_model_timed(args.model, **image_options(args))
    if args.layers:
        hookscope.select(loaded.module, *args.layers)  # a bad pattern fails here
    inputs = load_inputs(args.input, loaded)
    ids, mask = _token_ids(inputs)
    if args.sample >= ids.shape[0]:
        raise SpecError(f"--sample {args.sample} is not a row of this batch of {ids.shape[0]}: "
                        f"give 0 … {ids.shape[0] - 1}")
    file = plan_png_files(Path(args.out), ["logit_lens"], args.overwrite, "--out")["logit_lens"]
    for line in inputs.descriptions:
        say(f"input {line}")
    lens = hookscope.logit_lens(loaded.module, ids, layers=args.layers, attention_mask=mask)
    vocab = lens.log_probs.shape[-1]
    if args.top_k > vocab:
        raise SpecError(f"--top-k {args.top_k} is more tokens than the vocabulary has ({vocab}): "
                        f"give --top-k 1 … {vocab}")
    decode = _decoder(loaded.tokenizer)
    position = lens.position(args.sample)  # the last real token: the rule of every verb
    table = lens.table(args.top_k, row=args.sample, decode=decode)
    lens.plot(file, row=args.sample, decode=decode,  # written only once the run has succeeded
              title=f"logit lens of {args.model}, input {args.sample}")
    say(f"wrote {file}")
    print(f"top {args.top_k} next tokens at position {position} of input {args.sample}")
    print(table)
    return 0


def _token_ids(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids, attention_mask)``: a text's tokens, or one integer tensor given as a file."""
    if "input_ids" in inputs.kwargs:
        return inputs.kwargs["input_ids"], inputs.kwargs.get("attention_mask")
    given = inputs.args[0] if len(inputs.args) == 1 else None
    if isinstance(given, torch.Tensor) and given.dim() == 2 and not given.is_floating_point():
        return given.long(), None
    raise SpecError(f"the logit lens reads token ids, and the inputs {list(inputs.specs)} are "
                    f"not: give a text (a model with a tokenizer) or a (batch, seq) integer "
                    f"tensor file, e.g. --input ids.pt")


def _decoder(tokenizer: Any) -> Any:
    """``tokenizer.decode`` for one id, or ``None`` (ids shown as numbers) without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda token: tokenizer.decode([token])
