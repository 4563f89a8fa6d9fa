"""Issue 46 item 4 / case 71: a custom ``torch.autograd.Function`` called inside a forward. A
``TorchFunctionMode`` never sees ``Function.apply``, only the calls inside the Function's
forward, as if the module had made them. hookscope refuses ``path::FunctionName`` naming
autograd.Function and the fixes, never lists the Function's inner calls as the module's own,
and the fixes it names give plain PyTorch's values and gradients."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookscope
from hookscope.errors import HookNeverFiredWarning, HookscopeError

Tensor = torch.Tensor


class RoundSTE(torch.autograd.Function):
    """A straight-through quantizer (QAT, BitNet): round to quarters, gradient passed through."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class QBlock(nn.Module):
    """Case 71's block: ``gelu(RoundSTE.apply(fc(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(RoundSTE.apply(self.fc(x)))


class Quantize(nn.Module):
    """The fix the refusal names: the Function's call wrapped in a module."""

    def forward(self, x: Tensor) -> Tensor:
        return RoundSTE.apply(x)


class WrappedQBlock(QBlock):
    def __init__(self) -> None:
        super().__init__()
        self.quant = Quantize()

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.quant(self.fc(x)))


def _quiet_capture(model: nn.Module, address: str, **options: Any) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookscope.capture(model, address, **options) as acts:
            model(torch.randn(2, 8))
    return acts, [str(w.message) for w in caught if issubclass(w.category, HookNeverFiredWarning)]


@pytest.mark.parametrize("address", ["::RoundSTE", "::RoundSTE#0"])
@pytest.mark.parametrize("verb", ["capture", "edit"])
def test_an_address_of_a_custom_function_is_refused_naming_autograd_function_and_the_fix(
        address: str, verb: str) -> None:
    torch.manual_seed(0)
    model = QBlock()
    block = (hookscope.capture(model, address) if verb == "capture"
             else hookscope.edit(model, {address: lambda out: out * 2}))
    with pytest.raises(HookscopeError, match=r"(?s)calls RoundSTE, a custom torch\.autograd\.Function.*"
                                             r"Wrap the call in a module.*address that module"):
        with block:
            model(torch.randn(2, 8))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("inner", ["mul", "round", "div"])
def test_the_calls_inside_a_function_are_never_listed_as_the_modules_own(inner: str) -> None:
    torch.manual_seed(0)
    acts, messages = _quiet_capture(QBlock(), f"::{inner}")
    assert acts.counts == {f"::{inner}": 0}
    assert len(messages) == 1
    assert "it made: RoundSTE (a custom autograd.Function), gelu (" in messages[0]
    assert not any(f"{name}," in messages[0] for name in ("mul", "round", "div"))


def test_the_named_fixes_give_plain_pytorchs_value_edit_and_gradient() -> None:
    torch.manual_seed(0)
    plain = QBlock()
    model = WrappedQBlock()
    model.fc.load_state_dict(plain.fc.state_dict())
    x = torch.randn(4, 8)
    quantized = RoundSTE.apply(plain.fc(x))  # plain PyTorch
    with torch.no_grad(), hookscope.capture(plain, "::gelu", inputs=True) as acts:
        plain(x)
    torch.testing.assert_close(acts.inputs("::gelu")[0], quantized.detach(), rtol=0, atol=0)

    with hookscope.capture(model, "quant") as acts:
        model(x)
    torch.testing.assert_close(acts["quant"], quantized.detach(), rtol=0, atol=0)

    with hookscope.edit(model, {"quant": lambda out: out * 2 - 0.5}):
        out = model(x)
    reference = F.gelu(RoundSTE.apply(plain.fc(x)) * 2 - 0.5)  # plain PyTorch, the same edit
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    out.square().sum().backward()
    reference.square().sum().backward()
    torch.testing.assert_close(model.fc.weight.grad, plain.fc.weight.grad)  # the straight-through path
    assert float(model.fc.weight.grad.abs().sum()) > 0


class Checkpointed(nn.Module):
    """torch's own autograd.Function (reentrant checkpointing) is no user Function: the calls of
    the checkpointed function are the module's own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(lambda h: torch.tanh(h) * 3, self.fc(x), use_reentrant=True)


def test_torchs_own_functions_keep_their_calls_the_modules() -> None:
    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(2, 8, requires_grad=True)
    with hookscope.capture(model, "::tanh", on_unfired="error") as acts:
        model(x)
    torch.testing.assert_close(acts["::tanh"], torch.tanh(model.fc(x)).detach())


@settings(max_examples=15, deadline=None)
@given(scale=st.floats(0.25, 8.0), shift=st.floats(-2.0, 2.0), depth=st.integers(1, 3))
def test_functions_nested_in_helpers_are_found_however_deep(scale: float, shift: float, depth: int) -> None:
    """Kinds, not one example: the Function called through helper functions of any depth, with
    any constants: refused by its name, and what the module itself calls stays addressable."""

    def helper(x: Tensor, level: int) -> Tensor:
        return RoundSTE.apply(x * scale) if level == 0 else helper(x, level - 1) + shift

    class Deep(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.tanh(helper(x, depth - 1))

    model, x = Deep(), torch.randn(2, 8)
    with pytest.raises(HookscopeError, match="custom torch.autograd.Function"):
        with hookscope.capture(model, "::RoundSTE"):
            model(x)
    with hookscope.capture(model, "::tanh", inputs=True, on_unfired="error") as acts:
        model(x)
    expected = RoundSTE.apply(x * scale) + shift * (depth - 1)
    torch.testing.assert_close(acts.inputs("::tanh")[0], expected)
