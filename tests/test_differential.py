"""Differential: hookscope's captures equal plain register_forward_hook, call for call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from tests.models import ZOO, Residual
from tests.reference import assert_same, plain_capture


def _hookable_paths(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules()
            if p and type(m).forward is not nn.Module.forward]


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_every_module_equals_plain_hooks(name: str) -> None:
    factory, make_input = ZOO[name]
    model = factory().eval()
    args = make_input()
    paths = _hookable_paths(model)
    reference = plain_capture(model, paths, *args, grad_enabled=False)
    with torch.no_grad(), hookscope.capture(model, "**", on_unfired="ignore", clone=True) as acts:
        model(*args)
    ran = [p for p in paths if reference[p]]
    assert [p for p in acts.paths if acts.counts[p]] == ran
    for path in ran:
        assert len(acts.calls(path)) == len(reference[path])
        for got, want in zip(acts.calls(path), reference[path]):
            assert_same(got, want)


class Repeat(nn.Module):
    """Calls one child several times (module reuse)."""

    def __init__(self, inner: nn.Module, times: int) -> None:
        super().__init__()
        self.inner, self.times = inner, times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = self.inner(x)
        return x


class Stack(nn.Module):
    """A ModuleList iterated in forward (the container is never called)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


WIDTH = 4


def trees() -> st.SearchStrategy[nn.Module]:
    leaves = st.sampled_from(["linear", "relu", "relu_", "tanh", "identity"]).map(_leaf)
    return st.recursive(leaves, lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(lambda cs: nn.Sequential(*cs)),
        st.lists(children, min_size=1, max_size=3).map(Stack),
        children.map(Residual),
        st.tuples(children, st.integers(2, 3)).map(lambda t: Repeat(*t)),
    ), max_leaves=8)


def _leaf(kind: str) -> nn.Module:
    return {"linear": lambda: nn.Linear(WIDTH, WIDTH), "relu": nn.ReLU,
            "relu_": lambda: nn.ReLU(inplace=True), "tanh": nn.Tanh, "identity": nn.Identity}[kind]()


@settings(max_examples=40, deadline=None)
@given(model=trees(), seed=st.integers(0, 2**16))
def test_random_trees_equal_plain_hooks_with_default_clone_policy(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(2, WIDTH)
    paths = _hookable_paths(model)
    if not paths:
        return
    # x.clone(): an in-place leaf may write the input
    reference = plain_capture(model, paths, x.clone(), grad_enabled=False)
    for _ in range(2):  # the first session learns the in-place policy, the second uses it
        with torch.no_grad(), hookscope.capture(model, "**", on_unfired="ignore") as acts:
            model(x.clone())
        for path in paths:
            assert acts.counts[path] == len(reference[path])
            for got, want in zip(acts.calls(path), reference[path]):
                assert torch.equal(got, want)
