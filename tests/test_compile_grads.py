"""Issue 32: ``grads=True`` under ``torch.compile``. Gradient hooks on values made inside a
compiled graph would need compiled autograd; hookscope's documented fallback is the graph split:
with ``fullgraph=False`` the gradient watch runs outside the graph (``engine.door.hooks._untraced``)
and every captured gradient equals eager; ``fullgraph=True`` refuses the option at entry with
that fix (``tests/test_compile_fullgraph.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import hookscope
from tests.test_compile_fullgraph import MODELS, _call

Tensor = torch.Tensor
PATTERNS = {"mlp": "*.*", "cnn": "conv*", "gpt2": "transformer.h.*.mlp"}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _captured_gradients(model: nn.Module, called: nn.Module, name: str, inputs: dict[str, Tensor],
                        ) -> tuple[dict[str, list[Tensor]], list[Tensor]]:
    model.zero_grad()
    with hookscope.capture(called, PATTERNS[name], grads=True) as acts:
        out = _call(called, inputs)
        (out if isinstance(out, Tensor) else out.logits).square().sum().backward()
    grads = {key: [g[0] if isinstance(g, tuple) else g for g in acts.grad_calls(key)]
             for key in acts.counts}
    return grads, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", list(MODELS))
def test_captured_gradients_under_compile_equal_eager(name: str, dynamo_warnings: list[str]) -> None:
    model, inputs = MODELS[name][0](), MODELS[name][1]()
    expected, expected_params = _captured_gradients(model, model, name, inputs)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    got, params = _captured_gradients(model, compiled, name, inputs)
    frames = counter.frame_count
    _captured_gradients(model, compiled, name, inputs)  # a second block: compiles nothing more
    assert counter.frame_count == frames
    assert set(got) >= set(expected) and len(expected) >= 2
    for key, want in expected.items():
        assert len(got[key]) == len(want)
        for grad, wanted in zip(got[key], want):
            torch.testing.assert_close(grad, wanted, rtol=1e-5, atol=1e-6)
    for grad, wanted in zip(params, expected_params, strict=True):
        torch.testing.assert_close(grad, wanted, rtol=1e-5, atol=1e-6)
    assert [m for m in dynamo_warnings if "recompil" in m] == []  # and no recompile-limit warning
