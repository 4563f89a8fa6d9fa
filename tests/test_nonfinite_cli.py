"""``hookscope nan``: exit codes and output, on a tiny model and on EfficientNet-Lite0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hookscope.cli.main import main


class LogHead(nn.Module):
    """Linear then log: NaN wherever the Linear's output is negative."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.act = nn.Sequential(nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)).log()


def test_nan_found_exits_1_and_names_the_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nan", "tests.test_nonfinite_cli:LogHead", "--input", "randn:5,4"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("first non-finite output: '(root)' (LogHead), call 0, forward "
                          "(first in op log)")
    assert "non-finite values start in '(root)' (LogHead)" in err


class SqrtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.sqrt(torch.relu(self.fc(x))))


def test_nan_backward_in_the_roots_own_forward_names_it_root_on_both_streams(
        capsys: pytest.CaptureFixture[str]) -> None:
    # finding 07: stderr said "start in '' (SqrtNet)" while stdout said "the root module"
    assert main(["nan", "tests.test_nonfinite_cli:SqrtNet", "--input", "randn:3,4",
                 "--backward"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("first non-finite gradient: '(root)' (SqrtNet), call 0, backward "
                          "(first in op SqrtBackward0)")
    assert "non-finite values start in '(root)' (SqrtNet)" in err


def test_nan_json_has_stable_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nan", "tests.test_nonfinite_cli:LogHead", "--input", "randn:5,4", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["path"], data["phase"], data["op"]) == ("", "forward", "log")
    assert [s["label"] for s in data["inputs"]] == ["args[0]"]


def test_nan_clean_model_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nan", "tests.models:LeNet", "--input", "randn:2,3,32,32", "--backward"]) == 0
    assert capsys.readouterr().out == ("no NaN or Inf: every module output and gradient is "
                                       "finite on randn:2,3,32,32\n")


@pytest.mark.slow
def test_nan_on_efficientnet_with_a_corrupt_batchnorm(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from hookscope.diagnostics.nonfinite import find_nonfinite
    from hookscope.zoo.inputs import load_inputs
    from hookscope.zoo.models import load_model

    loaded = load_model("efficientnet-lite0")
    assert find_nonfinite(loaded.module, *load_inputs(["sample:chelsea"], loaded).args) is None
    state = {k: v.contiguous() for k, v in loaded.module.state_dict().items()}
    state["_blocks.5._bn1.running_var"][7] = -1.0  # sqrt(var + eps) of a negative: NaN in channel 7
    save_file(state, str(tmp_path / "corrupt.safetensors"))
    assert main(["nan", f"efficientnet-lite0@{tmp_path / 'corrupt.safetensors'}",
                 "--input", "sample:chelsea"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first non-finite output: '_blocks.5._bn1' (BatchNorm2d), call 0, "
                          "forward (first in op batch_norm): 196 NaN/Inf in output, first at "
                          "[0, 7, 0, 0]")
    assert "in  args[0]: [1, 240, 14, 14] float32" in out
