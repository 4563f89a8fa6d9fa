"""``hookscope show STORE``: layers, row shapes, dtypes, rows, shards, bytes, completeness."""

from __future__ import annotations

import argparse
from typing import Any

from hookscope.cli._common import print_json, print_table, say
from hookscope.store.reader import Store, dtype_name, open_store

HELP = "describe an activation store: layers, shapes, dtypes, rows, shards, bytes, completeness"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", metavar="STORE", help="folder written by `hookscope extract`")
    parser.add_argument("--verify", action="store_true",
                        help="check everything reading checks (manifest, shard headers, sizes, "
                             "chunk sums) and every shard's sha256 (reads every byte); exit 1 "
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
        "layers": [{"layer": info.path, "shape": ["tokens" if n is None else n for n in info.shape],
                    "dtype": dtype_name(info.dtype), "ragged": info.ragged}
                   for info in store.layers.values()],
    }


def print_store(store: Store, *, as_json: bool, verified: bool = False) -> None:
    """Print ``describe(store)``: a table of layers on stdout and a summary line, or JSON."""
    data = describe(store)
    if as_json:
        print_json({**data, "verified": verified})
        return
    rows = [{**layer, "row shape": "x".join(str(n) for n in layer["shape"]) or "scalar",
             "ragged": "yes" if layer["ragged"] else "no"} for layer in data["layers"]]
    print_table(rows, ["layer", "row shape", "dtype", "ragged"])
    state = "complete" if data["complete"] else "INCOMPLETE (resume the extraction)"
    shards = f"{data['shards']} shard{'s' if data['shards'] != 1 else ''}"
    print(f"{data['rows']} rows in {shards}, {_size(data['bytes'])}, {state}; "
          f"model {data['model']}, reduce {data['reduce']}")
    if verified:
        say("verified: manifest, shard headers, sizes, chunk sums and sha256 of every shard")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
