"""``hookscope diff``: table, JSON, exit codes; EfficientNet-Lite0 in float32 against bfloat16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hookscope.cli.main import main
from tests.models import LeNet

MODEL = "tests.test_compare_cli:seeded_lenet"


def seeded_lenet() -> LeNet:
    """LeNet with the same weights on every call (a model factory for the specs below)."""
    torch.manual_seed(0)
    return LeNet()


def test_same_model_twice_is_all_close(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", MODEL, MODEL, "--input",
                 "randn:2,3,32,32"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["path", "call", "shape", "max_abs", "rel", "cosine", "close"]
    assert [line.split()[:2] for line in lines[1:]] == [
        ["conv1", "0"], ["pool", "0"], ["conv2", "0"], ["pool", "1"], ["fc1", "0"], ["fc2", "0"],
        ["(output)", "0"]]
    assert "all 7 compared calls within atol=1e-05, rtol=0.0001" in err


def test_perturbed_checkpoint_names_the_layer(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    state = seeded_lenet().state_dict()
    state["fc1.bias"] = state["fc1.bias"] + 0.01
    save_file(state, str(tmp_path / "b.safetensors"))
    assert main(["diff", MODEL, f"{MODEL}@{tmp_path / 'b.safetensors'}", "--input",
                 "randn:2,3,32,32", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_divergent"] == "fc1"
    fc1 = next(row for row in data["rows"] if row["path"] == "fc1")
    assert fc1["max_abs"] == pytest.approx(0.01, rel=1e-4) and fc1["close"] is False


@pytest.mark.slow
def test_efficientnet_float32_against_bfloat16(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", "efficientnet-lite0", "efficientnet-lite0@bf16", "--input",
                 "sample:chelsea", "--layers", "_blocks.*"]) == 1
    out, err = capsys.readouterr()
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == [f"_blocks.{i}" for i in range(16)] + ["(output)"]
    assert rows[0][2] == "1x16x112x112" and rows[-1][2] == "1x1000"
    assert all(0.999 < float(r[5]) < 1.0 for r in rows)  # cosine
    assert all(0.005 < float(r[4]) < 0.06 for r in rows)  # rel: bfloat16 keeps 8 bits
    assert "first divergent: _blocks.0, call 0" in err
