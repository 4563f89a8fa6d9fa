"""Case 40: a peft LoRA model is the base model under two wrappers (``base_model.model.``).

Its module names are the base model's (``layers.0.q_proj`` is the ``lora.Linear``, whose output
holds the LoRA delta); ``base_layer`` stays selectable; ``compare(base, adapted, x)`` pairs every
layer of the base with its counterpart. Values are checked against plain hooks on the peft
modules, for capture, edit, stats, extract and compare, on generated small models.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

import hookscope
from hookscope.errors import HookscopeError, SelectorError
from tests.reference import plain_capture

peft = pytest.importorskip("peft")


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.q_proj(x))


class Net(nn.Module):
    """Case 40's model; ``nested`` puts the blocks one ``Sequential`` deeper."""

    def __init__(self, d: int = 8, depth: int = 2, nested: bool = False) -> None:
        super().__init__()
        blocks = [Block(d) for _ in range(depth)]
        self.layers = nn.ModuleList(nn.Sequential(b) if nested else b for b in blocks)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _adapted(base: nn.Module, targets: list[str], r: int = 2) -> nn.Module:
    config = peft.LoraConfig(r=r, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(copy.deepcopy(base), config).eval()


def _case() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    base, x = Net().eval(), torch.randn(2, 8)
    return base, _adapted(base, ["q_proj"]), x


def _modules_of(model: nn.Module) -> list[str]:
    """Paths of the modules ``"**"`` selects: every one but the root and containers."""
    return [path for path, m in model.named_modules()
            if path and not isinstance(m, (nn.ModuleList, nn.ModuleDict))]


# ---------------------------------------------------------------------------------- case 40
def test_case_40_base_names_select_the_lora_layer_with_its_delta() -> None:
    base, adapted, x = _case()
    lora_layer = dict(adapted.named_modules())["base_model.model.layers.0.q_proj"]
    assert type(lora_layer).__name__ == "Linear" and hasattr(lora_layer, "lora_A")
    assert hookscope.select(adapted, "layers.0.q_proj") == {"layers.0.q_proj": lora_layer}
    raw = ["base_model.model.layers.0.q_proj", "base_model.model.layers.0.q_proj.base_layer"]
    plain = plain_capture(adapted, raw, x, grad_enabled=False)
    with torch.no_grad(), hookscope.capture(adapted, "layers.0.q_proj",
                                            "layers.0.q_proj.base_layer") as acts:
        adapted(x)
    assert sorted(acts.records.paths) == ["layers.0.q_proj", "layers.0.q_proj.base_layer"]
    assert torch.equal(acts["layers.0.q_proj"], plain[raw[0]][0])
    assert torch.equal(acts["layers.0.q_proj.base_layer"], plain[raw[1]][0])
    reference = base.layers[0].q_proj(x).detach()
    assert torch.allclose(acts["layers.0.q_proj.base_layer"], reference)  # no delta in it
    assert (acts["layers.0.q_proj"] - reference).abs().max() > 1e-3  # the delta is in it


def test_case_40_raw_peft_names_still_resolve_and_near_misses_name_the_path() -> None:
    _, adapted, _ = _case()
    lora_layer = dict(adapted.named_modules())["base_model.model.layers.0.q_proj"]
    assert hookscope.select(adapted, "base_model.model.layers.0.q_proj") == {
        "layers.0.q_proj": lora_layer}
    with pytest.raises(SelectorError, match=r"'layers\.0\.q_proj'"):
        hookscope.select(adapted, "layers.0.q_prj")
    base, _, _ = _case()  # code written for the adapted model, run on the base: the exact name
    with pytest.raises(SelectorError, match=r"did you mean 'layers\.0\.q_proj'"):
        hookscope.select(base, "base_model.model.layers.0.q_proj")


def test_case_40_compare_reports_the_adapted_layer_first() -> None:
    base, adapted, x = _case()
    result = hookscope.compare(base, adapted, x)
    assert result.first_divergent is not None
    assert result.first_divergent.path == "layers.0.q_proj"
    assert {d.path for d in result.diffs} == {"", *_modules_of(base)}
    expected = base.layers[0].q_proj(x) - plain_capture(
        adapted, ["base_model.model.layers.0.q_proj"], x,
        grad_enabled=False)["base_model.model.layers.0.q_proj"][0]
    assert result["layers.0.q_proj"].max_abs == pytest.approx(float(expected.abs().max()),
                                                              rel=1e-5)
    assert result["layers.0.q_proj"].call_index == 0 and not result["layers.0.q_proj"].close


def test_compare_of_models_that_pair_almost_nothing_is_an_error_naming_both_sides() -> None:
    base, _, x = _case()
    other = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    paired = r"only 0 of 11 .*only A: \['layers\.0'.*only B: \['0', '1', '2'\]"
    with pytest.raises(HookscopeError, match=paired):
        hookscope.compare(base, other, x)


def test_merged_adapters_keep_the_names_and_the_values() -> None:
    base, adapted, x = _case()
    with torch.no_grad():
        unmerged = adapted(x)
    adapted.merge_adapter()
    with torch.no_grad(), hookscope.capture(adapted, "layers.0.q_proj", "head") as acts:
        merged = adapted(x)
    assert torch.allclose(merged, unmerged, atol=1e-5)
    assert torch.allclose(acts["head"], merged)
    plain = adapted.merge_and_unload()
    assert isinstance(plain, Net)
    assert hookscope.compare(adapted, plain, x).first_divergent is None


# ------------------------------------------------------------------------ generated variants
_TARGETS = st.sampled_from([["q_proj"], ["mlp.0"], ["q_proj", "mlp.0"], ["q_proj", "head"]])


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(targets=_TARGETS, r=st.integers(1, 4), depth=st.integers(1, 3), nested=st.booleans(),
       merge=st.sampled_from(["no", "merge_adapter"]), seed=st.integers(0, 2**16))
def test_every_verb_sees_the_lora_layers_under_base_names(
        tmp_path: Path, targets: list[str], r: int, depth: int, nested: bool, merge: str,
        seed: int) -> None:
    torch.manual_seed(seed)
    base, x = Net(depth=depth, nested=nested).eval(), torch.randn(4, 8)
    adapted = _adapted(base, targets, r)
    if merge == "merge_adapter":
        adapted.merge_adapter()
    raw = dict(adapted.named_modules())
    adapted_paths = [p.removeprefix("base_model.model.") for p, m in raw.items()
                     if hasattr(m, "lora_A")]
    assert adapted_paths and all(p in dict(base.named_modules()) for p in adapted_paths)
    key = adapted_paths[0]
    plain = plain_capture(adapted, ["base_model.model." + key], x, grad_enabled=False)
    reference = plain["base_model.model." + key][0]

    with torch.no_grad(), hookscope.capture(adapted, key) as acts:  # capture
        adapted(x)
    assert torch.equal(acts[key], reference)

    with torch.no_grad():  # edit: as a plain forward hook returning zeros on the lora.Linear
        handle = raw["base_model.model." + key].register_forward_hook(
            lambda m, i, o: torch.zeros_like(o))
        expected = adapted(x)
        handle.remove()
        with hookscope.edit(adapted, {key: torch.zeros_like}):
            edited = adapted(x)
    assert torch.equal(edited, expected)

    running = hookscope.stats(adapted, [x], key)[key]  # stats
    assert float(running.mean) == pytest.approx(float(reference.double().mean()), abs=1e-6)

    store = hookscope.extract(adapted, TensorDataset(x), [key], tmp_path / f"s{seed}-{r}",
                              batch_size=4, progress=False, overwrite=True)  # extract
    assert torch.allclose(store[key][:4], reference, atol=1e-6)

    result = hookscope.compare(base, adapted, x)  # compare: every base layer paired
    assert {d.path for d in result.diffs} == {"", *_modules_of(base)}
    assert result.first_divergent is not None
    first_adapted = next(d.path for d in result.diffs if d.path in adapted_paths)
    assert result.first_divergent.path == first_adapted


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])  # PeftModel, PeftModelForCausalLM
def test_gpt2_from_config_with_lora_on_c_attn(task_type: str | None) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)
    base = transformers.GPT2LMHeadModel(config).eval()
    adapted = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True,
        task_type=task_type)).eval()
    ids = torch.randint(0, 50, (2, 6))
    raw = "base_model.model.transformer.h.1.attn.c_attn"
    reference = plain_capture(adapted, [raw], ids, grad_enabled=False)[raw][0]
    with torch.no_grad(), hookscope.capture(adapted, "transformer.h.1.attn.c_attn") as acts:
        adapted(ids)
    assert acts["transformer.h.1.attn.c_attn"].shape == (2, 6, 96)
    assert torch.equal(acts["transformer.h.1.attn.c_attn"], reference)
    result = hookscope.compare(base, adapted, ids)
    assert {d.path for d in result.diffs} >= {p for p in _modules_of(base) if ".h." in p} - {
        p for p, m in base.named_modules() if isinstance(m, nn.Dropout)}
    assert result.first_divergent is not None
    assert result.first_divergent.path == "transformer.h.0.attn.c_attn"
