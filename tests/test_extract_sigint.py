"""Ctrl-C during `hookscope extract` (a real process, a real SIGINT): the rows of the open shard
are written, the exact resume command is printed, and running it gives the rows (and ids) of an
uninterrupted run, bitwise."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import torch

from hookscope.store.reader import open_store

ROOT = Path(__file__).resolve().parents[1]

# The model signals its own process during its Nth forward (deterministic: no timing), when
# SIGINT_AT=N is set; weights are seeded, so every process builds the same model.
FACTORY = """
import os, signal
import torch
from torch import nn

class Signalling(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.calls, self.at = 0, int(os.environ.get("SIGINT_AT", "0"))
    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return self.fc2(torch.relu(self.fc1(x)))

def build():
    return Signalling()
"""


def _hookscope(args: list[str], sigint_at: int = 0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SIGINT_AT": str(sigint_at),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    # a shell's background job ignores SIGINT, and a child inherits that: take Python's default
    return subprocess.run([sys.executable, "-m", "hookscope", *args], env=env, text=True,
                          capture_output=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_sigint_keeps_the_open_shard_and_the_printed_resume_command_finishes_it(
        tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(FACTORY)
    torch.save(torch.randn(30, 6, generator=torch.Generator().manual_seed(1)), tmp_path / "x.pt")
    args = [f"{tmp_path / 'model.py'}:build", "--data", str(tmp_path / "x.pt"), "--layers", "fc1",
            "fc2", "--batch-size", "4", "--no-progress"]
    done = _hookscope(["extract", *args, "--out", str(tmp_path / "ref")])
    assert done.returncode == 0, done.stderr

    out = tmp_path / "stopped"
    stopped = _hookscope(["extract", *args, "--out", str(out)], sigint_at=3)  # in batch 2
    assert stopped.returncode == 130, stderr_tail(stopped)
    lines = stopped.stderr.splitlines()
    assert f"interrupted: 12 rows kept in {out} (the open shard's included); resume with:" in lines
    command = lines[lines.index(next(x for x in lines if x.startswith("interrupted: 12"))) + 1]
    assert command.startswith("  hookscope extract ") and command.endswith(" --resume")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == 12 and not manifest["complete"]  # batches 0..2, one open shard
    assert [s["batches"] for s in manifest["shards"]] == [[0, 3]]

    resumed = _hookscope(shlex.split(command)[1:])
    assert resumed.returncode == 0, resumed.stderr
    ref, got = open_store(tmp_path / "ref"), open_store(out)
    got.verify()
    assert len(got) == len(ref) == 30
    for layer in ("fc1", "fc2"):
        assert torch.equal(got[layer][:], ref[layer][:])
    assert torch.equal(got.ids, ref.ids) and torch.equal(got.ids, torch.arange(30))


def stderr_tail(done: subprocess.CompletedProcess[str]) -> str:
    return done.stderr[-2000:]
