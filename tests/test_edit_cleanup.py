"""Every edit removes its hooks on exit, also when the forward raises; unfired edits are reported."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import hookscope
from hookscope import HookNeverFiredError, HookNeverFiredWarning
from tests.models import MlpStack, UnusedBranch

EDITS: dict[str, Callable[[nn.Module], hookscope.Edit]] = {
    "edit": lambda m: hookscope.edit(m, {"fc1": lambda o: o + 1}),
    "edit-inputs": lambda m: hookscope.edit(m, {"fc1": lambda a, k: None}, inputs=True),
    "ablate": lambda m: hookscope.ablate(m, ["fc1", "fc2"]),
    "steer": lambda m: hookscope.steer(m, {"fc1": torch.ones(20)}),
    "patch": lambda m: hookscope.patch(m, source={"fc1": torch.zeros(3, 20)}, layers="fc1"),
}


def _count_hooks(model: nn.Module) -> int:
    return len(hookscope.hooks(model))


@pytest.mark.parametrize("name", list(EDITS))
def test_hooks_removed_on_normal_exit(name: str) -> None:
    model = MlpStack()
    with EDITS[name](model):
        assert _count_hooks(model) > 0
        model(torch.randn(3, 10))
    assert _count_hooks(model) == 0


@pytest.mark.parametrize("name", list(EDITS))
def test_hooks_removed_when_the_forward_raises(name: str) -> None:
    model = MlpStack()
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        with EDITS[name](model):
            model(torch.randn(3, 7))  # wrong width: fc1 raises
    assert _count_hooks(model) == 0
    assert model(torch.randn(3, 10)).shape == (3, 5)  # a plain forward works again


def test_hooks_removed_when_the_edit_itself_raises() -> None:
    model = MlpStack()
    with pytest.raises(ZeroDivisionError):
        with hookscope.edit(model, {"fc1": lambda o: 1 / 0}):
            model(torch.randn(3, 10))
    assert _count_hooks(model) == 0


def test_edit_of_a_module_that_never_runs_is_reported() -> None:
    model = UnusedBranch()
    with pytest.warns(HookNeverFiredWarning, match=r"(?s)never applied.*aux_head"):
        with hookscope.ablate(model, "aux_head"):
            model(torch.randn(2, 4))
    with pytest.raises(HookNeverFiredError, match="aux_head"):
        with hookscope.ablate(model, "aux_head", on_unfired="error"):
            model(torch.randn(2, 4))
    assert _count_hooks(model) == 0


def test_an_edit_is_entered_once() -> None:
    model = MlpStack()
    edits = hookscope.ablate(model, "fc1", on_unfired="ignore")
    with edits:
        with pytest.raises(hookscope.HookscopeError, match="already active"):
            edits.__enter__()
    assert _count_hooks(model) == 0


def test_input_edit_rejects_output_parts() -> None:
    with pytest.raises(hookscope.EditError, match="drop the brackets"):
        hookscope.edit(MlpStack(), {"fc1[0]": lambda a, k: None}, inputs=True)
