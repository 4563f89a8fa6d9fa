"""Every name a user can see resolves: wrappers at any depth, aliases, parametrizations, Python
index syntax, the root, functional calls (issue 10 "Names"; shared/cases/27, 30)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import hookscope
from hookscope.engine.naming.names import index
from hookscope.engine.naming.selection import resolve, select
from hookscope.engine.naming.wrappers import wrapped_attribute
from hookscope.errors import SelectorError


# ------------------------------------------------------------------ case 27: one module, 3 names
class Stack(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens  # the SAME module object as model.shared
        self.proj = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed_tokens(ids))


class Seq2Seq(nn.Module):  # T5 / BART layout
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 4)
        self.encoder = Stack(self.shared)
        self.decoder = Stack(self.shared)
        self.lm_head = nn.Linear(4, 10)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(src).mean(1, keepdim=True)
        return self.lm_head(self.decoder(tgt) + memory)


@pytest.mark.parametrize("name", ["shared", "encoder.embed_tokens", "decoder.embed_tokens",
                                  "decoder.embed_tokens.weight", "encoder.embed_tokens.weight"])
def test_27_every_name_of_a_shared_module_records_both_calls_under_its_first_name(name: str) -> None:
    model = Seq2Seq()
    src, tgt = torch.randint(0, 10, (2, 5)), torch.randint(0, 10, (2, 3))
    [target] = resolve(model, [name])
    assert target.path == "shared" and target.module is model.shared
    assert target.aliases == ("encoder.embed_tokens", "decoder.embed_tokens")
    with hookscope.capture(model, name) as acts:
        model(src, tgt)
    assert acts.counts == {"shared": 2}
    encoder_call, decoder_call = acts.calls("shared")  # encoder runs first, then the decoder
    assert torch.equal(encoder_call, model.shared(src).detach())
    assert torch.equal(decoder_call, model.shared(tgt).detach())
    assert acts.records.aliases == {"encoder.embed_tokens": "shared", "decoder.embed_tokens": "shared"}
    assert torch.equal(acts["decoder.embed_tokens", 1], decoder_call)  # any name reads the record
    assert len(acts.calls("encoder.embed_tokens")) == 2


def test_27_globs_reach_a_module_through_any_of_its_names() -> None:
    model = Seq2Seq()
    assert list(select(model, "encoder.*")) == ["shared", "encoder.proj"]
    assert list(select(model, "re:decoder\\..*")) == ["shared", "decoder.proj"]
    assert list(select(model, "**")) == ["shared", "encoder", "encoder.proj", "decoder",
                                         "decoder.proj", "lm_head"]


def test_27_tree_lists_the_module_once_with_its_other_names() -> None:
    rows = {row.path: row for row in hookscope.tree(Seq2Seq())}
    assert "encoder.embed_tokens" not in rows
    assert rows["shared"].note == "also named encoder.embed_tokens, decoder.embed_tokens (one module)"
    assert rows[""].params == 10 * 4 + 2 * (4 * 4 + 4) + 4 * 10 + 10  # the embedding once


# ------------------------------------------------------------------ wrappers at any depth
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LookAlike(nn.Module):
    """A user-written wrapper: one child under '_<x>_module', forward returns its call."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._shard_wrapped_module = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self._shard_wrapped_module(*args)


class Doubler(nn.Module):
    """Not a wrapper: its output is not its child's."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) * 2


def _wrap_blocks(model: Net, wrap: type[nn.Module]) -> nn.Module:
    for i, block in enumerate(model.layers):
        model.layers[i] = wrap(block)
    return wrap(model)


PLAIN_PATHS = ["layers.0", "layers.0.fc", "layers.1", "layers.1.fc", "head"]


def _check_plain_names(wrapped: nn.Module, first_fc: nn.Linear, raw_fc: str) -> None:
    """The names of the unwrapped model, and the raw ones, select the same modules."""
    x = torch.randn(3, 4)
    assert list(select(wrapped, "**")) == PLAIN_PATHS  # 'layers' is a ModuleList: never called
    assert list(select(wrapped, "layers.*.fc")) == ["layers.0.fc", "layers.1.fc"]
    assert list(select(wrapped, "type:Linear")) == ["layers.0.fc", "layers.1.fc", "head"]
    assert list(select(wrapped, "re:layers\\.\\d\\.fc")) == ["layers.0.fc", "layers.1.fc"]
    assert list(select(wrapped, raw_fc)) == ["layers.0.fc"]  # the prefixed name keeps working
    assert list(select(wrapped, "layers.0.fc.weight", "head.bias")) == ["layers.0.fc", "head"]
    with hookscope.capture(wrapped, "layers.*.fc", raw_fc, "head") as acts:
        out = wrapped(x)
    assert acts.paths == ["layers.0.fc", "layers.1.fc", "head"]
    assert torch.equal(acts["head"], out.detach())
    assert torch.equal(acts["layers.0.fc"], first_fc(x).detach())


def test_look_alike_wrappers_at_every_depth_are_transparent() -> None:
    plain = Net()
    first_fc = plain.layers[0].fc
    wrapped = _wrap_blocks(plain, LookAlike)
    _check_plain_names(wrapped, first_fc, "_shard_wrapped_module.layers.0._shard_wrapped_module.fc")
    assert index(wrapped).wrappers == {"": "LookAlike", "_shard_wrapped_module.layers.0": "LookAlike",
                                       "_shard_wrapped_module.layers.1": "LookAlike"}


def test_a_module_that_changes_its_childs_output_is_not_a_wrapper() -> None:
    model = nn.Sequential(Doubler(nn.Linear(2, 2)))
    assert wrapped_attribute(model[0]) is None
    assert list(select(model, "**")) == ["0", "0.module"]
    x = torch.randn(1, 2)
    with hookscope.capture(model, "0", "0.module") as acts:
        model(x)
    assert torch.equal(acts["0"], acts["0.module"] * 2)


def test_checkpoint_wrapper_and_dataparallel_nested_are_transparent() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    plain = Net()
    first_fc = plain.layers[0].fc
    for i, block in enumerate(plain.layers):
        plain.layers[i] = checkpoint_wrapper(block)
    wrapped = nn.DataParallel(plain)
    _check_plain_names(wrapped, first_fc, "module.layers.0._checkpoint_wrapped_module.fc")


def test_30_real_fsdp_names_are_the_models_own(process_group: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    plain = Net()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected_fc = plain.layers[0].fc(x)
        expected = plain(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    assert "layers.0.fc" not in dict(model.named_modules())  # what case 30 reports
    raw = "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.fc"
    assert list(select(model, "**")) == PLAIN_PATHS
    assert [row.path for row in hookscope.tree(model)] == ["", "layers", *PLAIN_PATHS]
    assert list(select(model, "layers.*.fc", raw, "head.weight")) == ["layers.0.fc", "layers.1.fc", "head"]
    with torch.no_grad(), hookscope.capture(model, "layers.*.fc", "head") as acts:
        out = model(x)
    assert acts.paths == ["layers.0.fc", "layers.1.fc", "head"]
    torch.testing.assert_close(acts["layers.0.fc"], expected_fc)  # FSDP's flat views: same values
    torch.testing.assert_close(out, expected)
    assert torch.equal(acts["head"], out)


def test_35_ddp_capture_with_grads_mid_training(process_group: None) -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for step in range(3):
        opt.zero_grad()
        if step == 1:
            with hookscope.capture(ddp, "0", "module.2", grads=True) as acts:
                out = ddp(x)
                out.pow(2).sum().backward()
            hidden = net[0](x)
            expected = torch.autograd.grad(net[2](net[1](hidden)).pow(2).sum(), hidden)[0]
            assert acts.paths == ["0", "2"] and acts["0"].shape == (3, 8)
            torch.testing.assert_close(acts.grad("0"), expected)
            assert torch.equal(acts["2"], out.detach())
        else:
            ddp(x).pow(2).sum().backward()
        opt.step()
        assert bool(torch.isfinite(net[0].weight.grad).all())
    assert not net[0]._forward_hooks and not net[2]._forward_hooks


def test_torch_compile_inside_a_model_is_transparent() -> None:
    inner = Net()
    model = nn.Sequential(torch.compile(inner, backend="eager"))
    assert list(select(model, "0.layers.*.fc")) == ["0.layers.0.fc", "0.layers.1.fc"]
    assert list(select(model, "0._orig_mod.head")) == ["0.head"]


# ------------------------------------------------------------------ parametrizations
def _parametrized() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    parametrizations.orthogonal(model[0])
    parametrizations.weight_norm(model[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(model[2])
    parametrizations.spectral_norm(model[3])
    return model


@pytest.mark.parametrize(("name", "path"), [
    ("0.weight", "0"), ("0.parametrizations.weight.original", "0"),
    ("1.weight", "1"), ("1.parametrizations.weight.original0", "1"),
    ("1.parametrizations.weight.original1", "1"), ("2.weight", "2"), ("2.weight_g", "2"),
    ("2.weight_v", "2"), ("3.parametrizations.weight.original", "3"), ("3.bias", "3")])
def test_parametrized_weight_names_select_the_layer(name: str, path: str) -> None:
    assert list(select(_parametrized(), name)) == [path]


def test_parametrization_modules_are_never_captured_as_activations() -> None:
    model = _parametrized()
    assert list(select(model, "**")) == ["0", "1", "2", "3"]
    assert list(select(model, "type:Module")) == ["0", "1", "2", "3"]
    for name in ("0.parametrizations.weight", "1.parametrizations.weight.0"):
        with pytest.raises(SelectorError, match=rf"'{name}' is part of a parametrization of "
                                                r"'\d'.*not an activation.*Select the layer itself"):
            select(model, name)
    x = torch.randn(2, 3)
    with torch.no_grad():
        expected = model[1](model[0](x))
    with torch.no_grad(), hookscope.capture(model, "**") as acts:
        model(x)
    assert acts.counts == {"0": 1, "1": 1, "2": 1, "3": 1}
    torch.testing.assert_close(acts["1"], expected)


# ------------------------------------------------------------------ Python syntax, root, hints
class Twins(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos_block = nn.ModuleList(
            nn.ModuleDict({"proj": nn.Sequential(nn.Conv2d(2, 2, 3, padding=1))}) for _ in range(4))
        self.conv2 = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.pos_block:
            x = block["proj"](x)
        return F.relu(self.conv2(x))


@pytest.mark.parametrize("pattern", ["pos_block[3].proj[0]", "pos_block.3.proj[0]",
                                     "pos_block[3].proj.0", "pos_block[3]['proj'][0]",
                                     'pos_block[3]["proj"].0', " pos_block.3.proj.0 "])
def test_python_index_syntax_anywhere_is_a_path(pattern: str) -> None:
    assert list(select(Twins(), pattern)) == ["pos_block.3.proj.0"]


def test_output_parts_still_work_after_python_indexing() -> None:
    model = nn.Sequential(nn.LSTM(3, 4, batch_first=True))
    [target] = resolve(model, ["0[1][0]"])
    assert (target.path, target.parts, target.key) == ("0", (1, 0), "0[1][0]")


def test_leading_model_variable_gets_did_you_mean() -> None:
    for name, fix in [("model.conv2", "conv2"), ("self.pos_block[3].proj[0]", "pos_block.3.proj.0")]:
        with pytest.raises(SelectorError, match=rf"did you mean '{fix}'\? Paths start below the model; "
                                                rf"'{name.split('.')[0]}\.' is the variable"):
            select(Twins(), name)


def test_functional_call_names_the_forward_and_the_function_address() -> None:
    with pytest.raises(SelectorError, match=r"'relu' is not a module: Twins\.forward \(the model\) "
                                            r"calls relu as a function.*function address '::relu'"):
        select(Twins(), "relu")


def test_bare_module_root_is_selected_explicitly_and_double_star_says_why() -> None:
    layer = nn.Linear(10, 5)
    with pytest.raises(SelectorError, match=r"single Linear with no submodules.*'\(root\)' \(or ''\)"):
        select(layer, "**")
    x = torch.randn(2, 10)
    for pattern in ("(root)", ""):
        with hookscope.capture(layer, pattern) as acts:
            out = layer(x)
        assert acts.paths == ["(root)"] and torch.equal(acts["(root)"], out.detach())
