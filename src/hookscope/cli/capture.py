"""``hookscope capture MODEL --layers PATTERN --input X``: run the model once, print its prediction
and statistics of every call of every selected module; optionally save the tensors and plot them.

stdout carries the prediction and the table (or ``--json``); loading and file lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
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
    print_json,
    print_table,
    say,
)
from hookscope.diagnostics import RunningStats
from hookscope.errors import SelectorError, SpecError
from hookscope.record import RecordKey
from hookscope.zoo import Inputs, LoadedModel, Prediction, load_inputs, predict

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run a model once and show every call of the selected modules: prediction, stats, PNGs"

COLUMNS = ("path", "call", "shape", "dtype", "mean", "std", "min", "max", "zeros", "nonfinite")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``capture`` options to ``parser``."""
    add_model_arguments(parser)
    add_layer_argument(parser, required=True,
                       help="modules to capture, one or more, repeatable: a path ('_conv_stem'), "
                            "a glob ('_blocks.*', '**._swish'), 're:REGEX' or 'type:Conv2d'; "
                            "'PATTERN::NAME' for the calls of function NAME inside their "
                            "forward ('::relu', 'h.*.attn::softmax'; tree --ops lists them)")
    parser.add_argument("--save", metavar="FILE.safetensors",
                        help="write every captured tensor here (keys 'path' or 'path:call')")
    parser.add_argument("--plot", metavar="DIR",
                        help="write one PNG per captured tensor: feature maps for 4-D outputs "
                             "(first input), histograms otherwise")
    parser.add_argument("--gradcam", metavar="LAYER",
                        help="with --plot, image models: draw LAYER's Grad-CAM map for the "
                             "predicted class over each input, DIR/gradcam_<i>.png")
    parser.add_argument("--on-unfired", choices=("warn", "error", "ignore"), default="warn",
                        help="a selected module that never ran: warn (default), error, ignore")
    parser.add_argument("--early-stop", action="store_true",
                        help="stop the forward once every selected layer has returned (faster "
                             "for early layers; no prediction is printed)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --save file or PNGs")
    add_parents_argument(parser)
    parser.add_argument("--json", action="store_true", help="print prediction and rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Capture, print, save and plot as ``args`` says; exit code 0."""
    if args.save and not args.save.endswith(".safetensors"):
        raise SpecError(f"--save writes a safetensors file; name it *.safetensors (got "
                        f"'{args.save}'): hookscope.load() or safetensors reads it back")
    if args.gradcam and not args.plot:
        raise SpecError("--gradcam draws over the input images: give --plot DIR too")
    if args.save and os.path.lexists(args.save) and not args.overwrite:
        raise SpecError(f"'{args.save}' already exists; pass --overwrite to replace it, or "
                        "choose another --save file")
    check_output_path(args.save, "--save", parents=args.parents)
    check_output_path(args.plot, "--plot", parents=args.parents, folder=True)
    loaded = load_model_timed(args.model, **image_options(args))
    hookscope.select(loaded.module, *args.layers)  # a bad pattern fails here, before any work
    if args.gradcam:
        hookscope.select(loaded.module, args.gradcam)
    inputs = load_inputs(args.input, loaded)
    if args.gradcam and not inputs.images:
        raise SpecError("--gradcam draws over input images: give an image input (a file or "
                        "sample:NAME)")
    for line in inputs.descriptions:
        say(f"input {line}")
    output = None
    with hookscope.capture(loaded.module, *args.layers, on_unfired=args.on_unfired,
                           early_stop=args.early_stop) as acts:
        output = inputs.call(loaded.module)
    if acts.unmatched:
        raise SelectorError(f"--layers {', '.join(sorted(acts.unmatched))}: the address matches "
                            f"nothing in this model (the module ran but never made that call; "
                            f"see the warning above). 'hookscope tree {args.model} --input X "
                            f"--ops' lists the function addresses that exist")
    prediction = (Prediction("none") if output is None else
                  predict(loaded, output, attention_mask=inputs.kwargs.get("attention_mask")))
    counts = acts.counts
    items = list(acts.items())
    records = [_record(key, tensor, acts.names) for key, tensor in items]
    shown = {RecordKey.name_of(key.path, key.op) for key, _ in items}
    for path in sorted({p for p, n in counts.items() if n} - shown):
        say(f"warning: '{path}' ran but its output holds no tensor (e.g. an output part that is "
            f"None): nothing to show")
    if args.save:
        acts.save(args.save, overwrite=True, metadata=_metadata(args, loaded, records))
        say(f"saved {_count(len(records), 'tensor')} to {args.save}")
    plots = _plot(args, acts, inputs) if args.plot else []
    if args.gradcam:
        cams = hookscope.gradcam(loaded.module, inputs.args[0], args.gradcam)
        plots += [hookscope.save_gradcam_overlay(image, cam, Path(args.plot) / f"gradcam_{i}.png",
                                                 title=f"Grad-CAM of '{args.gradcam}', {spec}",
                                                 overwrite=args.overwrite)
                  for i, (image, cam, spec) in enumerate(zip(inputs.images, cams, inputs.specs))]
        say(f"wrote Grad-CAM of '{args.gradcam}' to {args.plot}/gradcam_0.png"
            f"{f' … gradcam_{len(cams) - 1}.png' if len(cams) > 1 else ''}")
    if args.json:
        print_json({"model": loaded.spec, "inputs": list(inputs.descriptions),
                    "prediction": _prediction_json(prediction, inputs), "records": records,
                    "saved": args.save, "plots": [str(p) for p in plots]})
        return 0
    _print_prediction(prediction, inputs)
    named = any(r["name"] != r["path"] for r in records)  # a standard name: its path beside it
    print_table(records, (["name"] if named else []) + list(COLUMNS))
    return 0


def _asked(path: str, names: dict[str, str]) -> str:
    """The name asked for record ``path`` (``acts.names``: ``"resid_post.1"`` for
    ``"transformer.h.1"``), with the parts of a structured output that follow it."""
    for name, record in names.items():
        if name != record and (path == record or path.startswith(record + "[")):
            return name + path[len(record):]
    return path


def _record(key: RecordKey, tensor: torch.Tensor, names: dict[str, str]) -> dict[str, Any]:
    """One row: the name asked (``_asked``), the record name (module path with the output
    part, e.g. ``attn[0]``), the call, the file key, and statistics of the finite values
    (float64; ``std`` is the population one, ``ddof=0``, as ``hookscope.stats``)."""
    running = RunningStats()
    running.update(tensor)
    stats = running.as_dict()
    return {"name": _asked(key.name, names), "path": key.name, "call": key.call or 0,
            "key": str(key),
            "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "mean": stats["mean"], "std": stats["std"], "min": stats["min"], "max": stats["max"],
            "zeros": stats["frac_zeros"], "nonfinite": int(running.nonfinite)}


def _metadata(args: argparse.Namespace, loaded: LoadedModel,
              records: list[dict[str, Any]]) -> dict[str, str]:
    """safetensors metadata (strings): model spec, inputs, layer patterns, and for each key the
    module path and call it came from."""
    return {"hookscope.model": loaded.spec,
            "hookscope.inputs": json.dumps(list(args.input)),
            "hookscope.layers": json.dumps(list(args.layers)),
            "hookscope.records": json.dumps({r["key"]: {"path": r["path"], "call": r["call"]}
                                             for r in records})}


def _plot(args: argparse.Namespace, acts: hookscope.Capture, inputs: Inputs) -> list[Path]:
    from hookscope.zoo import plot_activations
    tensors = {str(key).replace(":", ".call"): tensor for key, tensor in acts.items()}
    image = inputs.images[0] if inputs.images else None
    files = plot_activations(tensors, args.plot, image=image, overwrite=args.overwrite)
    first = f" (first of {len(inputs.specs)} inputs)" if len(inputs.specs) > 1 else ""
    say(f"wrote {_count(len(files), 'PNG')} to {args.plot}{first}")
    return files


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _print_prediction(prediction: Prediction, inputs: Inputs) -> None:
    if prediction.task == "imagenet-classes":
        for spec, scores in zip(inputs.specs, prediction.classes):
            print(f"{spec}: top-{len(scores)} ImageNet classes")
            print_table([{"class": s.index, "name": s.name, "p": round(s.p, 4)} for s in scores],
                        ("class", "name", "p"))
            print()
    elif prediction.task == "sentence-embeddings" and prediction.similarity is not None:
        print("cosine similarity of the mean-pooled sentence embeddings")
        matrix = prediction.similarity.tolist()
        columns = ("#", "sentence") + tuple(str(j) for j in range(len(matrix)))
        print_table([{"#": i, "sentence": _short(text),
                      **{str(j): round(v, 4) for j, v in enumerate(row)}}
                     for i, (text, row) in enumerate(zip(inputs.texts, matrix))], columns)
        print()


def _prediction_json(prediction: Prediction, inputs: Inputs) -> dict[str, Any]:
    result: dict[str, Any] = {"task": prediction.task}
    if prediction.classes:
        result["classes"] = {spec: [{"class": s.index, "name": s.name, "p": s.p} for s in scores]
                             for spec, scores in zip(inputs.specs, prediction.classes)}
    if prediction.similarity is not None:
        result["sentences"] = list(inputs.texts)
        result["similarity"] = prediction.similarity.tolist()
    return result


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"
