"""Benchmark reading a store back: ``store[layer][i:j]`` against ``numpy.memmap`` of the same bytes.

Run from the repository root: ``python bench/read.py`` (or ``python -m bench.read``). Both sides
read the same shard files from a warm page cache and copy each slice out (``np.array`` of the
memmap slice vs the tensor the store returns). Pass 1 maps the files afresh on both sides (page
faults), and the store also checks each 4 MiB chunk against its checksum once; later passes reuse
the mappings and checks. Goal: >= 0.5x memmap.
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hookscope.store import open_store
from hookscope.store.folder import prepare_output
from hookscope.store.writer import ShardData, StoreWriter


def _build(folder: Path, rows: int, width: int, shard_rows: int) -> None:
    prepare_output(folder, resume=False, overwrite=False)
    header = {"model": {"spec": None, "class": "bench"}, "extract": {},
              "layers": {"x": {"shape": [width], "dtype": "float32", "ragged": False}}}
    writer = StoreWriter(folder, header)
    for s, start in enumerate(range(0, rows, shard_rows)):
        block = torch.randn(min(shard_rows, rows - start), width)
        shard = ShardData(batches=(s, s + 1))
        shard.append({"x": block}, {}, len(block))
        writer.write(shard)
    writer.finish()


def _memmaps(folder: Path) -> list[tuple[int, np.memmap]]:
    """``(first row, memmap)`` per shard, at the tensor's offset found in the safetensors header."""
    out = []
    manifest = json.loads((folder / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            entry = json.loads(f.read(length))["x"]
        offset = 8 + length + entry["data_offsets"][0]
        out.append((shard["rows"][0], np.memmap(path, np.float32, "r", offset,
                                                tuple(entry["shape"]))))
    return out


def _timed(read: Callable[[int, int], object], rows: int, step: int) -> float:
    start = time.perf_counter()
    for i in range(0, rows, step):
        read(i, min(i + step, rows))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--width", type=int, default=1024, help="float32 values per row")
    parser.add_argument("--shard-rows", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "store"
        _build(folder, args.rows, args.width, args.shard_rows)
        for file in folder.iterdir():  # warm the page cache for both sides
            file.read_bytes()
        maps = _memmaps(folder)
        starts = [s for s, _ in maps]

        def numpy_read(i: int, j: int) -> np.ndarray:  # reads from the current ``maps``
            k = int(np.searchsorted(starts, i, side="right")) - 1
            first, mm = maps[k]
            if j <= first + len(mm):
                return np.array(mm[i - first:j - first])
            return np.concatenate([numpy_read(i, first + len(mm)), numpy_read(first + len(mm), j)])

        size_gb = args.rows * args.width * 4 / 1e9
        print(f"{args.rows} rows x {args.width} float32 = {size_gb * 1e3:.0f} MB in "
              f"{len(maps)} shards; page cache warm")
        for step in (4096, 256, 16):
            first_ours, first_theirs, ours, theirs = [], [], [], []
            for _ in range(args.repeats):  # best of several: the machine may be shared
                view = open_store(folder)["x"]  # fresh: its first pass checks each chunk once
                maps[:] = _memmaps(folder)  # fresh too: its first pass takes the page faults
                first_ours.append(_timed(lambda i, j, view=view: view[i:j], args.rows, step))
                first_theirs.append(_timed(numpy_read, args.rows, step))
                ours.append(_timed(lambda i, j, view=view: view[i:j], args.rows, step))
                theirs.append(_timed(numpy_read, args.rows, step))
            for label, a, b in (("pass 1 (fresh maps, checks)", first_ours, first_theirs),
                                ("later passes", ours, theirs)):
                print(f"slices of {step:5d} rows  {label:27s} store {size_gb / min(a):6.2f} GB/s  "
                      f"memmap {size_gb / min(b):6.2f} GB/s  ratio {min(b) / min(a):.2f}x "
                      f"(goal >= 0.5x)")
        first_ours, first_theirs = [], []
        for _ in range(args.repeats):
            unchecked = open_store(folder, verify_reads=False)["x"]
            maps[:] = _memmaps(folder)
            first_ours.append(_timed(lambda i, j, unchecked=unchecked: unchecked[i:j], args.rows, 256))
            first_theirs.append(_timed(numpy_read, args.rows, 256))
        ours_s, theirs_s = min(first_ours), min(first_theirs)
        print(f"slices of   256 rows  pass 1, verify_reads=False  "
              f"store {size_gb / ours_s:6.2f} GB/s  memmap {size_gb / theirs_s:6.2f} GB/s  "
              f"ratio {theirs_s / ours_s:.2f}x")
        assert torch.equal(view[100:300], torch.from_numpy(numpy_read(100, 300)))


if __name__ == "__main__":
    main()
