"""torchrun: two ranks (gloo, CPU) write one store whose rows equal a single-process run's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hookscope.cli.main import main
from hookscope.store.reader import open_store
from tests.models import MlpStack

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this python")
def test_two_ranks_equal_one_process_row_for_row(tmp_path: Path) -> None:
    weights, rows = tmp_path / "mlp.safetensors", tmp_path / "rows.pt"
    save_file(MlpStack().state_dict(), str(weights))  # both ranks load the same weights
    torch.save(torch.randn(43, 10), rows)  # 11 batches of 4: ranks take 5 and 6 batches
    spec = f"tests.models:MlpStack@{weights}"
    args = ["extract", spec, "--data", str(rows), "--layers", "fc1", "--layers", "fc2",
            "--batch-size", "4", "--shard-bytes", "600", "--no-progress"]
    # Both sides run with one thread: torchrun would set OMP_NUM_THREADS=1 for its ranks anyway,
    # and a bitwise comparison only holds between runs of the same kernels on the same threads.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "hookscope",
                           *args, "--out", str(tmp_path / "ranks")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*args, "--out", str(tmp_path / "single")]) == 0
    finally:
        torch.set_num_threads(threads)

    ranks, single = open_store(tmp_path / "ranks"), open_store(tmp_path / "single")
    files = [s.file for s in ranks.shards]
    assert {f[:11] for f in files} == {"shard-r0000", "shard-r0001"}  # each rank wrote its own
    assert json.loads((tmp_path / "ranks" / "manifest.json").read_text())["world_size"] == 2
    assert len(ranks) == len(single) == 43
    for layer in ("fc1", "fc2"):
        assert torch.equal(ranks[layer][:], single[layer][:])
    assert torch.equal(ranks.ids, torch.arange(43)) and torch.equal(single.ids, torch.arange(43))
    assert [s.rows for s in ranks.shards][-1][1] == 43
    ranks.verify()
    assert not list((tmp_path / "ranks").glob("manifest-r*.json"))
