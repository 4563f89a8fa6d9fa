"""The memory rows wait in during extraction (``store.writer.Staging``): its slabs are sized
from the first batch's rows, and preparing them starts no OpenMP team beside the forward pass."""

from __future__ import annotations

import gc
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


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="transparent huge pages are Linux's")
def test_slabs_are_huge_page_memory_that_outlives_its_mapping_object() -> None:
    """A slab is an anonymous mapping advised MADV_HUGEPAGE ("hg" in its VmFlags; 4x faster to
    copy rows into when fresh, here); the tensor alone keeps the mapping alive, and the rows
    copied in stay."""
    from hookscope.store.writer import _fresh, _touched

    slab = _touched(4 * MIB)
    assert slab.dtype == torch.uint8 and slab.shape == (4 * MIB,) and not slab.any()
    assert "hg" in _vm_flags(slab.data_ptr())
    rows = torch.randn(1024, 1024)
    slab.view(torch.float32).view(1024, 1024).copy_(rows)
    gc.collect()  # the mmap object has no name left but the tensor's
    assert "hg" in _vm_flags(slab.data_ptr())
    assert torch.equal(slab.view(torch.float32).view(1024, 1024), rows)
    assert _fresh(0).shape == (0,)  # no mapping of 0 bytes: torch's own allocation
