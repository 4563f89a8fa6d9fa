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

MB/s are 10^6 bytes per second; ratios are against the raw figure of the same direction,
measured in the same round: ``--rounds`` rounds (default 5) each measure the limits and every
row again in a folder of their own, and a row shows the median of its per-round figures (the
disk's own speed moves by x3 from minute to minute on a shared machine: one raw figure against
rows measured later says little). Within a round the raw write, the store write, the bare loop
and extract are timed three times each, interleaved, each time into new files (the store always
writes new files; this machine's thin-provisioned disk wrote new blocks at about 370 MB/s and
blocks freed a moment before at about 2 GB/s), and their medians taken, as are the raw read
and the first pass (over each of the three stores written). Every file a read row reads has
been read once before, as the raw file has: a file not read since it was written was often no
longer in the page cache here (the host reclaims cold pages), and its first pass ran at x0.29
of the warm raw read against x0.95-1.04 once read. Goals: reads >= 0.8x raw read, extract
<= 1.0x (bare loop + raw write).

``--places memory s3`` runs the same rows against ``memory://`` and S3 (moto's standalone
server on 127.0.0.1, started here): there the limits are one PUT and one GET of the same bytes
through fsspec, and a store reads by 4 MiB ranged GETs through its chunk cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec.core
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hookscope.errors import StoreError
from hookscope.store import extract, open_store
from hookscope.store.folder import prepare_output
from hookscope.store.fs import location
from hookscope.store.writer import ShardData, StoreWriter

WIDTH = 1024
PLACES = ("local", "memory", "s3")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_times(fns: dict[str, Callable[[int], object]], times: int = 3) -> dict[str, float]:
    """The median seconds of each of ``fns`` (called with the repetition's number), each run
    ``times`` times, interleaved: a disk or machine that slows for a moment slows one
    repetition of each, not every repetition of one."""
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for k in range(times):
        for name, fn in fns.items():
            seconds[name].append(_timed(lambda: fn(k)))  # noqa: B023 - run at once
    return {name: statistics.median(s) for name, s in seconds.items()}


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


def _store_write(url: str, options: dict[str, Any] | None, data: torch.Tensor, shard_rows: int,
                 ragged: bool) -> None:
    folder = location(url, StoreError, options)
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


@dataclass
class _Place:
    """Where the rows go: a local folder (``root``), ``memory://`` or S3 (moto's server on
    127.0.0.1, started by ``_s3``); ``raw_write``/``raw_read`` move one file's bytes there the
    plainest way (the limit), and rows are prefixed with the place's name but for local."""

    name: str
    root: str
    options: dict[str, Any] | None = None

    def url(self, sub: str) -> str:
        return f"{self.root}/{sub}"

    @contextlib.contextmanager
    def round(self, k: int) -> Iterator[_Place]:
        """The place in a folder of round ``k``'s own, deleted when the round ends."""
        one = _Place(self.name, self.url(f"round-{k}"), self.options)
        if self.options is None and "://" not in self.root:
            Path(one.root).mkdir()
        try:
            yield one
        finally:
            if self.options is None and "://" not in self.root:
                shutil.rmtree(one.root, ignore_errors=True)
            else:
                fs, path = fsspec.core.url_to_fs(one.root, **(self.options or {}))
                if fs.exists(path):
                    fs.rm(path, recursive=True)

    def raw_write(self, data: torch.Tensor, name: str = "raw.bin") -> None:
        if self.options is None and "://" not in self.root:
            _raw_write(Path(self.url(name)), data)
            return
        fs, path = fsspec.core.url_to_fs(self.url(name), **(self.options or {}))
        fs.pipe_file(path, data.numpy().tobytes())  # the store uploads bytes too

    def warm(self, sub: str, into: bytearray) -> None:
        """Read every file of the folder ``sub`` once, as the raw file is before it is timed
        (a local place; elsewhere there is no page cache to warm)."""
        if self.options is None and "://" not in self.root:
            for path in sorted(Path(self.url(sub)).iterdir()):
                _raw_read(path, into)

    def raw_read(self, into: bytearray) -> None:
        if self.options is None and "://" not in self.root:
            _raw_read(Path(self.url("raw.bin")), into)
            return
        fs, path = fsspec.core.url_to_fs(self.url("raw.bin"), **(self.options or {}))
        fs.cat_file(path)  # the bytes themselves, no copy into ``into``


@contextlib.contextmanager
def _memory() -> Iterator[_Place]:
    """A folder of its own in fsspec's in-process memory file system, deleted afterwards."""
    root = f"memory://bench-{secrets.token_hex(8)}"
    try:
        yield _Place("memory", root)
    finally:
        fs, path = fsspec.core.url_to_fs(root)
        fs.rm(path, recursive=True)


@contextlib.contextmanager
def _s3() -> Iterator[_Place]:
    """A bucket on moto's standalone S3 server on a free port of 127.0.0.1 (fake credentials)."""
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    fake = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {key: os.environ.get(key) for key in fake}
    os.environ.update(fake)
    # moto keeps its buckets per process, not per server: a bucket of this run's own
    bucket = f"bench-{secrets.token_hex(8)}"
    options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    try:
        fs, _ = fsspec.core.url_to_fs(f"s3://{bucket}", **options)
        fs.mkdir(bucket)
        yield _Place("S3 (moto, 127.0.0.1)", f"s3://{bucket}/throughput", options)
    finally:
        server.stop()
        for key, value in saved.items():  # the calling process's environment as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _place_rows(place: _Place, data: torch.Tensor) -> list[tuple[str, float, float, str]]:
    """One round of the rows of one place, as ``(row, MB/s, x limit, note)``: raw write and
    read (the limits), store write, extract, store reads, token view and streams, each against
    the raw figure of its direction measured in this round."""
    nbytes, rows = data.numel() * 4, len(data)
    shard_rows = 64 * 2**20 // (4 * WIDTH)  # 64 MiB shards
    label = "" if place.name == "local" else f"{place.name}: "
    options = place.options
    table: list[tuple[str, float, float, str]] = []

    def row(name: str, seconds: float, limit: float | None) -> None:
        rate = nbytes / seconds / 1e6
        table.append((name, rate, (rate / limit) if limit else 1.0, ""))

    loader = DataLoader(TensorDataset(data), batch_size=256)
    timed = _median_times({  # the write limit and the rows written against it, side by side;
        # every repetition writes new files, as the store does (rewriting a file ran 4x faster)
        "write": lambda k: place.raw_write(data, "raw.bin" if k == 0 else f"raw-{k}.bin"),
        "store write": lambda k: _store_write(place.url(f"rows-{k}"), options, data, shard_rows, False),
        "bare": lambda k: [nn.Identity()(x) for (x,) in loader],
        "extract": lambda k: extract(nn.Sequential(nn.Identity()), loader, "0",
                                     place.url(f"extracted-{k}"), shard_bytes=64 * 2**20,
                                     progress=False, storage_options=options)})
    write_s, bare_s, extract_s = timed["write"], timed["bare"], timed["extract"]
    into = bytearray(nbytes)
    place.raw_read(into)  # warm
    for k in range(3):  # the stores' files as warm as the raw file (see the module's docstring)
        place.warm(f"rows-{k}", into)
    stores = [open_store(place.url(f"rows-{k}"), storage_options=options) for k in range(3)]
    reads = _median_times({  # the read limit and the first pass (a store of its own each time)
        "read": lambda k: place.raw_read(into),
        "first pass": lambda k: _read_all(lambda i, j: stores[k]["x"][i:j], rows, 4096)})
    read_s = reads["read"]
    raw_w, raw_r = nbytes / write_s / 1e6, nbytes / read_s / 1e6
    row(f"{label}raw sequential write + fsync (limit)" if not label else
        f"{label}raw write, one PUT of the bytes (limit)", write_s, None)
    row(f"{label}raw sequential read, warm (limit)" if not label else
        f"{label}raw read, one GET of the bytes (limit)", read_s, None)
    row(f"{label}store write (StoreWriter, 64 MiB shards)", timed["store write"], raw_w)
    table.append((f"{label}extract (identity layer)", nbytes / extract_s / 1e6,
                  extract_s / (bare_s + write_s), "x = time / (bare loop + raw write)"))
    row(f"{label}store read rows, first pass (chunk checks)", reads["first pass"], raw_r)
    row(f"{label}store read rows, second pass",
        _timed(lambda: _read_all(lambda i, j: stores[0]["x"][i:j], rows, 4096)), raw_r)
    _store_write(place.url("tokens"), options, data, shard_rows, True)
    place.warm("tokens", into)
    view = open_store(place.url("tokens"), storage_options=options).tokens("x")
    row(f"{label}token view, flat reads",
        _timed(lambda: _read_all(lambda i, j: view[i:j], rows, 4096)), raw_r)
    stream = view.stream(buffer_tokens=2**14, block_tokens=1024, seed=0)
    row(f"{label}token stream, DataLoader collating single tokens (batches of 4096)",
        _timed(lambda: [b for b in DataLoader(stream, batch_size=4096)]), raw_r)
    stream = view.stream(buffer_tokens=2**14, block_tokens=1024, seed=0, batch_size=4096)
    row(f"{label}token stream, batch_size=4096 (DataLoader batch_size=None)",
        _timed(lambda: [b for b in DataLoader(stream, batch_size=None)]), raw_r)
    return table


def _median_rows(rounds: list[list[tuple[str, float, float, str]]]) -> list[dict[str, Any]]:
    """Per row: the median MB/s and x limit of the rounds, and each round's x limit."""
    found = []
    for k, (name, _, _, note) in enumerate(rounds[0]):
        ratios = [one[k][2] for one in rounds]
        found.append({"row": name, "mb_s": statistics.median(one[k][1] for one in rounds),
                      "ratio": statistics.median(ratios), "ratios": ratios, "note": note})
    return found


def _spread(ratios: list[float]) -> str:
    return f"x{min(ratios):.2f}-x{max(ratios):.2f}" if len(ratios) > 1 else ""


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="MiB of rows")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, each measuring the limits and every row (default 5)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    parser.add_argument("--json", type=Path, help="also write the settings and rows (JSON) here")
    parser.add_argument("--places", nargs="+", choices=PLACES, default=["local"],
                        help="where the store goes: a local folder (default), memory://, S3 "
                             "(moto's server on 127.0.0.1; needs hookscope[test])")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = args.mib * 2**20 // (4 * WIDTH) // 64 * 64
    data = torch.randn(rows, WIDTH)
    nbytes = data.numel() * 4
    table: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for name in args.places:
            with contextlib.ExitStack() as stack:
                place = _Place("local", tmp) if name == "local" else \
                    stack.enter_context(_memory()) if name == "memory" else \
                    stack.enter_context(_s3())
                rounds = []
                for k in range(args.rounds):
                    with place.round(k) as one:
                        rounds.append(_place_rows(one, data))
                table += _median_rows(rounds)
    settings = (f"{nbytes / 2**20:.0f} MiB of float32 rows ({WIDTH} wide), same disk, {args.rounds} rounds "
                "(each row: the median of its per-round figures); "
                "writes fsync'ed, reads from a warm page cache; MB/s = 10^6 bytes/s"
                + ("; memory:// and S3 (moto's server on 127.0.0.1): against one PUT and one GET "
                   "of the bytes there" if args.places != ["local"] else ""))
    lines = [settings, "", "| row | MB/s | x limit | rounds | note |", "|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['mb_s']:.0f} | x{r['ratio']:.2f} | {_spread(r['ratios'])} | "
              f"{r['note']} |" for r in table]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "rows": table}, indent=1))
    return table


if __name__ == "__main__":
    main()
