"""The ``extraction`` workload: ``hookscope.extract`` against the bare forward loop over the same
batches (issue 21: one mean-pooled efficientnet-lite0 layer at most 1.03x; a LeNet-sized model
at least 0.95x the bare loop's throughput, i.e. at most 1/0.95 = 1.053x its time, on its
``conv2`` maps, 6,400 bytes a row; LeNet's ``fc1``, 480 bytes a row, shows what is left without
the bytes: the capture and the per-call set-up).

Each pair runs over one ``DataLoader`` (not shuffled, no workers): the bare loop calls the model
on each batch in eval mode under ``torch.no_grad()`` (inside the worker's grad mode, as extract
runs), and ``extract`` stores the layer's rows into a fresh temporary folder per round. The clock
is wall time (``time.perf_counter``, the benchmark's clock): ``extract`` returns once its writer
thread has put the last shard on disk, so the writing is inside the case's time; removing the
folder happens after the clock stops (the folder goes with the case's result).
``python bench/extract.py`` measures the same with CPU time too, and peak RSS.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench import models
from bench.peers import Case

Tensor = torch.Tensor
EFFICIENTNET_LAYER = "_blocks.1"
LENET_LAYER = "conv2"
EFFICIENTNET_BARE = "efficientnet-lite0 bare loop"
LENET_BARE = "LeNet bare loop"


def bare_loop(model: nn.Module, loader: DataLoader) -> None:
    """The floor: the model over every batch of ``loader``, eval mode, ``torch.no_grad()``."""
    with torch.no_grad():
        for (x,) in loader:
            model(x)


def extract_case(model: nn.Module, loader: DataLoader, layer: str, reduce: str | None, *,
                 name: str, floor: str) -> Case:
    """``hookscope.extract(model, loader, layer, fresh folder, reduce=reduce)``; the run returns
    the ``TemporaryDirectory`` holding the store (removed when the result is dropped)."""
    import hookscope

    def run() -> tempfile.TemporaryDirectory[str]:
        folder = tempfile.TemporaryDirectory(prefix="bench-extract-")
        hookscope.extract(model, loader, layer, f"{folder.name}/store", reduce=reduce,
                          progress=False)
        return folder

    return Case(name, "hookscope", run, lambda kept: (), floor=floor,
                note="wall time; the writer thread's writing included")


def loaders(size: models.Size) -> tuple[DataLoader, DataLoader]:
    """``(photos, rows)``: 4 batches of ``size.photos`` scikit-image photos (repeated), and
    LeNet rows ``(3, 32, 32)`` float32 (seed 0), 4096 in batches of 256 (256 in 64 for quick)."""
    photos = models.photos(size).repeat(4, 1, 1, 1)
    n, batch = (4096, 256) if size == models.FULL else (256, 64)
    rows = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return (DataLoader(TensorDataset(photos), batch_size=size.photos),
            DataLoader(TensorDataset(rows), batch_size=batch))


def cases(size: models.Size) -> tuple[list[Case], dict[str, Any]]:
    """Both pairs, bare loop first; info for the table."""
    efficientnet, lenet = models.efficientnet(), models.lenet()
    photos, rows = loaders(size)
    cases = [
        Case(EFFICIENTNET_BARE, "bare", lambda: bare_loop(efficientnet, photos), lambda kept: ()),
        extract_case(efficientnet, photos, EFFICIENTNET_LAYER, "mean", floor=EFFICIENTNET_BARE,
                     name=f"hookscope extract efficientnet {EFFICIENTNET_LAYER}, reduce='mean'"),
        Case(LENET_BARE, "bare", lambda: bare_loop(lenet, rows), lambda kept: (), floor=LENET_BARE),
        extract_case(lenet, rows, LENET_LAYER, None, floor=LENET_BARE,
                     name=f"hookscope extract LeNet {LENET_LAYER} (whole maps)"),
        extract_case(lenet, rows, "fc1", None, floor=LENET_BARE,
                     name="LeNet fc1 (120 floats a row): extract's cost without the bytes")]
    info = {"photos": f"{len(photos.dataset)} in batches of {photos.batch_size}",  # type: ignore[arg-type]
            "LeNet rows": f"{len(rows.dataset)} in batches of {rows.batch_size}",  # type: ignore[arg-type]
            "LeNet row bytes": 16 * 10 * 10 * 4}
    return cases, info
