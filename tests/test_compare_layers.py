"""compare(): per-layer differences between two runs, and the first layer that diverges."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from hookscope.diagnostics.comparison import Comparison, compare
from hookscope.errors import SelectorError
from tests.models import InplaceRelu, LeNet
from tests.reference import plain_capture


def _order(comparison: Comparison) -> list[tuple[str, int]]:
    return [(d.path, d.call_index) for d in comparison.diffs]


def test_perturbed_weight_diverges_first_at_exactly_that_layer() -> None:
    model_a = LeNet().eval()
    model_b = copy.deepcopy(model_a)
    with torch.no_grad():
        model_b.conv2.weight[3] += 1e-3
    x = torch.randn(2, 3, 32, 32)
    result = compare(model_a, model_b, x)
    assert _order(result) == [("conv1", 0), ("pool", 0), ("conv2", 0), ("pool", 1), ("fc1", 0),
                              ("fc2", 0), ("", 0)]
    assert result.first_divergent is not None and result.first_divergent.path == "conv2"
    assert [d.max_abs for d in result.diffs[:2]] == [0.0, 0.0]
    assert all(not d.close for d in result.diffs[2:])
    a = plain_capture(model_a, ["conv2"], x, grad_enabled=False)["conv2"][0].double()
    b = plain_capture(model_b, ["conv2"], x, grad_enabled=False)["conv2"][0].double()
    conv2 = result["conv2"]
    assert conv2.max_abs == pytest.approx(float((a - b).abs().max()), rel=1e-12)
    assert conv2.rel == pytest.approx(float((a - b).norm() / a.norm()), rel=1e-12)
    cosine = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
    assert conv2.cosine == pytest.approx(cosine, rel=1e-12)
    assert conv2.shape == (2, 16, 10, 10) and result.unmatched == ()


def test_model_against_itself_is_exactly_equal() -> None:
    model = LeNet().eval()
    result = compare(model, model, torch.randn(2, 3, 32, 32))
    assert result.first_divergent is None
    assert all(d.max_abs == 0.0 and d.rel == 0.0 and d.cosine == pytest.approx(1.0, abs=1e-12)
               for d in result.diffs)


def test_model_against_its_bfloat16_copy() -> None:
    model = LeNet().eval()
    x = torch.randn(2, 3, 32, 32)  # float32: cast to bfloat16 for the copy by compare itself
    result = compare(model, copy.deepcopy(model).to(torch.bfloat16), x, layers="conv*")
    assert _order(result) == [("conv1", 0), ("conv2", 0), ("", 0)]
    assert result.first_divergent is not None and result.first_divergent.path == "conv1"
    for diff in result.diffs:
        assert 0 < diff.max_abs < 0.1 and 0 < diff.rel < 2 ** -6 and diff.cosine > 0.9999
    loose = compare(model, copy.deepcopy(model).to(torch.bfloat16), x, layers="conv*",
                    atol=0.05, rtol=0.05)
    assert loose.first_divergent is None


def test_outputs_written_in_place_later_are_compared_as_returned() -> None:
    model = InplaceRelu().eval()  # conv's output is overwritten by ReLU(inplace=True)
    result = compare(model, copy.deepcopy(model), torch.randn(2, 3, 6, 6), layers=["conv", "bn"])
    assert result.first_divergent is None and result["conv"].max_abs == 0.0


class Switch(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.extra = extra
        self.body = nn.Linear(3, 3)
        self.aux = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.aux(h) if self.extra else h


def test_calls_made_by_one_run_only_are_listed() -> None:
    model_a = Switch(extra=False)
    model_b = copy.deepcopy(model_a)
    model_b.extra = True
    result = compare(model_a, model_b, torch.randn(2, 3))
    assert result.unmatched == ("aux:0",)
    assert result["body"].close and not result[""].close


def test_different_shapes_count_as_divergent() -> None:
    result = compare(nn.Sequential(nn.Linear(3, 4)), nn.Sequential(nn.Linear(3, 5)),
                     torch.randn(2, 3))
    first = result.first_divergent
    assert first is not None and first.path == "0"
    assert (first.max_abs, first.close, math.isnan(first.cosine)) == (math.inf, False, True)


def test_nan_in_one_run_diverges_with_nan_cosine() -> None:
    model_a = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model_b = copy.deepcopy(model_a)
    with torch.no_grad():
        model_b[0].bias[1] = math.nan
    first = compare(model_a, model_b, torch.randn(2, 3)).first_divergent
    assert first is not None and first.path == "0"
    assert first.max_abs == math.inf and math.isnan(first.cosine) and not first.close


def test_unknown_layer_is_a_selector_error() -> None:
    model = LeNet()
    with pytest.raises(SelectorError, match="did you mean 'conv2'"):
        compare(model, model, torch.randn(1, 3, 32, 32), layers="conv_2")
