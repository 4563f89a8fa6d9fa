"""hookscope.monitor under torchrun: two gloo ranks on CPU, DDP, a division by zero on rank 1
only (tests/ddp_monitor_worker.py): each rank guards its own step and says which rank it is."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.cli.main import main
from tests.ddp_monitor_worker import ZERO_AT
from tests.models import Temperature

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


def torchrun(run_dir: Path, guard: str) -> list[dict]:
    """Run the worker on 2 ranks; return each rank's outcome."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "ddp_monitor_worker.py"), str(run_dir), guard],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((run_dir / f"outcome-rank{r}.json").read_text()) for r in (0, 1)]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this python")
def test_rank_one_names_its_module_and_rank_zero_names_the_all_reduce(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torchrun(tmp_path, "raise")
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # one file per rank, no collision
        f"nonfinite-step-{ZERO_AT}-rank1.safetensors", "outcome-rank0.json", "outcome-rank1.json",
        "records-rank0.jsonl", "records-rank1.jsonl"]
    ranks = [lines(tmp_path / f"records-rank{r}.jsonl") for r in (0, 1)]
    events = [[r for r in records if r.get("event") == "nonfinite"] for records in ranks]
    assert events[1] == [{"event": "nonfinite", "step": ZERO_AT, "rank": 1, "module": "2",
                          "class": "Temperature", "call": 0, "direction": "forward", "op": "div",
                          "tensor": "output", "parameters": [],
                          "bundle": str(tmp_path / f"nonfinite-step-{ZERO_AT}-rank1.safetensors")}]
    assert events[0] == [{"event": "nonfinite", "step": ZERO_AT, "rank": 0, "module": None,
                          "class": None, "call": None, "direction": "all-reduce", "op": None,
                          "tensor": None, "parameters": [], "bundle": None}]
    raised = [json.loads((tmp_path / f"outcome-rank{r}.json").read_text())["raised"] for r in (0, 1)]
    assert [r["step"] for r in raised] == [ZERO_AT, ZERO_AT]  # both stop before the NaN update
    assert raised[1]["message"].startswith(
        f"step {ZERO_AT} (rank 1): first non-finite output: '2' (Temperature), call 0, forward")
    assert raised[0]["message"].startswith(
        f"step {ZERO_AT} (rank 0): this rank's forward and backward were finite")

    # each rank's own activations, the same all-reduced gradients and update
    stats = [{(r["step"], r["module"]): r for r in records if "event" not in r} for records in ranks]
    assert stats[0].keys() == stats[1].keys() == {(s, m) for s in (0, 2) for m in ("0", "2")}
    for key in stats[0]:
        assert stats[0][key]["activation"]["mean"] != stats[1][key]["activation"]["mean"]
        if key[1] == "0":
            assert stats[0][key]["grad_norm"] == pytest.approx(stats[1][key]["grad_norm"], rel=1e-6)
            assert stats[0][key]["update_ratio"] == pytest.approx(stats[1][key]["update_ratio"], rel=1e-6)

    assert main(["monitor-report", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"step {ZERO_AT} (rank 0): non-finite gradients from another rank's step (DDP all-reduce)",
        f"step {ZERO_AT} (rank 1): non-finite forward in '2' (Temperature), call 0, op div, output"]

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Temperature(), nn.Linear(8, 2))
    model[2].temperature = 0.0  # the bundle holds inputs and weights, not this attribute
    assert hookscope.replay(tmp_path / f"nonfinite-step-{ZERO_AT}-rank1.safetensors", model).path == "2"
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this python")
def test_skip_drops_the_step_on_every_rank(tmp_path: Path) -> None:
    """guard="skip": rank 1 drops its gradients at the end of its backward, and again after the
    all-reduce refilled them; rank 0 drops the all-reduced ones: no NaN update anywhere."""
    outcomes = torchrun(tmp_path, "skip")
    assert [o["raised"] for o in outcomes] == [None, None]
    assert math.isfinite(outcomes[0]["weights"])
    assert outcomes[0]["weights"] == pytest.approx(outcomes[1]["weights"], rel=1e-6)  # in step
    events = [[(r["step"], r["module"], r["direction"]) for r in lines(tmp_path / f"records-rank{r}.jsonl")
               if r.get("event") == "nonfinite"] for r in (0, 1)]
    assert events == [[(ZERO_AT, None, "all-reduce")], [(ZERO_AT, "2", "forward")]]
