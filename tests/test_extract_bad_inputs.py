"""Every bad argument of ``extract`` / ``hookscope extract`` is a clean error naming it, raised
before anything runs or is written (issue 26)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.cli.main import main
from hookscope.errors import ExtractError
from hookscope.store.extraction import extract

DATA = TensorDataset(torch.zeros(4, 2))


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calls = nn.Linear(2, 2), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


BAD: dict[str, tuple[Any, str]] = {  # argument -> (bad value, what the message says it must be)
    "dtype": ("half", r"None or a floating torch.dtype"),
    "batch_size": (0, r"a positive int"),
    "shard_bytes": (True, r"a positive int"),
    "shard_seconds": ("60", r"a positive number of seconds"),
    "resume": ("yes", r"True or False"),
    "overwrite": (1, r"True or False"),
    "progress": ("no", r"True or False"),
    "early_stop": (None, r"True or False"),
    "model_spec": (3, r"None or a str"),
}


@pytest.mark.parametrize("name", sorted(BAD) + ["dtype=int8", "out", "model"])
def test_a_bad_argument_is_named_before_anything_runs(tmp_path: Path, name: str) -> None:
    model, out = _Counting(), tmp_path / "store"
    args: dict[str, Any] = {"progress": False}
    if name in BAD:
        args[name], want = BAD[name]
    elif name == "dtype=int8":
        name, want = "dtype", r"None or a floating torch.dtype"
        args["dtype"] = torch.int8
    else:
        want = {"out": r"a folder path", "model": r"an nn.Module"}[name]
    given = {"model": model, "out": out}
    if name in given:
        given[name] = None
    with pytest.raises(ExtractError, match=rf"^extract\({name}=.*\): {name} must be {want}"):
        extract(given["model"], DATA, "fc", given["out"], **args)
    assert model.calls == 0 and not out.exists()


def test_a_reduce_returning_no_tensor_is_named(tmp_path: Path) -> None:
    with pytest.raises(ExtractError, match=r"reduce function <lambda> returned a NoneType for an "
                                           r"output of shape \(\d+, \d+\); it must return a tensor"):
        extract(_Counting(), DATA, "fc", tmp_path / "store", reduce=lambda t: None,
                progress=False)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(("device", "said"), [("nonsense", "is not a device"),
                                              ("cuda:7", "CUDA device")])
def test_cli_bad_device_is_a_usage_error(tmp_path: Path, device: str, said: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "x.pt"
    torch.save(torch.zeros(4, 2), data)
    with pytest.raises(SystemExit) as exited:
        main(["extract", "tests.models:mlp", "--data", str(data), "--layers", "fc1", "--out",
              str(tmp_path / "store"), "--device", device])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--device" in err and said in err
    assert not (tmp_path / "store").exists()
