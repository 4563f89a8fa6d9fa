"""``hookscope stats``: batches, per-channel rows and JSON against the library call."""

from __future__ import annotations

import json

import pytest
import torch

from hookscope.cli.main import main
from hookscope.diagnostics.statistics import stats
from hookscope.zoo.inputs import load_inputs
from hookscope.zoo.models import load_model


def test_stats_json_equals_library_over_the_same_batches(capsys: pytest.CaptureFixture[str]) -> None:
    specs = ["randn:2,3,32,32", "randn:3,3,32,32"]
    torch.manual_seed(0)
    assert main(["stats", "tests.models:LeNet", "--layers", "conv2", "--layers", "fc1",
                 "--batch-size", "1", "--json", *[a for s in specs for a in ("--input", s)]]) == 0
    data = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    loaded = load_model("tests.models:LeNet")
    batches = [load_inputs([s], loaded).args for s in specs]
    expected = stats(loaded.module, batches, layers=["conv2", "fc1"])
    assert list(data) == ["conv2", "fc1"]
    assert data["conv2"] == pytest.approx(expected["conv2"].as_dict(), rel=1e-12)
    assert data["conv2"]["count"] == 5 * 16 * 10 * 10


def test_stats_per_channel_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "tests.models:LeNet", "--layers", "conv1", "--per-channel",
                 "--input", "randn:2,3,32,32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["path", "channel", "count"]
    assert [line.split()[:3] for line in lines[1:]] == [["conv1", str(c), str(2 * 28 * 28)]
                                                        for c in range(6)]
