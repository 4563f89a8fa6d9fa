"""Store throughput against the disk's own speed (issue 33), in one run on the same disk.

Run from the repository root: ``python -m bench.throughput [--mib 256] [--out FILE]``. The same
bytes (``--mib`` of float32 rows, 1024 wide) go through:

- **raw write**: one file written sequentially and fsync'ed (the limit for writing);
- **raw read**: that file read sequentially into one buffer (the limit for reading; warm page
  cache, as every read row here: dropping the cache would disturb the other jobs of a shared
  machine);
- **store write**: ``StoreWriter`` writing them as shards (sha256, chunk sums, fsync, rename);
- **extract**: ``hookscope.extract`` of an identity layer over them, against the bare loop of
  the same batches plus the raw write (the goal: never slower than forward plus raw write);
- **store read rows**: ``store[layer][i:j]`` over every row, first pass (chunk checks included);
- **token view** / **token stream**: the same bytes as a ragged layer read flat
  (``store.tokens(layer)[i:j]``) and through the shuffled stream in a ``DataLoader`` (single
  tokens collated by the DataLoader, and batches the stream makes itself).

MB/s are 10^6 bytes per second; ratios are against the raw figure of the same direction. Goals:
reads >= 0.8x raw read, extract <= 1.0x (bare loop + raw write).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookscope.store import extract, open_store
from hookscope.store.folder import prepare_output
from hookscope.store.writer import ShardData, StoreWriter

WIDTH = 1024


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _raw_write(path: Path, data: torch.Tensor) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(data.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _raw_read(path: Path, into: bytearray) -> None:
    with open(path, "rb", buffering=0) as f:
        view, at = memoryview(into), 0
        while n := f.readinto(view[at:]):
            at += n


def _store_write(folder: Path, data: torch.Tensor, shard_rows: int, ragged: bool) -> None:
    prepare_output(folder, resume=False, overwrite=False)
    shape = [None, WIDTH] if ragged else [WIDTH]
    header = {"model": {"spec": None, "class": "bench"}, "extract": {},
              "layers": {"x": {"shape": shape, "dtype": "float32", "ragged": ragged}}}
    writer = StoreWriter(folder, header)
    for s, start in enumerate(range(0, len(data), shard_rows)):
        block, shard = data[start:start + shard_rows], ShardData(batches=(s, s + 1))
        if ragged:  # rows of 64 tokens
            rows = len(block) // 64
            shard.append({"x": block}, {"x": torch.full((rows,), 64, dtype=torch.int64)}, rows)
        else:
            shard.append({"x": block}, {}, len(block))
        writer.write(shard)
    writer.finish()


def _read_all(read: Callable[[int, int], object], n: int, step: int) -> None:
    for i in range(0, n, step):
        read(i, min(i + step, n))


def main(argv: list[str] | None = None) -> list[tuple[str, float, float, str]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="MiB of rows")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    parser.add_argument("--json", type=Path, help="also write the settings and rows (JSON) here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = args.mib * 2**20 // (4 * WIDTH) // 64 * 64
    data = torch.randn(rows, WIDTH)
    nbytes = data.numel() * 4
    shard_rows = 64 * 2**20 // (4 * WIDTH)  # 64 MiB shards
    table: list[tuple[str, float, float, str]] = []

    def row(name: str, seconds: float, limit: float | None, note: str = "") -> None:
        rate = nbytes / seconds / 1e6
        table.append((name, rate, (rate / limit) if limit else 1.0, note))

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        write_s = _timed(lambda: _raw_write(root / "raw.bin", data))
        into = bytearray(nbytes)
        _raw_read(root / "raw.bin", into)  # warm
        read_s = _timed(lambda: _raw_read(root / "raw.bin", into))
        raw_w, raw_r = nbytes / write_s / 1e6, nbytes / read_s / 1e6
        row("raw sequential write + fsync (limit)", write_s, None)
        row("raw sequential read, warm (limit)", read_s, None)
        row("store write (StoreWriter, 64 MiB shards)",
            _timed(lambda: _store_write(root / "rows", data, shard_rows, False)), raw_w)
        loader = DataLoader(TensorDataset(data), batch_size=256)
        bare_s = _timed(lambda: [nn.Identity()(x) for (x,) in loader])
        extract_s = _timed(lambda: extract(nn.Sequential(nn.Identity()), loader, "0",
                                           root / "extracted", shard_bytes=64 * 2**20,
                                           progress=False))
        table.append(("extract (identity layer)", nbytes / extract_s / 1e6,
                      extract_s / (bare_s + write_s), "x = time / (bare loop + raw write)"))
        store = open_store(root / "rows")
        row("store read rows, first pass (chunk checks)",
            _timed(lambda: _read_all(lambda i, j: store["x"][i:j], rows, 4096)), raw_r)
        row("store read rows, second pass",
            _timed(lambda: _read_all(lambda i, j: store["x"][i:j], rows, 4096)), raw_r)
        _store_write(root / "tokens", data, shard_rows, True)
        view = open_store(root / "tokens").tokens("x")
        row("token view, flat reads", _timed(lambda: _read_all(lambda i, j: view[i:j], rows,
                                                               4096)), raw_r)
        stream = view.stream(buffer_tokens=2**14, block_tokens=1024, seed=0)
        row("token stream, DataLoader collating single tokens (batches of 4096)",
            _timed(lambda: [b for b in DataLoader(stream, batch_size=4096)]), raw_r)
        stream = view.stream(buffer_tokens=2**14, block_tokens=1024, seed=0, batch_size=4096)
        row("token stream, batch_size=4096 (DataLoader batch_size=None)",
            _timed(lambda: [b for b in DataLoader(stream, batch_size=None)]), raw_r)
    settings = (f"{nbytes / 2**20:.0f} MiB of float32 rows ({WIDTH} wide), one run, same disk; "
                "writes fsync'ed, reads from a warm page cache; MB/s = 10^6 bytes/s")
    lines = [settings, "", "| row | MB/s | x limit | note |", "|---|---|---|---|"]
    lines += [f"| {name} | {rate:.0f} | x{ratio:.2f} | {note} |" for name, rate, ratio, note in table]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        rows = [{"row": name, "mb_s": rate, "ratio": ratio, "note": note}
                for name, rate, ratio, note in table]
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    return table


if __name__ == "__main__":
    main()
