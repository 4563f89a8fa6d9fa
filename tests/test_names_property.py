"""Property: in random module trees with wrappers at random depths, shared modules (aliases),
parametrized weights and in-place writers, every name a user can see resolves to its module,
and captures equal a plain-hook reference computed in the same grad mode (issue 10)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrizations

import hookscope
from hookscope.engine.naming.names import index
from hookscope.engine.naming.selection import resolve
from tests.models import Residual

WIDTH = 4


class Wrapper(nn.Module):
    """A look-alike wrapper (the kind DDP/FSDP/checkpoint_wrapper are)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._test_wrapped_module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._test_wrapped_module(x)


class Twice(nn.Module):
    """Calls one child under two attribute names (a shared / tied module)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.first = inner
        self.second = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _leaf(kind: str) -> nn.Module:
    if kind == "orthogonal":
        return parametrizations.orthogonal(nn.Linear(WIDTH, WIDTH))
    if kind == "weight_norm":
        return parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH))
    return {"linear": lambda: nn.Linear(WIDTH, WIDTH), "relu_": lambda: nn.ReLU(inplace=True),
            "tanh": nn.Tanh}[kind]()


def trees() -> st.SearchStrategy[nn.Module]:
    leaves = st.sampled_from(["linear", "relu_", "tanh", "orthogonal", "weight_norm"]).map(_leaf)
    return st.recursive(leaves, lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(lambda cs: nn.Sequential(*cs)),
        children.map(Wrapper), children.map(Twice), children.map(Residual),
    ), max_leaves=7)


def _raw_names(model: nn.Module) -> list[str]:
    """Every attribute path of every module (shared ones under each of their names)."""
    return [p for p, _ in model.named_modules(remove_duplicate=False)
            if p and ".parametrizations" not in f".{p}" and not p.startswith("parametrizations")]


@settings(max_examples=80, deadline=None)
@given(model=trees(), grad=st.booleans(), seed=st.integers(0, 2**16))
def test_every_visible_name_resolves_and_captures_equal_plain_hooks(model: nn.Module, grad: bool,
                                                                    seed: int) -> None:
    torch.manual_seed(seed)
    names = index(model)
    for raw in _raw_names(model):  # raw paths with wrapper segments, and every alias
        module = model.get_submodule(raw)
        if raw in names.wrappers:
            continue
        [target] = resolve(model, [raw])
        assert target.module is module, raw
        assert raw == target.path or raw in target.aliases or "_test_wrapped_module" in raw
    for key in model.state_dict():  # every state_dict key selects the module that holds it
        [target] = resolve(model, [key])
        owner = f".{key}".rpartition(".")[0].split(".parametrizations")[0].lstrip(".")
        assert target.module is model.get_submodule(owner), key
    paths = [p for p, m in names.modules.items() if p and type(m).forward is not nn.Module.forward]
    if not paths:
        return
    x = torch.randn(2, WIDTH)
    reference = _plain_outputs({p: names.modules[p] for p in paths}, model, x.clone(), grad)
    with torch.set_grad_enabled(grad), hookscope.capture(model, "**", on_unfired="ignore") as acts:
        model(x.clone())  # x.clone(): an in-place leaf may write its input
    for path in paths:
        assert acts.counts[path] == len(reference[path]), path
        for got, expected in zip(acts.calls(path), reference[path]):
            assert torch.equal(got, expected), path


def _plain_outputs(modules: dict[str, nn.Module], model: nn.Module, x: torch.Tensor,
                   grad: bool) -> dict[str, list[torch.Tensor]]:
    """Every call's output with bare forward hooks that clone, in grad mode ``grad``."""
    seen: dict[str, list[torch.Tensor]] = {p: [] for p in modules}
    handles = [m.register_forward_hook(lambda _, a, o, p=p: seen[p].append(o.detach().clone()))
               for p, m in modules.items()]
    try:
        with torch.set_grad_enabled(grad):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen
