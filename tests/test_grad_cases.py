"""Shared cases 06, 11 and 22: gradient capture where module backward hooks fail."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import hookscope
from hookscope import NoGrad


def _case06() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True))


def test_case06_inplace_relu_after_hooked_conv() -> None:
    model, x = _case06(), torch.rand(1, 3, 6, 6)
    with hookscope.capture(model, "2", grads=True) as acts:
        out = model(x)  # a full backward hook makes this forward raise; tensor hooks do not
    out.sum().backward()
    conv_out = model[2](model[1](model[0](x)))
    (expected,) = torch.autograd.grad(F.relu(conv_out).sum(), conv_out)
    assert acts.grad("2").shape == (1, 8, 6, 6)
    assert torch.equal(acts.grad("2"), expected)
    assert bool((expected == 0).any())  # the ReLU's mask is in it: the value before the in-place write


def test_case06_lambda_returning_a_handle_is_not_substituted() -> None:
    """The observing hooks of capture (and their tensor hooks) never replace an output."""
    model, x = _case06(), torch.rand(1, 3, 6, 6)
    plain = model(x).detach()
    with hookscope.capture(model, "0", "2", "3", grads=True, grad_inputs=True) as acts:
        out = model(x)
    assert torch.equal(out, plain)
    out.sum().backward()
    assert torch.equal(acts.grad("3"), torch.ones(1, 8, 6, 6))


def _two_layer() -> nn.Module:
    class TwoLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear1 = nn.Linear(4, 5)
            self.linear2 = nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear2(F.relu(self.linear1(x)))
    torch.manual_seed(0)
    return TwoLayer()


def test_case11_first_layer_input_marked_no_warning() -> None:
    model = _two_layer()
    x, y = torch.rand(20, 4), torch.randint(0, 3, (20,))  # x does not require grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookscope.capture(model, "linear1", "linear2", grads=True, grad_inputs=True) as acts:
            F.cross_entropy(model(x), y).backward()
    assert [str(w.message) for w in caught] == []
    marker = acts.grad_input("linear1")[0]
    assert isinstance(marker, NoGrad) and not marker
    assert "does not require grad" in marker.reason and "x.requires_grad_()" in marker.reason
    hidden = model.linear1(x)
    relu = F.relu(hidden)
    expected = torch.autograd.grad(F.cross_entropy(model.linear2(relu), y), (hidden, relu))
    assert acts.grad("linear1").shape == (20, 5)
    assert torch.equal(acts.grad("linear1"), expected[0])
    assert torch.equal(acts.grad_input("linear2")[0], expected[1])


def test_case11_input_that_requires_grad_gets_its_gradient() -> None:
    model = _two_layer()
    x = torch.rand(20, 4, requires_grad=True)
    with hookscope.capture(model, "linear1", grad_inputs=True) as acts:
        model(x).sum().backward()
    assert torch.equal(acts.grad_input("linear1")[0], x.grad)


def _nested_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)))


def _expected(model: nn.Sequential, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inner = x.detach().requires_grad_()
    out = model[0](inner)
    return torch.autograd.grad(out.sum(), (out, inner))


def test_case22_legacy_backward_hook_flag_does_not_break_gradients() -> None:
    model = _nested_sequential()
    x = torch.randn(4, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warning for the legacy hook
        handle = model[0].register_backward_hook(lambda m, gi, go: None)
    handle.remove()
    assert model[0]._is_full_backward_hook is False  # the sticky flag of case 22
    with hookscope.capture(model, "0", grads=True, grad_inputs=True) as acts:
        model(x).sum().backward()
    expected_output, expected_input = _expected(model, x)
    assert acts.grad("0").shape == (4, 2) and acts.grad_input("0")[0].shape == (4, 3)
    assert torch.equal(acts.grad("0"), expected_output)
    assert torch.equal(acts.grad_input("0")[0], expected_input)


def test_case22_with_the_legacy_hook_still_registered() -> None:
    model = _nested_sequential()
    x = torch.randn(4, 3, requires_grad=True)
    legacy: list[tuple[int, ...]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = model[0].register_backward_hook(
            lambda m, gi, go: legacy.append(tuple(g.shape for g in gi if g is not None)))
        try:
            with hookscope.capture(model, "0", grads=True, grad_inputs=True) as acts:
                model(x).sum().backward()
        finally:
            handle.remove()
    assert legacy == [((2,), (4, 5), (5, 2))]  # the legacy hook's last-node semantics, unchanged
    expected_output, expected_input = _expected(model, x)
    assert torch.equal(acts.grad("0"), expected_output)
    assert torch.equal(acts.grad_input("0")[0], expected_input)
