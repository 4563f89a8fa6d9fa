"""Capture: values equal plain PyTorch, every call kept, structure kept, hooks always removed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import hookscope
from hookscope import CaptureError, HookNeverFiredError, HookNeverFiredWarning
from tests.models import (
    DataclassOutput,
    DictOutput,
    KwargsForward,
    LeNet,
    MlpStack,
    ModuleListBlocks,
    Pair,
    SharedLinear,
    TupleOutput,
    UnusedBranch,
)
from tests.reference import assert_same, plain_capture


def test_seed_printing_hook_shapes_on_linear() -> None:
    layer = nn.Linear(10, 5)
    with hookscope.capture(nn.Sequential(layer), "0", inputs=True) as acts:
        layer(torch.randn(2, 10))
    assert acts.inputs("0").args[0].shape == (2, 10)
    assert acts["0"].shape == (2, 5)


def test_seed_mlp_fc1_shape() -> None:
    model = MlpStack()
    out, acts = hookscope.run(model, torch.randn(1, 10), layers="fc1")
    assert acts["fc1"].shape == (1, 20)
    assert out.shape == (1, 5)


def test_lenet_conv2_equals_plain_hook() -> None:
    model = LeNet()
    x = torch.randn(2, 3, 32, 32)
    with hookscope.capture(model, "conv2") as acts:
        model(x)
    reference = plain_capture(model, ["conv2"], x, grad_enabled=True)["conv2"][0]
    assert acts["conv2"].shape == (2, 16, 10, 10)
    assert torch.equal(acts["conv2"], reference)


def test_twins_like_pos_block_conv_by_path_and_by_weight_key() -> None:
    model = ModuleListBlocks()
    x = torch.randn(2, 8, 6, 6)
    path = "pos_block.3.proj.0"
    reference = plain_capture(model, [path], x, grad_enabled=True)[path][0]
    for pattern in ["pos_block.3.proj.0", "pos_block.3.proj.0.weight"]:
        with hookscope.capture(model, pattern) as acts:
            model(x)
        assert torch.equal(acts["pos_block.3.proj.0"], reference)


def test_every_call_is_kept_in_order() -> None:
    model = SharedLinear()
    x = torch.randn(2, 6)
    with hookscope.capture(model, "lin") as acts:
        model(x)
        model(x)
    first = model.lin(x)
    second = model.lin(torch.tanh(first))
    calls = acts.calls("lin")
    assert len(calls) == 4 and acts.counts == {"lin": 4}
    assert torch.equal(calls[0], first.detach()) and torch.equal(calls[1], second.detach())
    assert torch.equal(acts["lin", -1], second.detach())
    with pytest.raises(CaptureError, match=r"ran 4 times.*acts\['lin', k\].*acts\.calls\('lin'\)"):
        acts["lin"]
    with pytest.raises(CaptureError, match=r"call 4 does not exist"):
        acts["lin", 4]


def test_tensors_are_detached_and_keep_no_graph() -> None:
    model = MlpStack()
    x = torch.randn(3, 10, requires_grad=True)
    with hookscope.capture(model, "fc1") as acts:
        model(x)
    assert acts["fc1"].grad_fn is None and not acts["fc1"].requires_grad


def test_captured_tensors_do_not_keep_inputs_alive() -> None:
    """Case 18: 50 batches in grad mode; no input stays alive through a graph."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    refs = []
    with hookscope.capture(model, "3") as acts:
        for _ in range(50):
            x = torch.randn(32, 64)
            refs.append(weakref.ref(x))
            model(x)
            del x
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert len(acts.calls("3")) == 50
    assert sum(t.untyped_storage().nbytes() for t in acts.calls("3")) == 50 * 32 * 256 * 4


def test_tuple_output_keeps_structure_and_parts() -> None:
    model = TupleOutput()
    x = torch.randn(2, 5, 4)
    reference = plain_capture(model, ["lstm"], x, grad_enabled=True)["lstm"][0]
    with hookscope.capture(model, "lstm", "lstm[1][0]", "lstm[0]") as acts:
        model(x)
    assert_same(acts["lstm"], reference)
    assert torch.equal(acts["lstm[1][0]"], reference[1][0])
    assert acts["lstm[0]"].shape == (2, 5, 6)
    assert acts.paths == ["lstm", "lstm[1][0]", "lstm[0]"]


def test_missing_output_part_names_the_parts_that_exist() -> None:
    model = TupleOutput()
    with pytest.raises(CaptureError, match=r"has no part \[5\]; it has \[0\]\.\.\[1\]"):
        with hookscope.capture(model, "lstm[5]"):
            model(torch.randn(1, 2, 4))


def test_dict_and_dataclass_outputs_keep_structure() -> None:
    model = DictOutput()
    x = torch.randn(3, 4)
    with hookscope.capture(model, "block", "block[hidden]") as acts:
        model(x)
    assert list(acts["block"]) == ["hidden", "scale"]
    assert torch.equal(acts["block[hidden]"], model.block.a(x).detach())
    dc = DataclassOutput()
    with hookscope.capture(dc, "block") as acts:
        dc(x)
    out = acts["block"]
    assert isinstance(out, Pair) and out.second is None and out.note == "pair"
    assert torch.equal(out.first, dc.block.lin(x).detach())


def test_kwargs_inputs_bound_to_signature() -> None:
    """Case 13: everything passed by keyword is visible, by name and by position."""
    model = KwargsForward()
    x = torch.randn(1, 3, 8)
    with hookscope.capture(model, "layers.0", inputs=True) as acts:
        model(x)
    inputs = acts.inputs("layers.0")
    assert inputs.args == ()
    assert sorted(inputs.kwargs) == ["attention_mask", "hidden_states", "position_ids"]
    assert torch.equal(inputs["hidden_states"], x) and torch.equal(inputs[0], x)
    assert inputs["attention_mask"].shape == (1, 3) and inputs["position_ids"] is None


def test_inputs_not_requested_raises_with_fix() -> None:
    model = MlpStack()
    _, acts = hookscope.run(model, torch.randn(1, 10), layers="fc1")
    with pytest.raises(CaptureError, match="inputs=True"):
        acts.inputs("fc1")


def test_to_dtype_and_reduce_options() -> None:
    model = LeNet()
    x = torch.randn(2, 3, 32, 32)
    reference = plain_capture(model, ["conv2"], x, grad_enabled=True)["conv2"][0]
    options = dict(dtype=torch.float16, reduce=lambda t: t.mean(dim=(2, 3)), to="cpu")
    _, acts = hookscope.run(model, x, layers="conv2", options=options)
    assert acts["conv2"].dtype == torch.float16 and acts["conv2"].shape == (2, 16)
    assert torch.equal(acts["conv2"], reference.half().mean(dim=(2, 3)))


def test_hooks_removed_after_exception_and_keyboard_interrupt() -> None:
    """Case 17: the forward raises; afterwards no hook is left and a plain forward works."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    for error in (IndexError, KeyboardInterrupt):
        def boom(m: nn.Module, i: object, o: torch.Tensor, error: type[BaseException] = error) -> None:
            raise error("boom")
        handle = model[1].register_forward_hook(boom)
        with pytest.raises(error):
            with hookscope.capture(model, "0", "2"):
                model(torch.randn(3, 4))
        handle.remove()
        assert hookscope.hooks(model) == []
    assert model(torch.randn(3, 4)).shape == (3, 2)


def test_hooks_of_others_are_untouched() -> None:
    model = MlpStack()
    seen = []
    handle = model.fc1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with hookscope.capture(model, "fc1"):
        model(torch.randn(2, 10))
    functions = [h.function for h in hookscope.hooks(model)]
    assert functions == ["test_hooks_of_others_are_untouched.<locals>.<lambda>"]
    handle.remove()
    assert seen == [torch.Size([2, 20])]


def test_error_note_names_the_innermost_module() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.ReLU(), nn.Linear(5, 2)))
    with pytest.raises(RuntimeError, match="cannot be multiplied") as err:
        with hookscope.capture(model, "0"):
            model(torch.randn(3, 4))
    note = "hookscope: raised inside '1.1' (Linear) called with input shapes [(3, 6)]"
    assert err.value.__notes__ == [note]


def test_unfired_warning_explains_functional_call() -> None:
    """Case 02: a declared ReLU that forward never calls (it uses F.relu)."""
    model = UnusedBranch()
    with pytest.warns(HookNeverFiredWarning, match=r"relu \(ReLU\) was registered but never called.*"
                      r"modules that did run there: backbone, head.*functional"):
        with hookscope.capture(model, "relu", "head") as acts:
            model(torch.randn(2, 4))
    assert "relu" not in acts and acts.counts == {"relu": 0, "head": 1}
    with pytest.raises(CaptureError, match="never ran"):
        acts["relu"]


def test_unfired_error_mode_keeps_records() -> None:
    model = UnusedBranch()
    with pytest.raises(HookNeverFiredError, match="aux_head") as err:
        with hookscope.capture(model, "aux_head", "head", on_unfired="error"):
            model(torch.randn(2, 4))
    assert err.value.capture["head"].shape == (2, 2)
    assert list(err.value.unfired) == ["aux_head"]


def test_no_forward_inside_block_is_reported() -> None:
    model = MlpStack()
    with pytest.warns(HookNeverFiredWarning, match="no forward pass ran inside the with block"):
        with hookscope.capture(model, "fc1"):
            pass


def test_a_block_without_a_forward_lists_ten_of_many_silent_modules() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(30)))
    with pytest.warns(HookNeverFiredWarning) as caught:
        with hookscope.capture(model, "*") as acts:
            pass
    message = str(caught[0].message)
    listed = [line for line in message.splitlines() if line.startswith("  - ")]
    assert [line.split(":")[0] for line in listed[:10]] == [f"  - {i}" for i in range(10)]
    assert listed[10] == "  - … 20 more (the reason of each is in .unfired)" and len(listed) == 11
    assert len(acts.unfired) == 30
    with pytest.raises(HookNeverFiredError) as err:  # an error lists every one
        with hookscope.capture(model, "*", on_unfired="error"):
            pass
    assert sum(line.startswith("  - ") for line in str(err.value).splitlines()) == 30


def test_on_unfired_ignore_is_silent_and_bad_value_raises() -> None:
    model = UnusedBranch()
    with hookscope.capture(model, "aux_head", on_unfired="ignore") as acts:
        model(torch.randn(2, 4))
    assert acts.unfired and acts.counts == {"aux_head": 0}
    with pytest.raises(hookscope.HookscopeError, match="'warn', 'error', 'ignore'"):
        hookscope.capture(model, "head", on_unfired="loud")  # type: ignore[arg-type]


def test_capture_cannot_be_entered_twice() -> None:
    model = MlpStack()
    acts = hookscope.capture(model, "fc1")
    with acts:
        with pytest.raises(hookscope.HookscopeError, match="already active: enter it once"):
            with acts:
                pass
        model(torch.randn(1, 10))
    assert acts["fc1"].shape == (1, 20)


def test_selector_error_registers_nothing() -> None:
    model = ModuleListBlocks()
    with pytest.raises(hookscope.SelectorError):
        hookscope.capture(model, "head", "pos_block")
    assert hookscope.hooks(model) == []


def test_torchscript_is_refused_before_registration() -> None:
    """Case 08: a ScriptModule cannot run Python hooks."""
    scripted = torch.jit.script(MlpStack())
    with pytest.raises(hookscope.HookscopeError, match="Load or build the eager nn.Module instead"):
        hookscope.capture(scripted, "fc1")


def test_capture_releases_model_and_session() -> None:
    """Case 16: hooks hold no reference that keeps a finished session or the model alive."""
    model = MlpStack()
    with hookscope.capture(model, "fc1") as acts:
        model(torch.randn(1, 10))
    session, net = weakref.ref(acts), weakref.ref(model)
    del acts, model
    gc.collect()
    assert session() is None and net() is None
