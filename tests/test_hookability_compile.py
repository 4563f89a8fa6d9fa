"""shared/cases/07: hooks added after torch.compile's first call never fire; hookscope says why."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import hookscope
from hookscope.diagnostics.comparison import compare
from hookscope.diagnostics.nonfinite import find_nonfinite
from hookscope.diagnostics.statistics import stats
from hookscope.errors import HookNeverFiredWarning, HookscopeError


def _compiled_mlp() -> tuple[nn.Sequential, nn.Module]:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="eager")
    return model, compiled


def test_capture_on_a_warmed_up_compiled_model_explains_and_gives_the_fix() -> None:
    model, compiled = _compiled_mlp()
    x = torch.randn(16, 8)
    # compiled, without hooks, with skip_nnmodule_hook_guards on (a user's own setting: code
    # compiled before hookscope's first block is recompiled, engine.compiled): the code
    # ignores new hooks
    with hookscope.capture(model, "0", on_unfired="ignore"):  # dynamo set up first
        pass
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        compiled(x)
        with torch.no_grad():
            compiled(x)  # compare runs under no_grad: warm that variant up too
    with pytest.warns(HookNeverFiredWarning, match=r"Call torch\._dynamo\.reset\(\) first") as record:
        with hookscope.capture(compiled, "type:Linear") as acts:
            compiled(x)
    message = str(record[0].message)
    assert "0 (Linear) never ran through its hooks although the torch.compile'd model" in message
    assert "2 (Linear)" in message and acts.counts == {"0": 0, "2": 0}

    with pytest.raises(HookscopeError, match=r"cannot compare: the torch\.compile'd model ran "
                                             r"but none of its modules' hooks fired.*Call "
                                             r"torch\._dynamo\.reset\(\) first"):
        compare(compiled, model, x)
    inf_model = copy.deepcopy(model)
    with torch.no_grad():
        inf_model[2].weight[0, 0] = float("inf")
    inf_compiled = torch.compile(inf_model, backend="eager")
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        inf_compiled(x)
    found = find_nonfinite(inf_compiled, x)  # runs the eager module: its hooks fire
    assert found is not None and (found.path, found.class_name, found.op) == ("2", "Linear", "linear")

    torch._dynamo.reset()  # the fix: the next call recompiles with the hooks
    with hookscope.capture(compiled, "type:Linear") as acts:
        out = compiled(x)
    assert acts.counts == {"0": 1, "2": 1}
    assert torch.equal(acts["2"], model[2](model[1](model[0](x))).detach())
    assert torch.equal(out, model(x))
    torch._dynamo.reset()


def test_hooks_registered_before_the_first_call_fire_and_stats_see_them() -> None:
    model, compiled = _compiled_mlp()
    batches = [torch.randn(4, 8) for _ in range(2)]
    result = stats(compiled, batches, layers="0")  # first call happens with the hooks on
    expected = torch.cat([model[0](b) for b in batches]).detach().double()
    assert result["0"].as_dict()["mean"] == pytest.approx(float(expected.mean()), rel=1e-9)
    torch._dynamo.reset()


def test_hooks_added_after_the_first_compiled_call_take_effect_once_hookscope_set_up_dynamo() -> None:
    """Issue 32: once a block has run in a process that loaded torch._dynamo, code compiled
    later checks the hook tables (skip_nnmodule_hook_guards=False): a capture opened after the
    first compiled call records, values equal eager, no torch._dynamo.reset()."""
    model, compiled = _compiled_mlp()
    x = torch.randn(16, 8)
    with hookscope.capture(model, "0", on_unfired="ignore"):  # any block sets dynamo up
        pass
    assert torch._dynamo.config.skip_nnmodule_hook_guards is False
    compiled(x)  # compiles, without hooks
    with hookscope.capture(compiled, "type:Linear", on_unfired="error") as acts:
        compiled(x)
    assert acts.counts == {"0": 1, "2": 1}
    assert torch.equal(acts["2"], model[2](model[1](model[0](x))).detach())
    torch._dynamo.reset()
