"""Benchmark extraction: throughput against a bare forward loop, and peak RSS at 1x vs 10x rows.

Run from the repository root: ``python bench/extract.py`` (or ``python -m bench.extract``).
Prints ratios measured in this one run; the goals (DESIGN.md) are throughput >= 0.9x the bare
loop and peak RSS at 10x the rows within 10% of 1x. Wall-clock ratios are medians of interleaved
runs; on a shared machine the CPU-time ratio (this process's CPU seconds, the writer thread's
included) says more about the work extraction adds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hookscope.store import extract

ROOT = Path(__file__).resolve().parents[1]


def _photos(n: int) -> torch.Tensor:
    """``n`` real photos (scikit-image's, repeated), preprocessed for efficientnet-lite0."""
    from skimage import data

    from hookscope.zoo.inputs import preprocess_image
    from hookscope.zoo.models import ImagePreprocess

    pictures = [data.chelsea(), data.astronaut(), data.coffee(), data.rocket()]
    rows = [preprocess_image(pictures[i % 4], ImagePreprocess(size=(224, 224)))[0] for i in range(4)]
    return torch.stack([rows[i % 4] for i in range(n)])  # (n, 3, 224, 224)


def _bare(model: torch.nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Return (wall s, CPU s of this process) of a plain no-grad forward loop over ``loader``."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for batch in loader:
            model(batch[0] if isinstance(batch, list) else batch)
    return time.perf_counter() - start, time.process_time() - cpu


def _extracted(model: torch.nn.Module, loader: DataLoader, layers: list[str], reduce: str | None,
               shard_bytes: int) -> tuple[float, float]:
    """Return (wall s, CPU s of this process, writer thread included) of ``extract``."""
    with tempfile.TemporaryDirectory() as folder:
        start, cpu = time.perf_counter(), time.process_time()
        extract(model, loader, layers, Path(folder) / "s", reduce=reduce,
                shard_bytes=shard_bytes, progress=False)
        return time.perf_counter() - start, time.process_time() - cpu


def _compare(name: str, model: torch.nn.Module, loader: DataLoader, layers: list[str],
             reduce: str | None, shard_bytes: int, repeats: int) -> None:
    rows = len(loader.dataset)  # type: ignore[arg-type]
    bare, ours = [], []
    _bare(model, loader)  # warm-up
    for _ in range(repeats):  # interleaved, so load changes hit both alike
        bare.append(_bare(model, loader))
        ours.append(_extracted(model, loader, layers, reduce, shard_bytes))
    b, o = statistics.median(w for w, _ in bare), statistics.median(w for w, _ in ours)
    b_cpu, o_cpu = statistics.median(c for _, c in bare), statistics.median(c for _, c in ours)
    print(f"throughput  {name:44s} bare {rows / b:7.1f} rows/s  extract {rows / o:7.1f} rows/s  "
          f"ratio {b / o:.2f}x  (goal >= 0.9x); CPU-time ratio {b_cpu / o_cpu:.2f}x")


def throughput(n: int, repeats: int) -> None:
    from hookscope.zoo.models import load_model
    from tests.models import LeNet

    model = load_model("efficientnet-lite0").module
    photos = DataLoader(TensorDataset(_photos(n)), batch_size=16)
    _compare("efficientnet _blocks.15 + _fc, reduce=mean", model, photos, ["_blocks.15", "_fc"],
             "mean", 256 * 2**20, repeats)
    _compare("efficientnet _blocks.5 maps (125 KB/row)", model, photos, ["_blocks.5"], None,
             32 * 2**20, repeats)
    small = DataLoader(_Generated(40 * n), batch_size=64)
    _compare("LeNet conv1 maps (18 KB/row), disk-bound", LeNet().eval(), small, ["conv1"], None,
             32 * 2**20, repeats)


class _Generated(Dataset[torch.Tensor]):
    """Rows made on demand (seeded by index), so the data set itself takes no memory."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(i))


def _rss_child(rows: int, shard_bytes: int) -> None:
    from tests.models import LeNet

    with tempfile.TemporaryDirectory() as folder:
        store = extract(LeNet().eval(), _Generated(rows), ["conv2"], Path(folder) / "s",
                           batch_size=64, shard_bytes=shard_bytes, progress=False)
        written = store.nbytes
    print(json.dumps({"rows": rows, "peak_rss_mib": _peak_rss_kib() / 1024,
                      "written_mib": written / 2**20}))


def _peak_rss_kib() -> int:
    """Peak RSS of this process since it started (``VmHWM``: unlike ``ru_maxrss``, it does not
    count the pages of the parent this process was forked from before ``exec``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss(rows: int, shard_bytes: int) -> None:
    results = []
    for n in (rows, 10 * rows):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        done = subprocess.run([sys.executable, __file__, "--rss-child", str(n),
                               "--shard-bytes", str(shard_bytes)],
                              capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(done.stdout.splitlines()[-1]))
    small, large = results
    for r in results:
        print(f"peak RSS    {r['rows']:6d} rows ({r['written_mib']:6.1f} MiB stored, shards of "
              f"{shard_bytes / 2**20:.0f} MiB): {r['peak_rss_mib']:7.1f} MiB")
    print(f"peak RSS    10x rows / 1x rows: {large['peak_rss_mib'] / small['peak_rss_mib']:.3f}x  "
          f"(goal <= 1.10x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64, help="images for the throughput runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rss-rows", type=int, default=5000)
    parser.add_argument("--shard-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        _rss_child(args.rss_child, args.shard_bytes)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    peak_rss(args.rss_rows, args.shard_bytes)
    throughput(args.rows, args.repeats)


if __name__ == "__main__":
    main()
