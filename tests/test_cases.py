"""The scenarios of shared/cases/, each holding the right value or the right error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope
from hookscope import CaptureError, HookNeverFiredWarning, SelectorError
from tests.models import DirectForwardCall, InplaceRelu, ModuleListBlocks, ReusedRelu, UnusedBranch


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(d, d), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class Case01(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pos_block = nn.ModuleList([Block(d) for _ in range(4)])
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.pos_block:
            x = blk(x)
        return self.head(x)


def test_01_modulelist_fails_before_running_and_children_capture() -> None:
    net = Case01()
    with pytest.raises(SelectorError, match=r"(?s)'pos_block' is a torch\.nn\.modules\.container\."
                       r"ModuleList.*select 'pos_block\.\*' \(matches 4 modules"):
        hookscope.capture(net, "pos_block")
    with hookscope.capture(net, "pos_block.*.proj.0", "pos_block.3.proj.0") as acts:
        net(torch.randn(2, 8))
    assert acts.paths == [f"pos_block.{i}.proj.0" for i in range(4)]
    assert [acts[p].shape for p in acts.paths] == [(2, 8)] * 4


def test_02_declared_relu_never_called_is_reported_not_empty() -> None:
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, 3)
            self.relu = nn.ReLU()
            self.fc = nn.Linear(4 * 6 * 6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(F.relu(self.conv1(x)).flatten(1))

    net = Net()
    with pytest.warns(HookNeverFiredWarning) as record:
        with hookscope.capture(net, "*relu*", "conv1") as acts:
            net(torch.randn(2, 1, 8, 8))
    message = str(record[0].message)
    assert "relu (ReLU) was registered but never called" in message
    assert "modules that did run there: conv1, fc" in message
    assert "the address '::relu' reaches that value" in message
    assert "relu" not in acts and bool((acts["conv1"] < 0).any())


def test_03_reused_relu_keeps_three_calls() -> None:
    net = ReusedRelu()
    with hookscope.capture(net, "relu") as acts:
        a, b, c = net(torch.randn(2, 6))
    calls = acts.calls("relu")
    assert len(calls) == 3
    for got, want in zip(calls, (a, b, c)):
        assert torch.equal(got, want.detach())
    with pytest.raises(CaptureError, match="ran 3 times"):
        acts["relu"]


def test_03_saved_file_keeps_call_index(tmp_path: object) -> None:
    net = ReusedRelu()
    with hookscope.capture(net, "relu", "fc1") as acts:
        a, b, c = net(torch.randn(2, 6))
    file = f"{tmp_path}/acts.safetensors"
    acts.save(file)
    loaded = hookscope.load(file)
    assert sorted(loaded) == ["fc1", "relu:0", "relu:1", "relu:2"]
    assert torch.equal(loaded["relu:2"], c.detach())


def _case04_model() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(23)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1))
    x = torch.randn(1, 3, 5, 5)
    with torch.no_grad():
        reference = model[0](x).clone()
    return model, x, reference


def test_04_inplace_relu_does_not_change_captured_conv_output() -> None:
    model, x, reference = _case04_model()
    for _ in range(3):  # every session is right, the first as the later ones
        with torch.no_grad(), hookscope.capture(model, "0") as acts:
            model(x)
        assert torch.equal(acts["0"], reference)
        assert round(acts["0"].min().item(), 3) == -0.866


def test_04_clone_false_never_returns_overwritten_data() -> None:
    model, x, _ = _case04_model()
    with pytest.warns(RuntimeWarning, match=r"overwritten in place after capture: 0 \(calls \[0\]\)"):
        with torch.no_grad(), hookscope.capture(model, "0", clone=False) as acts:
            model(x)
    with pytest.raises(CaptureError, match="overwritten in place.*clone=True"):
        acts["0"]


def test_04_functional_inplace_add_is_correct() -> None:
    model = InplaceRelu().eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        y = torch.relu(model.conv(x))
        bn_ref = model.bn(model.conv2(y)).clone()
        conv_ref = model.conv(x).clone()
    for _ in range(2):
        with torch.no_grad(), hookscope.capture(model, "bn", "conv", "conv2") as acts:
            model(x)
        assert torch.equal(acts["bn"], bn_ref) and torch.equal(acts["conv"], conv_ref)


def test_09_dataparallel_names_match_unwrapped() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    net = Net()
    x = torch.randn(3, 4)
    dp = nn.DataParallel(net)
    with hookscope.capture(dp, "fc1", "module.fc2") as wrapped:
        dp(x)
    with hookscope.capture(net, "fc1", "fc2") as plain:
        net(x)
    assert wrapped.paths == plain.paths == ["fc1", "fc2"]
    assert torch.equal(wrapped["fc1"], plain["fc1"]) and torch.equal(wrapped["fc2"], plain["fc2"])
    with pytest.raises(SelectorError, match="did you mean 'fc1'"):
        hookscope.select(dp, "module.fc_1")


def test_12_direct_forward_call_is_explained() -> None:
    blk = DirectForwardCall()
    with pytest.warns(HookNeverFiredWarning, match=r"attention \(Attention\) never ran through its hooks "
                      r"although its child attention\.qkv ran.*attention\.forward\(\.\.\.\) directly"):
        with hookscope.capture(blk, "attention", "attention.out") as acts:
            blk(torch.randn(1, 3, 8))
    assert acts.counts == {"attention": 0, "attention.out": 1}


def test_16_sessions_never_accumulate_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(1, 4)
    for _ in range(5):
        with hookscope.capture(model, "2") as acts:
            model(x)
        assert len(acts.calls("2")) == 1
        assert len(model[2]._forward_hooks) == 0 and hookscope.hooks(model) == []


def test_17_exception_in_user_hook_names_module_and_cleans_up() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))

    def bad_patch(m: nn.Module, i: object, o: torch.Tensor) -> torch.Tensor:
        o[:, 10] = 0
        return o

    handle = model[0].register_forward_hook(bad_patch)
    with pytest.raises(IndexError) as err:
        with hookscope.capture(model, "0", "2"):
            model(torch.randn(3, 4))
    handle.remove()
    assert err.value.__notes__[0].startswith("hookscope: raised inside '0' (Linear)")
    assert len(model[0]._forward_hooks) == 0
    assert model(torch.randn(3, 4)).shape == (3, 2)


def test_23_unused_submodule_hook_is_removed_and_reported() -> None:
    net = UnusedBranch()
    with pytest.warns(HookNeverFiredWarning, match=r"aux_head \(Linear\) was registered but never called"):
        with hookscope.capture(net, "backbone", "aux_head", "head"):
            net(torch.randn(1, 4))
    assert len(net.aux_head._forward_hooks) == 0
    head, aux = net(torch.randn(1, 4), with_aux=True)
    assert aux.shape == (1, 3)


def test_modulelist_zoo_capture_children() -> None:
    model = ModuleListBlocks()
    x = torch.randn(2, 8, 6, 6)
    with hookscope.capture(model, "pos_block.*") as acts:
        out = model(x)
    assert len(acts) == 4 and torch.equal(model.head(acts["pos_block.3"]), out.detach())


def test_04_clone_false_under_inference_mode_warns_instead_of_pretending() -> None:
    model, x, _ = _case04_model()
    with pytest.warns(RuntimeWarning, match=r"clone=False under torch\.inference_mode\(\): the outputs "
                                            r"of 0 are kept by reference"):
        with torch.inference_mode(), hookscope.capture(model, "0", clone=False):
            model(x)
