"""Models whose hooks cannot fire, said before or right after the run, with the fix
(shared/cases/08, 12, 20, 25)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

import hookscope
from hookscope.diagnostics.comparison import compare
from hookscope.diagnostics.inventory import hooks
from hookscope.diagnostics.nonfinite import find_nonfinite
from hookscope.diagnostics.statistics import stats
from hookscope.engine import diagnose
from hookscope.engine.naming.names import index
from hookscope.engine.naming.selection import resolve
from hookscope.errors import HookNeverFiredWarning, HookscopeError, SelectorError
from tests.models import DirectForwardCall, LeNet

LOAD_EAGER = r"Load or build the eager nn\.Module instead"


# ---------------------------------------------------------------- case 08: TorchScript
def _scripted() -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(LeNet())


def _traced() -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.trace(LeNet(), (torch.randn(1, 3, 32, 32),))


@pytest.mark.parametrize("make", [_scripted, _traced], ids=["jit.script", "jit.trace"])
def test_torchscript_is_refused_by_every_entry_point_before_any_hook(make: object) -> None:
    model = make()  # type: ignore[operator]
    x = torch.randn(1, 3, 32, 32)
    calls = [lambda: hookscope.capture(model, "conv1"), lambda: stats(model, [x], layers="conv1"),
             lambda: find_nonfinite(model, x), lambda: compare(model, model, x)]
    for call in calls:
        with pytest.raises(HookscopeError, match=rf"cannot hook TorchScript module the model "
                                                 rf"\(LeNet\).*{LOAD_EAGER}"):
            call()
    assert hooks(model) == []


def test_scripted_submodule_of_an_eager_model_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model[0] = torch.jit.script(nn.Linear(4, 4))
    with pytest.raises(HookscopeError, match=rf"cannot hook TorchScript module '0'.*{LOAD_EAGER}"):
        stats(model, [torch.randn(2, 4)], layers="0")
    assert not model[1]._forward_hooks


# ---------------------------------------------------------------- case 25: torch.fx
class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = Inner()  # a custom module: inlined by the tracer
        self.lin = nn.Linear(3, 3)  # a torch.nn module: kept as call_module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.f(x))


def test_fx_graph_module_names_the_inlined_module_and_the_call_module_targets() -> None:
    graph_module = torch.fx.symbolic_trace(Outer())
    with pytest.raises(SelectorError, match=r"a module that symbolic tracing inlined is not "
                                            r"present in the traced graph\. call_module targets "
                                            r"are: \['lin'\]; hook one of those"):
        hookscope.capture(graph_module, "f")
    x = torch.randn(5, 3)
    result = stats(graph_module, [x], layers="lin")  # leaf modules keep firing
    assert result["lin"].as_dict()["count"] == 15
    assert result["lin"].as_dict()["mean"] == pytest.approx(
        float(graph_module.lin(torch.relu(x)).detach().double().mean()), rel=1e-9)


# ---------------------------------------------------------------- case 20: fused fast path
def _encoder_layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(d_model=16, nhead=4, batch_first=True).eval()


def test_per_module_hooks_turn_the_fast_path_off_so_every_submodule_is_captured() -> None:
    layer, x = _encoder_layer(), torch.randn(2, 5, 16)
    with pytest.warns(HookNeverFiredWarning, match=r"1 module that a pattern matched never ran "
                                                   r"\(self_attn.out_proj\)"):
        with torch.inference_mode(), hookscope.capture(layer, "**") as acts:
            fast = layer(x)
    assert "self_attn.out_proj is never called" in acts.unfired["self_attn.out_proj"]
    ran = [p for p, n in acts.counts.items() if n == 1]
    assert ran == ["self_attn", "linear1", "dropout", "linear2", "norm1", "norm2", "dropout1",
                   "dropout2"]
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            slow = layer(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    # self_attn may still use MultiheadAttention's own native kernel: equal up to rounding
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    assert torch.equal(acts["norm2"], fast)


def test_fast_path_seen_by_a_global_hook_is_explained_with_the_switch() -> None:
    layer, x = _encoder_layer(), torch.randn(2, 5, 16)
    names = {m: p for p, m in layer.named_modules()}
    seen: set[str] = set()
    handle = register_module_forward_hook(lambda m, i, o: seen.add(names[m]) if m in names else None)
    try:
        with torch.inference_mode():
            layer(x)
    finally:
        handle.remove()
    assert seen == {""}  # the fused kernel ran; none of the 8 submodules did
    targets = resolve(layer, ["linear1", "self_attn"])
    reasons = diagnose.explain_unfired(index(layer), targets, seen)
    assert set(reasons) == {"linear1", "self_attn"}
    for reason in reasons.values():
        assert "ran its fused fast path" in reason
        assert "torch.backends.mha.set_fastpath_enabled(False)" in reason


def test_multihead_attention_out_proj_is_never_called_and_says_what_to_capture() -> None:
    layer = _encoder_layer()
    with pytest.warns(HookNeverFiredWarning, match=r"Capture 'self_attn\[0\]' \(the attention "
                                                   r"output, after out_proj\) instead"):
        with hookscope.capture(layer, "self_attn.out_proj", "self_attn") as acts:
            layer(torch.randn(2, 5, 16))
    assert acts.counts == {"self_attn": 1, "self_attn.out_proj": 0}


# ---------------------------------------------------------------- case 12: .forward() called directly
def test_direct_forward_call_is_named_from_the_child_that_ran() -> None:
    model = DirectForwardCall()
    with pytest.warns(HookNeverFiredWarning, match=r"attention \(Attention\) never ran through "
                                                   r"its hooks although its child attention\.qkv "
                                                   r"ran.*calls attention\.forward\(\.\.\.\) "
                                                   r"directly"):
        result = stats(model, [torch.randn(1, 3, 8)], layers="attention")
    assert result["attention"].as_dict()["count"] == 0
