"""hooks(model) lists every hook whoever registered it; remove_hooks clears leaked ones."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as torch_module

import hookscope
from hookscope.hooks import _GLOBAL_DICTS, _HOOK_DICTS, _SIDE_DICTS
from tests.models import MlpStack


def leaked_hook(module: nn.Module, args: object, output: object) -> None:
    return None


def test_torch_private_hook_dicts_still_exist() -> None:
    """Fails loudly if torch renames the dictionaries the inventory reads."""
    module = nn.Linear(1, 1)
    for attr in (*_HOOK_DICTS.values(), *_SIDE_DICTS):
        assert isinstance(getattr(module, attr), dict), attr
    for attr in _GLOBAL_DICTS.values():
        assert isinstance(getattr(torch_module, attr), dict), attr


def test_inventory_lists_kind_function_and_source() -> None:
    model = MlpStack()
    model.fc1.register_forward_hook(leaked_hook)
    model.fc2.register_forward_pre_hook(lambda m, a: None)
    model.register_full_backward_hook(lambda m, gi, go: None)
    found = hookscope.hooks(model)
    assert [(h.path, h.kind) for h in found] == [("", "backward"), ("fc1", "forward"), ("fc2", "forward_pre")]
    assert found[1].function == "leaked_hook"
    assert found[1].source.endswith(f"test_hooks_inventory.py:{leaked_hook.__code__.co_firstlineno}")
    assert hookscope.remove_hooks(model) == 3
    assert hookscope.hooks(model) == []
    assert model(torch.randn(1, 10)).shape == (1, 5)


def test_inventory_sees_hookscope_hooks_only_while_active() -> None:
    model = MlpStack()
    with hookscope.capture(model, "fc1", "fc2") as acts:
        inside = hookscope.hooks(model)
        model(torch.randn(1, 10))
    assert {(h.path, h.kind) for h in inside} >= {("fc1", "forward"), ("fc2", "forward")}
    assert hookscope.hooks(model) == [] and acts.counts == {"fc1": 1, "fc2": 1}


def test_global_hooks_listed_and_removed_only_on_request() -> None:
    handle = torch_module.register_module_forward_hook(leaked_hook)
    try:
        model = MlpStack()
        assert [(h.path, h.kind) for h in hookscope.hooks(model)] == [("*", "global_forward")]
        assert hookscope.remove_hooks(model) == 0
        assert hookscope.remove_hooks(model, include_global=True) == 1
    finally:
        handle.remove()


def test_wrapped_model_hooks_keep_inner_names() -> None:
    model = MlpStack()
    dp = nn.DataParallel(model)
    model.fc1.register_forward_hook(leaked_hook)
    assert [(h.path, h.kind) for h in hookscope.hooks(dp)] == [("fc1", "forward")]
    assert hookscope.remove_hooks(dp) == 1
