"""Function-level addresses ``path::name[#N][parts]`` in every verb, with values from plain PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope
from hookscope.cli.main import main
from hookscope.errors import (
    EditError,
    HookNeverFiredError,
    HookNeverFiredWarning,
    HookscopeError,
    SelectorError,
)
from tests.functional_models import Block, EagerSelfAttention, FusedSelfAttention, SeedLeNet


def lenet_relus(net: SeedLeNet, x: torch.Tensor) -> list[torch.Tensor]:
    """The four F.relu values of the seed LeNet, computed by hand."""
    a = F.relu(net.conv1(x))
    b = F.relu(net.conv2(F.max_pool2d(a, 2)))
    c = F.relu(net.fc1(F.max_pool2d(b, 2).flatten(1)))
    return [a, b, c, F.relu(net.fc2(c))]


@pytest.fixture
def lenet() -> tuple[SeedLeNet, torch.Tensor]:
    return SeedLeNet(), torch.randn(2, 3, 32, 32)


def test_seed_lenet_relu_and_max_pool2d(lenet: tuple[SeedLeNet, torch.Tensor]) -> None:
    net, x = lenet
    with torch.no_grad():
        with hookscope.capture(net, "::relu", "::max_pool2d", "::relu#1") as acts:
            net(x)
        expected = lenet_relus(net, x)
    calls = acts.calls("::relu")
    assert len(calls) == 4
    for got, want in zip(calls, expected):
        assert torch.equal(got, want)
    assert acts["::max_pool2d", 1].shape == (2, 16, 5, 5)
    assert torch.equal(acts["::relu#1"], expected[1])  # call 1 of each forward: one record
    assert acts.counts == {"::relu": 4, "::max_pool2d": 2, "::relu#1": 1}


def test_globs_types_and_parts_compose_with_the_function_name() -> None:
    model = nn.Sequential(Block(EagerSelfAttention()), Block(FusedSelfAttention()))
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        with hookscope.capture(model, "*.attn::softmax", "type:Block::gelu",
                               "1.attn::unbind[2]", "**::scaled_dot_product_attention") as acts:
            model(x)
        q, k, v = model[0].attn.split(x)
        hidden = x + model[0].attn(x)
        first = hidden + F.gelu(model[0].fc(hidden))
        _, _, v1 = model[1].attn.split(first)
    made = [path for path, count in acts.counts.items() if count]
    assert made == ["0::gelu", "0.attn::softmax", "1::gelu", "1.attn::unbind[2]",
                    "1.attn::scaled_dot_product_attention"]  # '**' also matched 8 that did not
    torch.testing.assert_close(acts["0.attn::softmax"],
                               torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1))
    assert torch.equal(acts["0::gelu"], F.gelu(model[0].fc(hidden)))
    assert torch.equal(acts["1.attn::unbind[2]"], v1)
    assert acts["1.attn::scaled_dot_product_attention"].shape == (2, 4, 5, 4)


def test_inputs_are_bound_to_the_function_parameters() -> None:
    model, x = FusedSelfAttention(causal=True), torch.randn(2, 5, 16)
    with torch.no_grad():
        with hookscope.capture(model, "::scaled_dot_product_attention", inputs=True) as acts:
            model(x)
        q, k, v = model.split(x)
    named = acts.inputs("::scaled_dot_product_attention")
    assert torch.equal(named["query"], q) and torch.equal(named["key"], k)
    assert torch.equal(named["value"], v)
    assert named["is_causal"] is True and named["attn_mask"] is None and named["scale"] is None


def test_saved_keys_round_trip(lenet: tuple[SeedLeNet, torch.Tensor], tmp_path: Path) -> None:
    net, x = lenet
    with torch.no_grad(), hookscope.capture(net, "::relu", "::max_pool2d#1") as acts:
        net(x)
    acts.save(tmp_path / "acts.safetensors")
    loaded = hookscope.load(tmp_path / "acts.safetensors")
    assert sorted(loaded) == ["::max_pool2d#1", "::relu:0", "::relu:1", "::relu:2", "::relu:3"]
    assert torch.equal(loaded["::relu", 1], acts["::relu", 1])
    assert torch.equal(loaded["::max_pool2d#1"], acts["::max_pool2d#1"])


def test_edit_ablate_patch_steer_on_function_values(lenet: tuple[SeedLeNet, torch.Tensor]) -> None:
    net, x = lenet
    with torch.no_grad():
        a, b, c, d = lenet_relus(net, x)
        with hookscope.edit(net, {"::relu": lambda out, path, call: out * 2 if call == 3 else None},
                            context=True):
            doubled = net(x)
        assert torch.equal(doubled, net.fc3(d * 2))
        with hookscope.ablate(net, "::relu#3"):
            ablated = net(x)
        assert torch.equal(ablated, net.fc3(torch.zeros_like(d)))
        other = torch.randn(2, 3, 32, 32)
        with hookscope.capture(net, "::relu#2") as source:
            net(other)
        with hookscope.patch(net, source=source, layers="::relu#2"):
            patched = net(x)
        assert torch.equal(patched, net.fc3(F.relu(net.fc2(source["::relu#2"]))))
        vector = torch.randn(84)
        with hookscope.steer(net, {"::relu#3": vector}, scale=0.5):
            steered = net(x)
        torch.testing.assert_close(steered, net.fc3(d + 0.5 * vector))
        assert torch.equal(net(x), net.fc3(d))  # everything removed
    with pytest.raises(EditError, match="edit that value"):
        hookscope.edit(net, {"::relu": lambda args, kwargs: None}, inputs=True)


def test_stats_and_compare_take_function_addresses(lenet: tuple[SeedLeNet, torch.Tensor]) -> None:
    net, x = lenet
    with torch.no_grad():
        found = hookscope.stats(net, [x, x], "::relu#0")
        a = lenet_relus(net, x)[0]
    running = found["::relu#0"]
    assert int(running.count) == 2 * a.numel()
    assert float(running.min) == 0.0
    torch.testing.assert_close(float(running.mean), float(a.double().mean()))
    half = SeedLeNet().to(torch.float64)
    half.load_state_dict(net.state_dict())
    comparison = hookscope.compare(net, half, x, layers="::relu")
    assert [(d.path, d.call_index) for d in comparison.diffs if d.path] == [
        ("::relu", k) for k in range(4)]


def test_a_module_that_ran_without_the_call_is_explained(lenet: tuple[SeedLeNet, torch.Tensor]) -> None:
    net, x = lenet
    with pytest.raises(HookNeverFiredError, match=r"'conv1' ran 1 time but its own forward never "
                                                  r"made any relu.*--ops"):
        with hookscope.capture(net, "conv1::relu", on_unfired="error"):
            net(x)
    with pytest.raises(HookNeverFiredError, match=r"never made call 4 of relu"):
        with hookscope.capture(net, "::relu#4", on_unfired="error"):
            net(x)
    with pytest.raises(HookNeverFiredError, match=r"'conv1' ran 1 time .* it made: conv2d \(calls"):
        with hookscope.capture(net, "conv1::relu", on_unfired="error"):
            net(x)
    with pytest.raises(SelectorError, match=r"'::relu#x'.*'#N' for its N-th call"):
        hookscope.capture(net, "::relu#x")
    with pytest.raises(SelectorError, match="no module or state_dict key named 'conv9'"):
        hookscope.capture(net, "conv9::relu")


def test_scripted_models_are_refused_before_running() -> None:
    """(A compiled model's calls are captured and edited: tests/test_compile_functions.py.)"""
    scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(HookscopeError, match="TorchScript"):
        hookscope.capture(scripted, "0::linear")


def test_module_addresses_add_no_function_mode(lenet: tuple[SeedLeNet, torch.Tensor]) -> None:
    net, x = lenet
    depth: list[int] = []

    def spy(module: nn.Module, args: tuple[torch.Tensor], output: torch.Tensor) -> None:
        depth.append(torch._C._len_torch_function_stack())
    handle = net.conv2.register_forward_hook(spy)
    try:
        with hookscope.capture(net, "conv2", "fc1"), hookscope.edit(net, {"fc2": lambda o: o}):
            net(x)
        with hookscope.capture(net, "::relu"):
            net(x)
    finally:
        handle.remove()
    assert depth == [0, 0]  # conv2 is a child of the watched root: the mode is left while it runs


def lenet_factory() -> nn.Module:
    torch.manual_seed(0)
    return SeedLeNet()


def test_cli_capture_with_a_function_address(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "acts.safetensors"
    assert main(["capture", "tests.test_functional_addresses:lenet_factory", "--input",
                 "randn:2,3,32,32", "--layers", "::max_pool2d", "--save", str(out)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "max_pool2d" in line]
    assert [row[:3] for row in rows] == [["::max_pool2d", "0", "2x6x14x14"],
                                         ["::max_pool2d", "1", "2x16x5x5"]]
    assert sorted(hookscope.load(out)) == ["::max_pool2d:0", "::max_pool2d:1"]


def test_cli_stats_and_diff_with_function_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    model = "tests.test_functional_addresses:lenet_factory"
    assert main(["stats", model, "--input", "randn:2,3,32,32", "--layers", "::relu#0"]) == 0
    [row] = [line.split() for line in capsys.readouterr().out.splitlines()
             if line.startswith("::relu#0")]
    assert row[1] == str(2 * 6 * 28 * 28) and row[4] == "0"  # count, min
    assert main(["diff", model, model, "--input", "randn:2,3,32,32", "--layers",
                 "::max_pool2d"]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()
            if line.startswith("::max_pool2d")]
    assert rows == [["::max_pool2d", "0", "2x6x14x14"], ["::max_pool2d", "1", "2x16x5x5"]]


def test_extract_stores_a_function_value_row_by_row(tmp_path: Path) -> None:
    net = SeedLeNet()
    batches = [torch.randn(4, 3, 32, 32) for _ in range(3)]
    store = hookscope.extract(net, batches, "::relu#1", tmp_path / "store", progress=False)
    with torch.no_grad():
        expected = torch.cat([lenet_relus(net, batch)[1] for batch in batches])
    assert store["::relu#1"][0:12].shape == (12, 16, 10, 10)
    assert torch.equal(store["::relu#1"][0:12], expected)


def test_capture_inside_an_edit_of_the_same_call_sees_the_edited_value(
        lenet: tuple[SeedLeNet, torch.Tensor]) -> None:
    net, x = lenet
    with torch.no_grad():
        with hookscope.ablate(net, "::relu#3"), hookscope.capture(net, "::relu") as acts:
            y = net(x)
        expected = lenet_relus(net, x)
    assert torch.equal(acts["::relu", 3], torch.zeros(2, 84))
    assert torch.equal(acts["::relu", 2], expected[2])
    assert torch.equal(y, net.fc3(torch.zeros(2, 84)))
    assert acts.counts == {"::relu": 4}  # neither session saw the other's own torch calls


def test_gpt2s_softmax_address_warns_naming_scaled_dot_product_attention() -> None:
    """The new user's stumble (issue 34): GPT-2's sdpa attention makes no softmax; the
    warning names what its forward made instead, and records nothing."""
    from tests.models import tiny_gpt2

    model = tiny_gpt2()
    with pytest.warns(HookNeverFiredWarning) as caught:
        with hookscope.capture(model, "transformer.h.1.attn::softmax") as acts:
            model(torch.tensor([[1, 2, 3]]))
    [line] = [line for line in str(caught[0].message).splitlines()
              if line.startswith("  - transformer.h.1.attn::softmax: ")]
    assert "'transformer.h.1.attn' ran 1 time but its own forward never made any softmax; it " \
           "made: " in line
    made = line.split("it made: ", 1)[1].split(" (calls made inside", 1)[0].split(", ")
    assert "scaled_dot_product_attention" in made and "softmax" not in made
    assert "linear" not in made and "addmm" not in made  # c_attn's and c_proj's: their own
    assert list(acts) == [] and acts.unfired["transformer.h.1.attn::softmax"] in line


def test_an_address_that_matched_no_call_names_the_calls_the_forward_made() -> None:
    """GPT-2-style attention makes scaled_dot_product_attention, not softmax: the reason names
    the calls its own forward made (in order, each once), not those of its children."""
    block = Block(FusedSelfAttention())
    with hookscope.capture(block, "attn::softmax", on_unfired="ignore") as acts:
        block(torch.randn(2, 5, 16))
    reason = acts.unfired["attn::softmax"]
    made = reason.split("it made: ", 1)[1].split(" (calls made inside", 1)[0].split(", ")
    # qkv and out are child nn.Linear modules: their linear calls are theirs, not listed
    assert made == ["shape", "view", "permute", "dim", "unbind", "scaled_dot_product_attention",
                    "transpose", "flatten"]
    identity = nn.Sequential(nn.Identity())
    with hookscope.capture(identity, "0::relu", on_unfired="ignore") as acts:
        identity(torch.randn(2, 3))
    assert "never made any relu; it made no torch call of its own (" in acts.unfired["0::relu"]
