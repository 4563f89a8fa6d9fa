"""shared/cases/36 (fp16 overflow: the first inf) and 37 (torch.compile with hooks present before
the first call), each as its case states it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hookscope
from hookscope.diagnostics.nonfinite import find_nonfinite
from tests.models import GeluMlp


class DenseReluDense(nn.Module):  # the T5 feed-forward block of transformers#5651
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(4, 16, bias=False)
        self.act = nn.ReLU()
        self.wo = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class T5Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = DenseReluDense()
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.ff(x))


def test_36_fp16_overflow_names_the_leaf_with_finite_input_and_inf_output() -> None:
    model = T5Block()
    with torch.no_grad():
        model.ff.wi.weight.fill_(1.0)
        model.ff.wo.weight.fill_(260.0)  # 64 * 16 * 260 = 266240 > 65504 (fp16 max)
    model = model.half()
    x = torch.full((1, 4), 16.0, dtype=torch.float16)
    found = find_nonfinite(model, x)
    assert found is not None and (found.path, found.class_name) == ("ff.wo", "Linear")
    assert found.inputs[0].max == 64.0 and found.inputs[0].nan + found.inputs[0].posinf == 0
    assert found.outputs[0].posinf == 4 and found.outputs[0].nan == 0


# Which hooks run is decided by dynamo, the same for every backend; the eager backend skips
# inductor's C++ build (a minute on 2 cores). Dynamo tracing the hooks still takes ~15 s.
@pytest.mark.slow
def test_37_capture_entered_before_the_first_compiled_call_records_every_layer() -> None:
    backend = "eager"
    torch._dynamo.reset()
    model, x = GeluMlp(), torch.randn(4, 8)
    with torch.no_grad():
        eager = {"l1": model.l1(x)}
        eager["act"] = model.act(eager["l1"])
        eager["l2"] = model.l2(eager["act"])
        eager["l3"] = model.l3(torch.relu(eager["l2"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad(), hookscope.capture(compiled, "l1", "act", "l2", "l3") as acts:
            compiled(x)
    assert acts.counts == {"l1": 1, "act": 1, "l2": 1, "l3": 1}
    for name, value in eager.items():  # another kernel may compute it: atol 1e-5 as the case says
        torch.testing.assert_close(acts[name], value, atol=1e-5, rtol=1e-5)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    torch._dynamo.reset()
