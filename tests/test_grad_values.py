"""Gradients at outputs and inputs equal torch.autograd.grad computed by hand."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope
from hookscope import CaptureError, NoGrad
from tests.models import MlpStack, ModuleListBlocks, SharedLinear, TupleOutput


def test_tensor_output_gradient_equals_autograd() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.capture(model, "fc1", "fc2", grads=True) as acts:
        out = model(x)
    out.pow(2).sum().backward()
    hidden = model.fc1(x)
    final = model.fc2(model.relu(hidden))
    expected_hidden, expected_final = torch.autograd.grad(final.pow(2).sum(), (hidden, final))
    assert torch.equal(acts.grad("fc1"), expected_hidden)
    assert torch.equal(acts.grad("fc2"), expected_final)


def test_tuple_output_gradient_equals_autograd_and_marks_unused_parts() -> None:
    model, x = TupleOutput(), torch.randn(2, 5, 4)
    with hookscope.capture(model, "lstm", "lstm[1][0]", grads=True) as acts:
        model(x).sum().backward()
    out, (h, c) = model.lstm(x)
    expected_out, expected_h = torch.autograd.grad(model.fc(out[:, -1] + h[0]).sum(), (out, h))
    got_out, (got_h, got_c) = acts.grad("lstm")
    assert torch.equal(got_out, expected_out) and torch.equal(got_h, expected_h)
    assert torch.equal(acts.grad("lstm[1][0]"), expected_h)
    assert isinstance(got_c, NoGrad) and "no gradient has reached it" in got_c.reason


def test_module_called_twice_has_one_gradient_per_call() -> None:
    model, x = SharedLinear(), torch.randn(2, 6)
    with hookscope.capture(model, "lin", grads=True) as acts:
        model(x).pow(2).sum().backward()
    first = model.lin(x)
    second = model.lin(torch.tanh(first))
    expected = torch.autograd.grad(second.pow(2).sum(), (first, second))
    got = acts.grad_calls("lin")
    assert len(got) == 2 and not torch.equal(got[0], got[1])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(acts.grad("lin", -1), expected[1])


def test_backward_after_the_block_and_model_unchanged() -> None:
    """Tensor hooks return None: outputs and the gradient reaching x are those of plain PyTorch."""
    model = ModuleListBlocks()
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    plain = model(x)
    (plain_grad,) = torch.autograd.grad(plain.sum(), x)
    with hookscope.capture(model, "**", grads=True, grad_inputs=True) as acts:
        out = model(x)
    assert torch.equal(out, plain)
    out.sum().backward()  # after the block: the tensor hooks still record
    assert torch.equal(x.grad, plain_grad)
    assert acts.grad("head").shape == (2, 2, 6, 6)


def test_input_gradient_is_the_gradient_through_the_module_only() -> None:
    """A residual block x + proj(x): grad_input of proj is what a full backward hook reports,
    not the total gradient of x."""
    model = ModuleListBlocks()
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    seen: list[torch.Tensor] = []
    handle = model.pos_block[1].proj.register_full_backward_hook(
        lambda m, grad_input, grad_output: seen.append(grad_input[0]))
    try:
        model(x).pow(2).sum().backward()
    finally:
        handle.remove()
    with hookscope.capture(model, "pos_block.1.proj", "pos_block.1", grad_inputs=True) as acts:
        model(x).pow(2).sum().backward()
    assert torch.allclose(acts.grad_input("pos_block.1.proj")[0], seen[0], atol=1e-6)
    total = acts.grad_input("pos_block.1")[0]  # the block's input also flows around proj
    assert not torch.allclose(total, seen[0])


def test_grad_input_by_name_for_keyword_inputs() -> None:
    from tests.models import KwargsForward
    model = KwargsForward()
    x = torch.randn(1, 3, 8, requires_grad=True)
    with hookscope.capture(model, "layers.0", "layers.1.mlp", grad_inputs=True) as acts:
        model(x).sum().backward()
    first = model.layers[0](hidden_states=x)
    expected = torch.autograd.grad(model.layers[1](hidden_states=first).sum(), (x, first))
    g = acts.grad_input("layers.0")
    assert torch.equal(g["hidden_states"], expected[0])
    assert torch.equal(g.kwargs["hidden_states"], expected[0])
    assert isinstance(g["attention_mask"], NoGrad)
    assert torch.equal(acts.grad_input("layers.1.mlp")[0], expected[1])


def test_gradients_keep_no_graph_alive() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    refs = []
    with hookscope.capture(model, "0", "2", grads=True, grad_inputs=True) as acts:
        for _ in range(20):
            x = torch.randn(32, 64, requires_grad=True)
            refs.append(weakref.ref(x))
            model(x)  # no backward: the graph must die with the output
            del x
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert acts.counts == {"0": 20, "2": 20}


def test_errors_say_why_there_is_no_gradient() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.capture(model, "fc1") as plain:
        model(x)
    with pytest.raises(CaptureError, match=r"grads=True\), then call loss\.backward\(\)"):
        plain.grad("fc1")
    with pytest.raises(CaptureError, match=r"grad_inputs=True\)"):
        plain.grad_input("fc1")
    with hookscope.capture(model, "fc1", grads=True) as no_grad, torch.no_grad():
        model(x)  # gradients switched off inside the block: found when the gradient is read
    with pytest.raises(CaptureError, match=r"gradients disabled \(torch\.no_grad\(\)"):
        no_grad.grad("fc1")
    with hookscope.capture(model, "fc1", grads=True) as waiting:
        model(x)
    with pytest.raises(CaptureError, match=r"call loss\.backward\(\)"):
        waiting.grad("fc1")


def test_integer_inputs_are_marked() -> None:
    embed = nn.Sequential(nn.Embedding(10, 4))
    with hookscope.capture(embed, "0", grads=True, grad_inputs=True) as acts:
        embed(torch.tensor([[1, 2, 3]])).sum().backward()
    marker = acts.grad_input("0")[0]
    assert not marker and "torch.int64 tensor" in marker.reason
    assert torch.equal(acts.grad("0"), torch.ones(1, 3, 4))


def test_gradients_follow_to_and_dtype() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.capture(model, "fc1", grads=True, dtype=torch.float64) as acts:
        model(x).sum().backward()
    hidden = model.fc1(x)
    (expected,) = torch.autograd.grad(model.fc2(F.relu(hidden)).sum(), hidden)
    assert acts.grad("fc1").dtype == torch.float64
    assert torch.equal(acts.grad("fc1"), expected.double())


def test_input_that_requires_grad_under_no_grad_is_marked() -> None:
    model, x = MlpStack(), torch.randn(3, 10, requires_grad=True)
    with hookscope.capture(model, "fc1", grad_inputs=True) as acts, torch.no_grad():
        model(x)
    assert "gradients disabled" in acts.grad_input("fc1")[0].reason
