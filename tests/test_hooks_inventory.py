"""hooks(model) lists every hook whoever registered it; remove_hooks clears leaked ones."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.utils import weight_norm
from torch.nn.utils.weight_norm import WeightNorm

import hookscope
from hookscope.engine.door.hooks import OwnedHook, register
from hookscope.engine.door.sharing import ModuleHooks
from hookscope.engine.door.tables import GLOBAL_FLAGS, GLOBAL_TABLES, MODULE_FLAGS, MODULE_TABLES
from tests.models import MlpStack


def leaked_hook(module: nn.Module, args: object, output: object) -> None:
    return None


def test_torch_private_hook_dicts_still_exist() -> None:
    """Fails loudly if torch renames the dictionaries the inventory reads."""
    module = nn.Linear(1, 1)
    for attr in (*MODULE_TABLES.values(), *MODULE_FLAGS):
        assert isinstance(getattr(module, attr), dict), attr
    assert module._is_full_backward_hook is None
    for attr in (*GLOBAL_TABLES.values(), *GLOBAL_FLAGS):
        assert isinstance(getattr(torch_module, attr), dict), attr
    assert torch_module._global_is_full_backward_hook is None


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


def _global_state() -> dict[str, object]:
    return {attr: dict(getattr(torch_module, attr)) for attr in (*GLOBAL_TABLES.values(), *GLOBAL_FLAGS)} | {
        "full": torch_module._global_is_full_backward_hook}


def test_remove_hooks_leaves_torchs_global_tables_as_it_found_them() -> None:
    """Issue 34 item 2: a leaked global hook's flags went with it only from the hook table (its
    ``with_kwargs`` and ``always_call`` entries stayed), and the "full backward hook" mark stayed
    set, so a later ``register_module_backward_hook`` raised 'Cannot use both'."""
    before = _global_state()
    torch_module.register_module_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
    torch_module.register_module_forward_pre_hook(lambda m, a: None)
    torch_module.register_module_full_backward_hook(lambda m, gi, go: None)
    assert _global_state() != before
    assert hookscope.remove_hooks(MlpStack(), include_global=True) == 3
    assert _global_state() == before
    handle = torch_module.register_module_backward_hook(lambda m, gi, go: None)  # raised before
    handle.remove()
    torch_module._global_is_full_backward_hook = before["full"]


def test_remove_hooks_leaves_a_modules_tables_as_it_found_them() -> None:
    model = MlpStack()
    tables = (*MODULE_TABLES.values(), *MODULE_FLAGS, "_is_full_backward_hook")
    before = {attr: copy.copy(getattr(model.fc1, attr)) for attr in tables}
    model.fc1.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
    model.fc1.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    model.fc1.register_full_backward_hook(lambda m, gi, go: None)
    assert hookscope.remove_hooks(model) == 3
    assert {attr: getattr(model.fc1, attr) for attr in tables} == before
    model.fc1.register_backward_hook(lambda m, gi, go: None).remove()  # raised 'Cannot use both' before


def test_wrapped_model_hooks_keep_inner_names() -> None:
    model = MlpStack()
    dp = nn.DataParallel(model)
    model.fc1.register_forward_hook(leaked_hook)
    assert [(h.path, h.kind) for h in hookscope.hooks(dp)] == [("fc1", "forward")]
    assert hookscope.remove_hooks(dp) == 1


# ------------------------------------------------------------- case 28: hooks that are the model
def test_28_remove_hooks_keeps_weight_norm_and_lazy_init_and_lists_them_as_internal() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        wn = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.ReLU(), nn.Linear(4, 2))
    lazy = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    model = nn.ModuleDict({"wn": wn, "lazy": lazy})
    wn[2].register_forward_hook(leaked_hook)
    found = {(h.path, h.function): h for h in hookscope.hooks(model)}
    assert set(found) == {("wn.0", "WeightNorm"), ("lazy.0", "LazyModuleMixin._infer_parameters"),
                          ("wn.2", "leaked_hook")}
    assert found["wn.0", "WeightNorm"].internal and found["wn.0", "WeightNorm"].registered_by == "torch"
    assert found["lazy.0", "LazyModuleMixin._infer_parameters"].internal
    leak = found["wn.2", "leaked_hook"]
    assert not leak.internal and leak.registered_by == "user code (tests.test_hooks_inventory)"

    assert hookscope.remove_hooks(model) == 1  # only the leak
    assert [h.function for h in hookscope.hooks(model)] == ["WeightNorm", "LazyModuleMixin._infer_parameters"]
    x = torch.randn(2, 4)
    before = wn(x)
    with torch.no_grad():
        wn[0].weight_g.mul_(0.0)  # weight_norm still follows weight_g: the layer now outputs its bias
    assert not torch.allclose(before, wn(x))
    assert torch.equal(wn[0](x), wn[0].bias.expand(2, 4))
    assert lazy(x).shape == (2, 2) and lazy[0].weight.shape == (8, 4)  # still initialises

    fresh = nn.Sequential(nn.LazyLinear(3))
    assert hookscope.remove_hooks(fresh, include_internal=True) == 1  # asked for: removed
    assert hookscope.hooks(fresh) == []


def test_hooks_of_a_partial_and_of_a_callable_object_name_their_package() -> None:
    model = nn.Linear(2, 2)
    model.register_forward_hook(functools.partial(leaked_hook))
    model.register_forward_pre_hook(WeightNorm("weight", 0))  # torch's class, registered by hand
    owners = [(h.function, h.registered_by, h.internal) for h in hookscope.hooks(model)]
    assert owners == [("WeightNorm", "torch", True),
                      ("leaked_hook", "user code (tests.test_hooks_inventory)", False)]
    assert hookscope.remove_hooks(model, include_internal=True) == 2


def test_28_quantization_observers_are_internal_and_calibration_still_records() -> None:
    from tests.test_values_kinds import QNet
    model = QNet().eval()
    model.qconfig = tq.get_default_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = tq.prepare(tq.fuse_modules(model, [["conv", "bn", "relu"]]))
    found = [(h.path, h.function, h.registered_by, h.internal) for h in hookscope.hooks(prepared)]
    assert found == [("quant", "_observer_forward_hook", "torch", True),
                     ("conv", "_observer_forward_hook", "torch", True)]
    assert hookscope.remove_hooks(prepared) == 0
    prepared(torch.full((1, 1, 8, 8), 3.0))
    observer = prepared.quant.activation_post_process
    assert float(observer.max_val) == 3.0  # the observer still sees calibration data


@pytest.mark.parametrize(("pre", "with_kwargs"), [(False, False), (True, False), (False, True), (True, True)])
def test_the_doors_bulk_hooks_are_what_torchs_registration_writes(pre: bool, with_kwargs: bool) -> None:
    """Issue 34 item 2: ``ModuleHooks`` writes torch's tables beside ``register`` (in the door,
    for speed): the same tables, the same flags, the hook in the same place as torch's
    ``register_forward_(pre_)hook`` puts it, and ``remove`` leaves them as they were."""
    def tables(module: nn.Module) -> dict[str, list[object]]:
        return {attr: list(getattr(module, attr).values())
                for attr in (*MODULE_TABLES.values(), *MODULE_FLAGS)}

    by_torch, by_door = nn.Linear(2, 2), nn.Linear(2, 2)
    empty = tables(by_door)
    hook = OwnedHook(lambda *a: None, by_torch)
    handle = register(by_torch, hook, pre=pre, with_kwargs=with_kwargs)
    bulk = ModuleHooks()
    owned = OwnedHook(lambda *a: None, by_door)
    bulk.add(owned, pre=pre, with_kwargs=with_kwargs)
    expected = {attr: [owned.__call__ if v == hook.__call__ else v for v in values]
                for attr, values in tables(by_torch).items()}
    assert tables(by_door) == expected and expected != empty
    handle.remove()
    bulk.remove()
    assert tables(by_door) == empty == tables(by_torch)


def test_an_observers_owned_hook_keeps_its_compiled_path_when_unfired_modules_are_explained() -> None:
    """A review found ``Observer`` wrapping an ``OwnedHook`` in its ran-marker closure before
    the ``isinstance`` test (``explain_unfired=True``, the default): the hook went in as a plain
    function, its ``pick`` (the compiled-graph path) lost. Now its function is marked instead."""
    from hookscope.engine import Observer, OwnedHook, Target, output_of, owner

    model = nn.Sequential(nn.Linear(2, 2))
    seen: list[torch.Tensor] = []
    hook = OwnedHook(lambda module, args, output: seen.append(output), model[0], pick=output_of)
    session = Observer(model, [Target("0", model[0])], forward=lambda target: hook)
    with session:
        [entry] = model[0]._forward_hooks.values()
        assert owner(entry) is hook and hook.pick is output_of
        model(torch.ones(1, 2))
    assert len(seen) == 1 and "0" in session._ran
    assert not model[0]._forward_hooks
