"""Attacks on saved records (round 3): a safetensors file whose ``hookscope.calls`` metadata is
damaged or foreign, and a capture of meta tensors, end in a HookscopeError, never a raw
TypeError / RecursionError / JSONDecodeError / NotImplementedError."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hookscope
from hookscope.errors import HookscopeError


@pytest.mark.parametrize("calls", ["5", "[" * 5000 + "]" * 5000, "not json", '{"a": "2"}',
                                   '["a"]', '{"a": true}'])
def test_damaged_calls_metadata_is_named(tmp_path: Path, calls: str) -> None:
    file = tmp_path / "r.safetensors"
    save_file({"a": torch.ones(2)}, str(file), metadata={"hookscope.calls": calls})
    with pytest.raises(HookscopeError, match=r"hookscope.calls metadata is not \{record name: "
                                             r"calls\}.*safetensors.torch.load_file"):
        hookscope.load(file)


def test_intact_calls_metadata_reads_back(tmp_path: Path) -> None:
    file = tmp_path / "r.safetensors"
    save_file({"a": torch.arange(3.0)}, str(file), metadata={"hookscope.calls": '{"a": 1}'})
    assert torch.equal(hookscope.load(file)["a"], torch.arange(3.0))


def test_saving_a_capture_of_meta_tensors_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 2, device="meta"))
    with pytest.warns(RuntimeWarning, match="hold a meta tensor"), hookscope.capture(model, "0") as acts:
        model(torch.ones(1, 3, device="meta"))
    with pytest.raises(HookscopeError, match=r"'0' returned a meta tensor .*no values to save"):
        acts.save(tmp_path / "r.safetensors")
    assert not list(tmp_path.iterdir())
