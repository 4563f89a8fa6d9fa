"""Issue 32: a capture inside ``torch.compile(model, fullgraph=True)``: no graph break, values
equal the eager capture's, and opening and closing blocks compiles the model at most twice (a
graph with the hooks, one without), never once per block (``engine.compiled``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import hookscope
from tests.models import InplaceRelu, tiny_gpt2

Tensor = torch.Tensor
BLOCKS = 10


def _mlp() -> nn.Module:
    """Eight Linear layers in a Sequential of Sequentials (issue 32's model)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(8)]).eval()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return InplaceRelu().eval()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, Tensor]], str]] = {
    "mlp": (_mlp, lambda: {"input": torch.randn(2, 8)}, "*.0"),
    "cnn": (_cnn, lambda: {"input": torch.randn(2, 3, 6, 6)}, "*"),
    "gpt2": (tiny_gpt2, lambda: {"input_ids": torch.tensor([[3, 5, 7, 9], [2, 4, 6, 0]]),
                                 "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])},
             "transformer.h.*.*"),
}
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {}, "dtype": {"dtype": torch.float64}, "reduce": {"reduce": "mean"},
    "clone-false": {"clone": False}, "to": {"to": "cpu"}, "clone-true": {"clone": True},
}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from nothing and leaves nothing compiled behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _call(model: nn.Module, inputs: dict[str, Tensor]) -> Any:
    if "input" in inputs:
        return model(inputs["input"])
    return model(**inputs)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list(MODELS))
def test_fullgraph_capture_equals_eager_and_compiles_twice_over_ten_blocks(
        name: str, option: str, dynamo_warnings: list[str]) -> None:
    make, data, pattern = MODELS[name]
    model, inputs = make(), data()
    options = OPTIONS[option]
    exact = {k: v for k, v in options.items() if k != "clone"}  # clone=False: eager values of
    # the CNN are overwritten in place (its capture refuses them); compiled ones are copies
    with torch.no_grad(), hookscope.capture(model, pattern, **exact) as eager:
        expected_out = _call(model, inputs)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(BLOCKS):
            with hookscope.capture(compiled, pattern, on_unfired="error", **options) as acts:
                out = _call(compiled, inputs)
                _call(compiled, inputs)
            _call(compiled, inputs)  # no hooks: its own graph
    assert counter.frame_count <= 2
    assert [m for m in dynamo_warnings if "recompil" in m] == []
    logits = out if isinstance(out, Tensor) else out.logits
    torch.testing.assert_close(logits, expected_out if isinstance(out, Tensor) else expected_out.logits)
    assert set(eager.counts) <= set(acts.counts) and len(eager.counts) >= 4  # ("*.0" on the
    # compiled wrapper also matches "_orig_mod.0", shown as "0")
    for key, count in eager.counts.items():
        assert acts.counts[key] == 2 * count
        for k, want in enumerate(eager.calls(key)):
            for got in (acts.calls(key)[k], acts.calls(key)[count + k]):  # both compiled calls
                if isinstance(want, Tensor):
                    assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_fullgraph_capture_under_inductor_equals_eager(dynamo_warnings: list[str]) -> None:
    """The default backend: inductor keeps the operator and its order (an ordered effect)."""
    model, x = _cnn(), torch.randn(2, 3, 6, 6)
    with torch.no_grad(), hookscope.capture(model, "*") as eager:
        model(x)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            with hookscope.capture(compiled, "*") as acts:
                compiled(x)
            compiled(x)
    assert counter.frame_count <= 2
    for key in eager.counts:
        torch.testing.assert_close(acts[key], eager[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("options", "pattern", "named"), [
    ({"inputs": True}, "*.0", "inputs=True"), ({"grads": True}, "*.0", "grads=True"),
    ({"early_stop": True}, "*.0", "early_stop=True")])
def test_fullgraph_refuses_what_the_graph_cannot_hold_at_entry(
        options: dict[str, Any], pattern: str, named: str, dynamo_warnings: list[str]) -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(hookscope.HookscopeError, match=rf"{named} cannot run inside torch\.compile"
                                                       rf"\(model, fullgraph=True\).*fullgraph=False"):
        with hookscope.capture(compiled, pattern, **options):
            compiled(torch.randn(2, 8, requires_grad=True))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_kept_values_survive_the_graph_writing_its_buffers_again(dynamo_warnings: list[str]) -> None:
    """Inductor reuses intermediate buffers within a call, and each later call writes its own:
    a value kept copy-on-write (``engine.compiled._copy``) keeps what the module returned, as
    the graph's kernels take their pointers through torch's mutable accessor, which gives the
    buffer a storage of its own first."""
    torch.manual_seed(0)
    layers = [layer for _ in range(6) for layer in (nn.Linear(16, 16), nn.ReLU(inplace=True))]
    model = nn.Sequential(*layers).eval()
    x = torch.randn(4, 16)
    with torch.no_grad(), hookscope.capture(model, "*") as eager:
        model(x)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    with torch.no_grad():
        with hookscope.capture(compiled, "*") as acts:
            compiled(x)
        for _ in range(3):
            compiled(-x)
    assert len(eager.counts) == 12
    for key in eager.counts:
        torch.testing.assert_close(acts[key], eager[key], rtol=1e-5, atol=1e-6)
