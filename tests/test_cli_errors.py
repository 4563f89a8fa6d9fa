"""Mistakes a new user made with the command line (fresh-reader run): each one is a clear
one-paragraph error or the right result, never a traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import hookscope
from hookscope.cli.main import main

MODEL_FILE = textwrap.dedent('''
    from dataclasses import dataclass
    import torch
    from torch import nn

    @dataclass
    class Config:
        width: int = 4

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(Config().width, 2)
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.fc(x))    # (batch, 2) into Linear(3, 2): shapes do not fit

    def build():
        return Broken()

    def build_ok():
        return nn.Sequential(nn.Linear(Config().width, 3), nn.ReLU(), nn.Linear(3, 2))
''')


@pytest.fixture()
def model_file(tmp_path: Path) -> Path:
    file = tmp_path / "mymodels.py"
    file.write_text(MODEL_FILE)
    return file


def test_model_error_is_one_paragraph_naming_the_module(model_file: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["capture", f"{model_file}:build", "--layers", "fc", "--input", "randn:2,4"])
    err = capsys.readouterr().err
    assert code == 1
    assert "error: the model failed on input randn:2,4: RuntimeError: mat1 and mat2 shapes cannot" in err
    assert "hookscope: raised inside 'head' (Linear) called with input shapes [(2, 2)]" in err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(model_file: Path) -> None:
    with pytest.raises(hookscope.HookscopeError, match="cannot be multiplied"):
        main(["--debug", "capture", f"{model_file}:build", "--layers", "fc", "--input", "randn:2,4"])


def test_save_creates_missing_folders_with_parents_and_wants_safetensors(
        model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "new" / "deeper" / "acts.safetensors"
    argv = ["capture", f"{model_file}:build_ok", "--layers", "0", "--input", "randn:2,4",
            "--save", str(target)]
    assert main(argv) == 2
    assert "pass --parents" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert main([*argv, "--parents"]) == 0
    assert list(hookscope.load(target)) == ["0"]
    assert main(["capture", f"{model_file}:build_ok", "--layers", "0", "--input", "randn:2,4",
                 "--save", str(tmp_path / "acts.pt")]) == 2
    assert "name it *.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "acts.pt").exists()


def test_several_inputs_after_one_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "efficientnet-lite0", "--layers", "_fc", "--input", "sample:chelsea",
                 "sample:astronaut", "--json"]) == 0
    assert '"shape": [\n        2,\n        1000\n      ]' in capsys.readouterr().out


def test_diff_of_an_image_model_and_a_text_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", "efficientnet-lite0", "minilm", "--input", "sample:chelsea"]) == 2
    assert "takes image inputs but 'minilm' takes text inputs" in capsys.readouterr().err


def test_gradcam_layer_is_checked_before_anything_runs(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    plots = tmp_path / "plots"
    code = main(["capture", "efficientnet-lite0", "--layers", "_fc", "--input", "sample:chelsea",
                 "--plot", str(plots), "--gradcam", "_blocks"])
    assert code == 2 and "select '_blocks.*'" in capsys.readouterr().err
    assert not plots.exists()
    assert main(["capture", "efficientnet-lite0", "--layers", "_fc", "--input", "sample:chelsea",
                 "--gradcam", "_conv_head"]) == 2
    assert "give --plot DIR too" in capsys.readouterr().err


def test_stats_of_token_outputs_ignore_padding(capsys: pytest.CaptureFixture[str]) -> None:
    tables = []
    for batch_size in ("1", "2"):
        assert main(["stats", "minilm", "--input", "one sentence", "two sentences here",
                     "--layers", "encoder.layer.5", "--batch-size", batch_size]) == 0
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]
    assert " 3456 " in tables[0]  # 9 real tokens x 384 features: no padding counted


def test_unwritable_output_is_an_error_line(model_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["capture", f"{model_file}:build_ok", "--layers", "0", "--input", "randn:2,4",
                 "--plot", "/proc/hookscope-cannot-write-here"])
    err = capsys.readouterr().err
    assert code == 1 and "error: " in err and "/proc/hookscope-cannot-write-here" in err
    assert "Traceback" not in err
