"""find_nonfinite in the forward pass: the exact module where NaN/Inf first appears."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hookscope.diagnostics.nonfinite import NonFiniteOrigin, find_nonfinite
from tests.models import LeNet, SharedLinear


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Ratio(nn.Module):
    """x / (x - x): 0/0 = NaN everywhere, x/0 = +-Inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x - x)


class Block(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = act
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.lin(x)))


class FunctionalLog(nn.Module):
    """The NaN comes from the parent's own code between two children."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x).log())


def _model(act: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), Block(act), nn.Softmax(-1))


def test_log_of_negative_is_found_in_the_leaf_not_its_parents() -> None:
    model = _model(Log())
    x = torch.randn(3, 4)
    plain = model[2].lin(model[1](model[0](x)))
    assert (plain < 0).any()  # the premise: log sees negative numbers
    found = find_nonfinite(model, x)
    assert isinstance(found, NonFiniteOrigin)
    assert (found.path, found.class_name, found.call_index, found.phase, found.op) == (
        "2.act", "Log", 0, "forward", "log")
    expected_bad = torch.nonzero(plain < 0).tolist()
    assert found.bad_count == len(expected_bad)
    assert [list(p) for p in found.first_bad] == expected_bad[:8]
    assert found.bad_label == "output" and found.outputs[0].nan == len(expected_bad)
    (inp,) = found.inputs
    assert inp.label == "args[0]" and inp.nonfinite == 0
    assert inp.min == pytest.approx(float(plain.detach().min()))
    assert inp.max == pytest.approx(float(plain.detach().max()))
    assert "'2.act' (Log), call 0, forward (first in op log)" in str(found)


def test_division_by_zero() -> None:
    found = find_nonfinite(_model(Ratio()), torch.randn(3, 4))
    assert found is not None and (found.path, found.op) == ("2.act", "div")
    assert found.bad_count == 12  # 3 x 4, every element 0/0 or x/0
    out = found.outputs[0]
    assert out.nan + out.posinf + out.neginf == 12


def test_overflowing_fp16_matmul_names_the_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)).half()
    with torch.no_grad():
        model[1].weight.fill_(1000.0)  # 8 * 1000 * O(10) > 65504, the float16 maximum
        model[0].weight.fill_(1.0)
    found = find_nonfinite(model, torch.full((2, 8), 2.0, dtype=torch.float16))
    assert found is not None and (found.path, found.class_name, found.op) == ("1", "Linear", "linear")
    assert found.outputs[0].posinf + found.outputs[0].neginf == 16
    assert found.inputs[0].max == pytest.approx(16.0 + float(model[0].bias.detach().max()), rel=1e-2)


def test_nan_made_in_a_parents_own_code_names_the_parent() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(FunctionalLog())
    found = find_nonfinite(model, torch.randn(5, 4))
    assert found is not None and (found.path, found.class_name, found.op) == ("0", "FunctionalLog", "log")


def test_nan_already_in_the_input_is_reported_as_the_input_not_a_module() -> None:
    x = torch.randn(2, 3, 32, 32)
    x[0, 0, 0, 0] = math.nan
    found = find_nonfinite(LeNet(), x)
    assert found is not None and (found.path, found.bad_label, found.first_bad) == (
        "<input>", "args[0]", ((0, 0, 0, 0),))


def test_all_finite_returns_none_and_leaves_no_hooks() -> None:
    model = LeNet()
    assert find_nonfinite(model, torch.randn(2, 3, 32, 32)) is None
    assert not model.conv1._forward_hooks and not model._forward_pre_hooks


def test_second_call_of_a_reused_linear_is_found_with_its_index() -> None:
    model = SharedLinear()  # lin(tanh(lin(x)))
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(6) * 2e38)
        model.lin.bias.fill_(2e38)
    # call 0: -0.9 * 2e38 + 2e38 = 2e37, finite; tanh -> 1; call 1: 2e38 + 2e38 > float32 max
    found = find_nonfinite(model, torch.full((1, 6), -0.9))
    assert found is not None and (found.path, found.call_index, found.op) == ("lin", 1, "linear")
    assert found.inputs[0].min == 1.0 and found.outputs[0].posinf == 6


def test_reused_module_second_call_is_found_with_its_index() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.log = Log()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.log(self.log(x))  # log(e**-1 .. ) finite, then log of negatives

    found = find_nonfinite(Twice(), torch.tensor([0.5, 2.0]))
    assert found is not None and (found.path, found.call_index) == ("log", 1)


class ScaledLog(nn.Module):
    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return torch.log(x * scale)


def test_keyword_inputs_are_summarised_and_checked() -> None:
    found = find_nonfinite(ScaledLog(), torch.ones(3), scale=torch.tensor([1.0, -1.0, 1.0]))
    assert found is not None and (found.path, found.class_name, found.op) == ("", "ScaledLog", "log")
    assert [s.label for s in found.inputs] == ["args[0]", "kwargs['scale']"]
    assert found.inputs[1].min == -1.0 and found.first_bad == ((1,),)
    # an Inf passed in by keyword is already there: no module made it, the input is the origin
    found = find_nonfinite(ScaledLog(), torch.ones(3), scale=torch.tensor([math.inf, 1.0, 1.0]))
    assert found is not None and (found.path, found.bad_label, found.first_bad) == (
        "<input>", "kwargs['scale']", ((0,),))
