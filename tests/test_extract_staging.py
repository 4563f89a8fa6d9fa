"""The memory rows wait in during extraction (``store.writer.Staging``): its slabs are sized
from the first batch's rows, and preparing them starts no OpenMP team beside the forward pass."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import hookscope.store.extraction as extract_module
from hookscope.store import extract
from hookscope.store.writer import Staging
from tests.models import LeNet

MIB = 2**20


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_preparing_a_slab_starts_no_openmp_team() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _threads()
        staging = Staging(4 * MIB)  # its thread prepares one slab at once
        deadline = time.monotonic() + 10
        while staging.free.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        during = _threads()
        slab = staging.free.get_nowait()
        staging.close()
    finally:
        torch.set_num_threads(threads)
    # the staging thread alone: torch.zeros on it started an OpenMP team (one more thread at
    # 2 threads) that stayed as long as the thread and changed how the forward's threads wait
    assert during - before == 1
    assert slab.shape == (4 * MIB,) and slab.dtype == torch.uint8 and not slab.any()


@pytest.mark.parametrize(("layer", "batch", "row_bytes", "slab"), [
    ("fc2", 64, 10 * 4, MIB),  # tiny rows: 1 MiB, not the 16 MiB zeroed for any rows before
    ("conv2", 64, 16 * 10 * 10 * 4, 4 * 64 * (16 * 10 * 10 * 4 + 8)),  # four batches (+ @id)
    ("conv1", 256, 6 * 28 * 28 * 4, 16 * MIB)])  # four batches would be 18.4 MiB: capped
def test_slabs_hold_about_four_batches(layer: str, batch: int, row_bytes: int, slab: int,
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    original = extract_module.Staging

    def recording(nbytes: int) -> Any:
        sizes.append(nbytes)
        return original(nbytes)
    monkeypatch.setattr(extract_module, "Staging", recording)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2 * batch, 3, 32, 32))
    store = extract(LeNet().eval(), data, layer, tmp_path / "s", batch_size=batch, progress=False)
    assert sizes == [slab]
    assert store[layer][0:1].numel() * 4 == row_bytes and len(store) == 2 * batch
