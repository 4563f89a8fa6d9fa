"""Issue 32: edit, steer, patch and ablate inside ``torch.compile(model, fullgraph=True)``: no
graph break, values equal the eager edit's, and opening and closing blocks compiles the model at
most twice (a graph with the edits, one without). Each output edit runs in the graph as one
opaque operator whose result the graph goes on with (``engine.compile.graph.replace``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import hookscope
from tests.test_compile_fullgraph import MODELS, _call

Tensor = torch.Tensor
BLOCKS = 10
# patterns that name the same modules on the compiled wrapper and on the eager model
PATTERNS = {"mlp": ["0.0", "3.0", "5.1"], "cnn": ["conv", "relu", "conv2"],
            "gpt2": ["transformer.h.*.mlp", "transformer.h.*.attn[0]", "transformer.h.1"]}
VECTORS = {"mlp": torch.linspace(-1, 1, 8), "cnn": torch.linspace(-1, 1, 4).reshape(4, 1, 1),
           "gpt2": torch.linspace(-1, 1, 32)}
Verb = Callable[[nn.Module, str, Any], Any]
VERBS: dict[str, Verb] = {
    "edit": lambda model, name, source: hookscope.edit(
        model, {p: (lambda output: output * 2 - 1) for p in PATTERNS[name]}),
    "steer": lambda model, name, source: hookscope.steer(
        model, dict.fromkeys(PATTERNS[name], VECTORS[name]), scale=0.5),
    "ablate-zero": lambda model, name, source: hookscope.ablate(model, PATTERNS[name]),
    "ablate-mean": lambda model, name, source: hookscope.ablate(
        model, PATTERNS[name], how="mean", reference=source),
    "patch": lambda model, name, source: hookscope.patch(model, source=source,
                                                         layers=PATTERNS[name]),
}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _logits(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits


def _source(model: nn.Module, name: str, inputs: dict[str, Tensor]) -> Any:
    """An eager capture of the edited modules on other inputs (patch's source, ablate's
    reference)."""
    other = {k: v.flip(0) for k, v in inputs.items()}
    with torch.no_grad(), hookscope.capture(model, *PATTERNS[name]) as acts:
        _call(model, other)
    return acts


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("name", list(MODELS))
def test_fullgraph_edit_equals_eager_and_compiles_twice_over_ten_blocks(
        name: str, verb: str, dynamo_warnings: list[str]) -> None:
    make, data, _ = MODELS[name]
    model, inputs = make(), data()
    source = _source(model, name, inputs)
    with torch.no_grad():
        plain = _logits(_call(model, inputs))
        with VERBS[verb](model, name, source) as eager:
            expected = _logits(_call(model, inputs))
    assert not torch.equal(expected, plain)  # the edit changes the result
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(BLOCKS):
            with VERBS[verb](compiled, name, source) as edited:
                got = _logits(_call(compiled, inputs))
            torch.testing.assert_close(_logits(_call(compiled, inputs)), plain)  # no hooks
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            assert edited.counts == eager.counts
    assert counter.frame_count <= 2
    assert [m for m in dynamo_warnings if "recompil" in m] == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_fullgraph_steer_at_positions_reads_the_compiled_calls_mask() -> None:
    """``positions=[-1]``: the last real token of each row, found from the attention mask the
    root's pre-hook passes out of the graph (a padded row's last token is not its last one)."""
    make, data, _ = MODELS["gpt2"]
    model, inputs = make(), data()
    vector = VECTORS["gpt2"]
    with torch.no_grad(), hookscope.steer(model, {"transformer.h.0": vector}, positions=[-1]):
        expected = _logits(_call(model, inputs))
    compiled = torch.compile(model, backend=CompileCounterWithBackend("eager"), fullgraph=True)
    with torch.no_grad(), hookscope.steer(compiled, {"transformer.h.0": vector}, positions=[-1]):
        got = _logits(_call(compiled, inputs))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_fullgraph_edit_under_inductor_equals_eager() -> None:
    """The default backend, on the CNN whose ReLU writes the convolution's output in place: the
    edited value flows on through buffers inductor plans from the operator's promised strides."""
    make, data, _ = MODELS["cnn"]
    model, inputs = make(), data()
    vector = VECTORS["cnn"]
    with torch.no_grad(), hookscope.steer(model, dict.fromkeys(PATTERNS["cnn"], vector)):
        expected = _call(model, inputs)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            with hookscope.steer(compiled, dict.fromkeys(PATTERNS["cnn"], vector)):
                got = _call(compiled, inputs)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2


def test_fullgraph_edit_of_another_shape_raises_the_eager_error() -> None:
    model, x = MODELS["mlp"][0](), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(hookscope.EditError, match=r"An edit must return what the module returns"):
        with torch.no_grad(), hookscope.edit(compiled, {"3.0": lambda output: output[:, :4]}):
            compiled(x)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def _steered_gradients(model: nn.Module, called: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    model.zero_grad()
    with hookscope.steer(called, {"3.0": VECTORS["mlp"]}):
        out = called(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_edit_with_gradients_under_compile_splits_the_graph_and_equals_eager() -> None:
    """A backward pass through an edited output: the edit runs outside the graph (the operator
    has no derivative), so outputs and every parameter's gradient equal eager."""
    model, x = MODELS["mlp"][0](), torch.randn(2, 8)
    expected, expected_grads = _steered_gradients(model, model, x)
    compiled = torch.compile(model, backend="eager")
    got, grads = _steered_gradients(model, compiled, x)
    torch.testing.assert_close(got, expected)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want)


def test_fullgraph_edit_with_gradients_says_what_to_do_at_the_call() -> None:
    model, x = MODELS["mlp"][0](), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(hookscope.EditError, match=r"under torch\.no_grad\(\).*fullgraph=False"):
        _steered_gradients(model, compiled, x)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
