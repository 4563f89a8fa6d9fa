"""Attacks with odd models (round 3): outputs a store cannot hold (complex, float8, uint32,
meta tensors) end in an ExtractError naming the dtype and the fix, with nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from hookscope.errors import ExtractError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from tests.models import FLOAT8


class _To(nn.Module):
    """Returns its input converted to ``dtype`` (a layer whose output dtype a store lacks)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_complex_output_is_named_by_its_kind_with_the_fix(tmp_path: Path, dtype: torch.dtype) -> None:
    model = nn.Sequential(_To(dtype))
    with pytest.raises(ExtractError, match=rf"cannot store '0': it is a complex tensor \[kind: "
                                           rf"complex, {dtype}\]; .*torch.view_as_real\(output\)"):
        extract(model, [torch.ones(2, 3)], "0", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() or os.listdir(tmp_path / "s") == []


@pytest.mark.parametrize(("dtype", "fix"), [
    *((dtype, r"dtype=torch.float32") for dtype in FLOAT8),
    (torch.uint32, r"output.to\(torch.int64\)"),
    (torch.uint16, r"output.to\(torch.int64\)")])
def test_an_output_dtype_a_store_cannot_hold_is_named_with_the_fix(
        tmp_path: Path, dtype: torch.dtype, fix: str) -> None:
    model = nn.Sequential(_To(dtype))
    with pytest.raises(ExtractError, match=rf"'0' returned {dtype}, which a store cannot hold "
                                           rf"\(it holds float64, .*bool\); .*{fix}"):
        extract(model, [torch.ones(2, 3)], "0", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() or os.listdir(tmp_path / "s") == []


@pytest.mark.parametrize("dtype", FLOAT8)
def test_a_floating_dtype_a_store_lacks_is_stored_when_converted(tmp_path: Path,
                                                                 dtype: torch.dtype) -> None:
    x = torch.tensor([[0.5, -2.0, 240.0, 0.1]])  # 240: inside every float8's range
    extract(nn.Sequential(_To(dtype)), [x], "0", tmp_path / "s", progress=False,
            dtype=torch.float32)
    stored = open_store(tmp_path / "s")["0"][:]
    assert stored.dtype == torch.float32 and torch.equal(stored, x.to(dtype).float())


def test_a_meta_output_is_refused_naming_the_fix(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 2, device="meta"))
    with pytest.raises(ExtractError, match=r"'0' returned a meta tensor .*which holds no values "
                                           r"to store; run the model on a real device"), \
            pytest.warns(RuntimeWarning, match="hold a meta tensor"):
        extract(model, [torch.ones(2, 3)], "0", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() or os.listdir(tmp_path / "s") == []


def test_stats_of_integer_and_bool_outputs_are_counted_not_skipped() -> None:
    from hookscope.diagnostics.statistics import stats
    x = torch.tensor([[1.6, -0.2, 3.7], [0.1, 2.9, -1.0]])
    model = nn.Sequential(_To(torch.int64), _To(torch.bool))
    result = stats(model, [x], layers=["0", "1"])
    ints = x.to(torch.int64)
    ints, bools = ints.double(), ints.to(torch.bool).double()  # layer 1 gets layer 0's ints
    assert int(result["0"].count) == 6 and int(result["1"].count) == 6
    torch.testing.assert_close(result["0"].mean, ints.mean())
    torch.testing.assert_close(result["1"].mean, bools.mean())
    assert float(result["0"].max) == 3.0 and float(result["1"].min) == 0.0


@pytest.mark.parametrize(("dtype", "message"), [
    (torch.complex64, r"cannot take statistics of '0': it is a complex tensor \[kind: complex, "
                      r"torch.complex64\]; select a module after it that returns its \.real"),
    (None, r"'0' returned a meta tensor .*which holds no values")])
def test_stats_of_complex_or_meta_outputs_are_refused(dtype: torch.dtype | None,
                                                      message: str) -> None:
    from hookscope.diagnostics.statistics import stats
    from hookscope.errors import HookscopeError
    model = nn.Sequential(_To(dtype) if dtype else nn.Linear(3, 2, device="meta"))
    with pytest.raises(HookscopeError, match=message):
        stats(model, [torch.ones(2, 3, device="meta" if dtype is None else "cpu")], layers="0")
