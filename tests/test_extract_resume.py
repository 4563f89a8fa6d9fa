"""Crash safety: a real extraction killed with SIGKILL, then resumed, equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from hookscope.store.reader import open_store

ROOT = Path(__file__).resolve().parents[1]

# A token model over a slow data set (a sleep per item, like a slow disk), 96 rows in batches of 4
# and shards of about one batch: layer "mix" is ragged (tokens), "head" fixed.
SCRIPT = """
import sys, time
import torch
from torch import nn
from torch.utils.data import Dataset
from hookscope.store.extraction import extract

class Tokens(Dataset):
    def __init__(self, delay_s):
        self.delay_s = delay_s
    def __len__(self):
        return 96
    def __getitem__(self, i):
        time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(i)
        mask = (torch.arange(8) < 1 + i % 7).long()
        return {"input_ids": torch.randint(1, 50, (8,), generator=g) * mask, "attention_mask": mask}

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 3)
    def forward(self, input_ids, attention_mask):
        hidden = self.mix(self.embed(input_ids)) * attention_mask[..., None]
        return self.head(hidden.sum(dim=1))

torch.manual_seed(0)
out, delay_s, resume = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "resume"
extract(Encoder(), Tokens(delay_s), ["mix", "head"], out, batch_size=4, shard_bytes=600,
        resume=resume, progress=False)
"""


def _run(out: Path, delay_s: float, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(out), str(delay_s), mode], env=env,
                            stderr=subprocess.PIPE)


def _shards_listed(out: Path) -> list[dict[str, object]]:
    try:
        return json.loads((out / "manifest.json").read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return []


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    reference = _run(tmp_path / "reference", 0.0, "fresh")
    crashed_out = tmp_path / "crashed"
    crashing = _run(crashed_out, 0.03, "fresh")
    deadline = time.monotonic() + 60
    while len(_shards_listed(crashed_out)) < 3:
        assert crashing.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no shard appeared within 60 s"
        time.sleep(0.01)
    crashing.send_signal(signal.SIGKILL)
    crashing.wait()
    assert crashing.returncode == -signal.SIGKILL

    before = json.loads((crashed_out / "manifest.json").read_text())
    assert not before["complete"] and 0 < before["rows"] < 96
    kept = {s["file"]: (crashed_out / s["file"]).read_bytes() for s in before["shards"]}

    resumed = _run(crashed_out, 0.0, "resume")
    for process in (resumed, reference):
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr.decode()

    ref, got = open_store(tmp_path / "reference"), open_store(crashed_out)
    got.verify()
    assert len(got) == len(ref) == 96 and got.layers == ref.layers
    assert torch.equal(got["head"][:], ref["head"][:])
    ref_rows, got_rows = ref["mix"][:], got["mix"][:]
    assert [len(r) for r in got_rows] == [1 + i % 7 for i in range(96)]
    assert all(torch.equal(a, b) for a, b in zip(got_rows, ref_rows))
    # the shards finished before the kill were kept, not recomputed
    assert all((crashed_out / name).read_bytes() == data for name, data in kept.items())
    assert not [p for p in crashed_out.iterdir() if p.name.startswith(".")]
