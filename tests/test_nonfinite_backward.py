"""find_nonfinite(backward=True): the module whose backward first makes a NaN/Inf gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hookscope.diagnostics.nonfinite import find_nonfinite
from hookscope.errors import HookscopeError


class Sqrt(nn.Module):
    """sqrt is finite at 0, but its derivative 1 / (2 sqrt(x)) is +Inf there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class MaskedLog(nn.Module):
    """torch.where(x > 0, log(x), 0): finite forward, but the masked-out log still gets a zero
    gradient, and 0 * (1 / 0) is NaN in its backward (a classic)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.scale(x)
        return torch.where(h > 0, h.log(), torch.zeros_like(h))


def _relu_sqrt_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), Sqrt(), nn.Linear(4, 1))


def test_infinite_gradient_of_sqrt_at_zero_is_found_in_sqrt() -> None:
    model = _relu_sqrt_model()
    x = torch.randn(3, 4)
    assert find_nonfinite(model, x) is None  # the forward pass is finite
    found = find_nonfinite(model, x, backward=True)
    assert found is not None
    assert (found.path, found.class_name, found.phase, found.op) == ("2", "Sqrt", "backward",
                                                                     "SqrtBackward0")
    zeros = (torch.relu(model[0](x)) == 0)
    assert found.bad_count == int(zeros.sum()) and found.inputs[0].nonfinite == 0
    assert [list(p) for p in found.first_bad] == torch.nonzero(zeros).tolist()[:8]
    assert "first non-finite gradient: '2' (Sqrt), call 0, backward" in str(found)


def test_no_grad_attribute_is_changed() -> None:
    model = _relu_sqrt_model()
    find_nonfinite(model, torch.randn(3, 4), backward=True)
    assert all(p.grad is None for p in model.parameters())


def test_loss_fn_is_used_and_a_finite_backward_returns_none() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    calls = []

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(output.shape))
        return (output ** 2).mean()

    assert find_nonfinite(model, torch.randn(5, 4), backward=True, loss_fn=loss_fn) is None
    assert calls == [(5, 1)]


def test_non_finite_loss_is_reported_as_the_loss() -> None:
    model = nn.Sequential(nn.Linear(4, 1))
    found = find_nonfinite(model, torch.randn(5, 4), backward=True,
                           loss_fn=lambda out: (out - out).div(0.0).sum())
    assert found is not None and (found.path, found.class_name, found.phase) == (
        "<loss>", "loss_fn", "forward")


def test_nan_gradient_behind_torch_where_is_found_in_the_masked_log() -> None:
    model = nn.Sequential(nn.Linear(4, 4), MaskedLog(), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].scale.weight.zero_()
        model[1].scale.bias.copy_(torch.tensor([1.0, 0.0, 2.0, 0.0]))  # log(0) in columns 1, 3
    x = torch.randn(3, 4)  # does not require grad: gradients go to the parameters only
    assert find_nonfinite(model, x) is None
    found = find_nonfinite(model, x, backward=True)
    assert found is not None
    assert (found.path, found.class_name, found.phase, found.op) == ("1", "MaskedLog", "backward",
                                                                     "LogBackward0")
    assert found.first_bad == ((0, 1), (0, 3), (1, 1), (1, 3), (2, 1), (2, 3))
    assert found.outputs[0].nan == 6


def test_backward_under_no_grad_says_how_to_fix() -> None:
    model = _relu_sqrt_model()
    with torch.no_grad(), pytest.raises(HookscopeError, match=r"outside torch.no_grad\(\)"):
        find_nonfinite(model, torch.randn(3, 4), backward=True)
