"""The memory rows wait in during extraction (``store.writer.Staging``): its slabs are sized
from the first batch's rows, and preparing them starts no OpenMP team beside the forward pass."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import hookscope.store.shard_loop as shard_loop
from hookscope.store import extract
from hookscope.store.writer import ShardData, Staging
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
    original = shard_loop.Staging

    def recording(nbytes: int) -> Any:
        sizes.append(nbytes)
        return original(nbytes)
    monkeypatch.setattr(shard_loop, "Staging", recording)
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


_NO_TEAM = """
import os, numpy, torch
from hookscope.store.writer import ShardData, Staging
torch.set_num_threads(2)
rows = torch.empty(4 * 2**20)
rows.numpy()[:] = numpy.arange(4 * 2**20)  # made without a parallel torch op
rows = torch._lazy_clone(rows)
before = len(os.listdir("/proc/self/task"))
staging, shard = Staging(32 * 2**20), ShardData(batches=(0, 1))
kept = staging.keep(rows, shard)
print(before, len(os.listdir("/proc/self/task")), float(kept[-1]))
torch.ones(4 * 2**20).add_(1)  # a plain parallel op: the team this test must see start
print(len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_copying_rows_into_a_slab_starts_no_openmp_team() -> None:
    """Rows are copied into slabs on the forward pass's thread alone: one ``copy_`` of 16 MiB
    would start torch's OpenMP team, whose barrier waited on threads the writer preempted
    (copies of 256 MiB took up to 1.5 s beside it, 20 ms in pieces). Checked in a new process
    (this one may have its team already): the copy adds only the staging thread, a plain
    parallel op then adds the team."""
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _NO_TEAM], capture_output=True, text=True, env=env,
                          timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    before, after, last = lines[0].split()
    assert float(last) == 4 * 2**20 - 1
    assert int(after) == int(before) + 1  # the staging thread, no OpenMP worker
    assert int(lines[1]) > int(after)  # the team a parallel op starts (the check can fail)


@pytest.mark.hypothesis
@given(shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64,
                              torch.uint8, torch.bool]),
       offset=st.integers(0, 9), how=st.sampled_from(["plain", "lazy", "transposed", "sliced"]))
def test_a_kept_row_is_the_tensor_and_a_copy_on_write_capture_stays_one(
        shape: list[int], dtype: torch.dtype, offset: int, how: str) -> None:
    """``Staging.keep`` (``_serial_copy``: 8-byte words where the bytes allow, single bytes or
    one ``copy_`` else) gives back the tensor exactly, whatever its size, dtype, storage offset
    or strides, and reads a copy-on-write capture without making it a copy of its own."""
    n = int(torch.tensor(shape).prod())
    base = (torch.arange(n + offset) % 251).to(dtype)[offset:].reshape(shape)
    t = {"plain": base, "lazy": torch._lazy_clone(base), "transposed": base.transpose(0, -1),
         "sliced": base[..., ::2]}[how]
    staging = Staging(2**20)
    try:
        kept = staging.keep(t, ShardData(batches=(0, 1)))
        assert kept.dtype == t.dtype and kept.shape == t.shape and torch.equal(kept, t)
        if how == "lazy":
            assert torch._C._is_cow_tensor(t)
    finally:
        staging.close()
