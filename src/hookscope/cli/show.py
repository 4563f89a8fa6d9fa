"""``hookscope show STORE``: layers, row shapes, dtypes, rows, shards, bytes, completeness, the
first row ids and the most common labels."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from torch import Tensor

from hookscope.cli._common import print_json, print_table, say
from hookscope.store import Store, dtype_name, open_store

__all__ = ["HELP", "add_arguments", "describe", "print_store", "run"]

HELP = "describe an activation store: layers, shapes, dtypes, rows, shards, bytes, completeness"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", metavar="STORE", help="folder or URL written by `hookscope extract`")
    parser.add_argument("--verify", action="store_true",
                        help="check everything reading checks (manifest, shard headers, sizes, "
                             "chunk sums) and every shard's digest (reads every byte); exit 1 "
                             "when anything fails or the store is incomplete")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    store = open_store(args.store, allow_incomplete=True)
    if args.verify:
        store.verify()
    print_store(store, as_json=args.json, verified=args.verify)
    if args.verify and not store.complete:
        say(f"error: {args.store} is INCOMPLETE: its extraction stopped after {len(store)} rows; "
            f"resume it (--resume) before using it")
        return 1
    return 0


def describe(store: Store) -> dict[str, Any]:
    """Return what ``show`` prints, as JSON-ready data with stable keys."""
    model = store.manifest.get("model", {})
    return {
        "path": str(store.path), "complete": store.complete, "rows": len(store),
        "shards": len(store.shards), "bytes": store.nbytes,
        "model": model.get("spec") or model.get("class"),
        "reduce": store.manifest.get("extract", {}).get("reduce"),
        "layers": [{"layer": name, "path": info.path,
                    "shape": ["tokens" if n is None else n for n in info.shape],
                    "dtype": dtype_name(info.dtype), "ragged": info.ragged}
                   for name, info in ((name, store.layers[layer])
                                      for name, layer in store.paths.items())],
        "ids": _first(store.ids), "labels": _label_counts(store.labels),
    }


def _first(ids: Tensor | list[str], shown: int = 3) -> list[Any]:
    """The first ``shown`` row ids (str or int)."""
    return list(ids[:shown]) if isinstance(ids, list) else ids[:shown].tolist()


def _label_counts(labels: Tensor | list[str] | None, shown: int = 5) -> dict[str, int] | None:
    """Rows per label, the ``shown`` most common (labels of one value each: str or int;
    other labels, such as vectors, by their shape)."""
    if labels is None:
        return None
    if isinstance(labels, Tensor):
        if labels.dim() != 1 or labels.is_floating_point():
            return {f"{'x'.join(map(str, labels.shape[1:])) or 'scalar'} "
                    f"{dtype_name(labels.dtype)}": len(labels)}
        labels = [str(v) for v in labels.tolist()]
    return dict(Counter(labels).most_common(shown))


def print_store(store: Store, *, as_json: bool, verified: bool = False) -> None:
    """Print ``describe(store)``: a table of layers on stdout and a summary line, or JSON."""
    data = describe(store)
    if as_json:
        print_json({**data, "verified": verified})
        return
    rows = [{**layer, "row shape": "x".join(str(n) for n in layer["shape"]) or "scalar",
             "ragged": "yes" if layer["ragged"] else "no"} for layer in data["layers"]]
    named = any(layer["layer"] != layer["path"] for layer in data["layers"])  # standard names
    print_table(rows, ["layer", *(["path"] if named else []), "row shape", "dtype", "ragged"])
    state = "complete" if data["complete"] else "INCOMPLETE (resume the extraction)"
    shards = f"{data['shards']} shard{'s' if data['shards'] != 1 else ''}"
    print(f"{data['rows']} rows in {shards}, {_size(data['bytes'])}, {state}; "
          f"model {data['model']}, reduce {data['reduce']}")
    more = ", ..." if data["rows"] > len(data["ids"]) else ""
    print(f"ids: {', '.join(map(str, data['ids']))}{more}")
    if data["labels"] is not None:
        print(f"labels: {', '.join(f'{k} ({n})' for k, n in data['labels'].items())}")
    if verified:
        say("verified: manifest, shard headers, sizes, chunk sums and digest of every shard")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
