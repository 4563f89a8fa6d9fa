"""The interception mechanism: only a watched module's own calls, named as written, editable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope.engine.function_mode import FunctionCall, FunctionWatcher
from hookscope.engine.naming.function_names import function_name
from tests.functional_models import FusedSelfAttention, SeedLeNet


def watched(model: nn.Module, module: nn.Module, *args: Any, names: set[str] | None = None,
            on_call: Callable[[FunctionCall], Any] | None = None,
            deep: bool = False) -> tuple[Any, list[FunctionCall]]:
    """Run ``model(*args)`` watching ``module``; return the output and every reported call."""
    seen: list[FunctionCall] = []

    def record(call: FunctionCall) -> Any:
        seen.append(call)
        return on_call(call) if on_call else None
    watcher = FunctionWatcher()
    watcher.watch(module, record, names=names, deep=deep)
    handles: list[RemovableHandle] = []
    watcher.install(handles)
    try:
        return model(*args), seen
    finally:
        for handle in handles:
            handle.remove()
        watcher.close()


def test_seed_lenet_root_calls_in_order_with_exact_values() -> None:
    net, x = SeedLeNet(), torch.randn(2, 3, 32, 32)
    _, seen = watched(net, net, x, names={"relu", "max_pool2d"})
    assert [(c.name, c.occurrence) for c in seen] == [
        ("relu", 0), ("max_pool2d", 0), ("relu", 1), ("max_pool2d", 1), ("relu", 2), ("relu", 3)]
    expected = F.relu(net.conv2(F.max_pool2d(F.relu(net.conv1(x)), 2)))
    assert torch.equal(seen[2].output, expected)
    assert seen[3].output.shape == (2, 16, 5, 5)


def test_calls_inside_children_are_not_the_parents() -> None:
    class Child(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(x) * 2

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Child()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.child(torch.tanh(x)))

    model, x = Parent(), torch.randn(3)
    _, own = watched(model, model, x)
    assert [c.name for c in own] == ["tanh", "sigmoid"]
    _, deep = watched(model, model, x, deep=True)
    assert [c.name for c in deep] == ["tanh", "relu", "mul", "sigmoid"]
    _, child = watched(model, model.child, x)
    assert [c.name for c in child] == ["relu", "mul"]
    assert torch.equal(child[0].output, F.relu(torch.tanh(x)))


def test_nested_watches_each_see_their_own_calls() -> None:
    net, x = SeedLeNet(), torch.randn(1, 3, 32, 32)
    seen: dict[str, list[str]] = {"root": [], "conv1": []}
    watcher = FunctionWatcher()
    watcher.watch(net.conv1, lambda c: seen["conv1"].append(c.name))
    watcher.watch(net, lambda c: seen["root"].append(c.name), names={"relu"})
    handles: list[RemovableHandle] = []
    watcher.install(handles)
    net(x)
    for handle in handles:
        handle.remove()
    watcher.close()
    assert seen == {"root": ["relu"] * 4, "conv1": ["conv2d"]}


def test_names_as_written() -> None:
    class Names(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = F.softmax(x, -1) + torch.softmax(x, -1) + x.softmax(-1)
            return a[0] + F.relu(x).T.sum() + torch.relu(x).relu().mean()

    model = Names()
    _, seen = watched(model, model, torch.randn(2, 3))
    names = [c.name for c in seen]
    assert names.count("softmax") == 3 and names.count("relu") == 3
    assert {"getitem", "add", "T", "sum", "mean"} <= set(names)
    assert function_name(F.max_pool2d) == "max_pool2d"
    assert function_name(F.scaled_dot_product_attention) == "scaled_dot_product_attention"


def test_edit_replaces_the_return_value_for_what_follows() -> None:
    net, x = SeedLeNet(), torch.randn(2, 3, 32, 32)
    y, _ = watched(net, net, x, names={"relu"},
                   on_call=lambda c: c.output * 0 if c.occurrence == 3 else None)
    assert torch.equal(y, net.fc3(torch.zeros(2, 84)).detach())


def test_sdpa_arguments_bound_to_documented_names() -> None:
    model, x = FusedSelfAttention(causal=True), torch.randn(2, 5, 16)
    _, seen = watched(model, model, x, names={"scaled_dot_product_attention"})
    named = seen[0].named_arguments()
    q, k, v = model.split(x)
    assert list(named) == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                           "scale", "enable_gqa"]
    assert torch.equal(named["query"], q) and torch.equal(named["value"], v)
    assert named["is_causal"] is True and named["attn_mask"] is None


def test_unwatched_modules_carry_no_hook_and_no_mode_is_left() -> None:
    net = SeedLeNet()
    watcher = FunctionWatcher()
    watcher.watch(net.conv1, lambda c: None)
    handles: list[RemovableHandle] = []
    watcher.install(handles)
    hooked = {n for n, m in net.named_modules() if m._forward_pre_hooks or m._forward_hooks}
    for handle in handles:
        handle.remove()
    assert hooked == {"conv1"}  # a leaf: no children to suspend
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_an_exception_inside_forward_leaves_no_mode_behind(error: type[BaseException]) -> None:
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(F.relu(x))
            raise error("inside forward")

    model = Breaks()
    with pytest.raises(error):
        watched(model, model, torch.randn(3))
    assert torch._C._len_torch_function_stack() == 0
    assert torch.equal(torch.relu(torch.tensor([-1.0])), torch.tensor([0.0]))


# Generated variants: any interleaving of own function calls and child calls.
OWN = {"relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "neg": torch.neg}


class Scripted(nn.Module):
    """Runs a list of steps: a function name (own call) or ``"child"`` (a child that calls relu
    and tanh itself, which the parent must not see)."""

    def __init__(self, steps: list[str]) -> None:
        super().__init__()
        self.steps = steps
        self.child = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = self.child(x) if step == "child" else OWN[step](x)
        return x


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([*OWN, "child"]), max_size=8), st.integers(1, 3))
def test_generated_forwards_report_exactly_their_own_calls(steps: list[str], runs: int) -> None:
    model = Scripted(steps)
    seen: list[FunctionCall] = []
    watcher = FunctionWatcher()
    watcher.watch(model, seen.append)
    handles: list[RemovableHandle] = []
    watcher.install(handles)
    x = torch.randn(2, 4)
    for _ in range(runs):
        model(x)
    for handle in handles:
        handle.remove()
    own = [s for s in steps if s != "child"]
    assert [c.name for c in seen] == own * runs
    assert [c.module_call for c in seen] == [r for r in range(runs) for _ in own]
    assert [c.occurrence for c in seen] == [own[:i].count(s) for i, s in enumerate(own)] * runs
    # Each recorded value equals the plain recomputation of its step.
    value, own_calls = x, iter(seen)
    for step in steps:
        value = model.child(value) if step == "child" else OWN[step](value)
        if step != "child":
            assert torch.equal(next(own_calls).output, value)
