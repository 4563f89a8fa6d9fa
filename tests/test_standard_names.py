"""Standard names (resid_pre/resid_post/attn_out/mlp_out.{i}, embed, final_norm, unembed) on
seven Hugging Face families built from small configs: equal to output_hidden_states, to the
modules they name, and one steering script runs unchanged on all."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.engine.naming.names import index
from hookscope.engine.naming.standard_naming import standard_names
from hookscope.errors import SelectorError

transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
             vocab_size=60)
LAYERS = 3


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=60, n_positions=32, bos_token_id=0,
        eos_token_id=0))


FAMILIES: dict[str, tuple[Callable[[], nn.Module], bool]] = {  # builder, final norm on the last hidden state
    "gpt2": (_gpt2, True),
    "gpt_neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **SMALL, max_position_embeddings=32)), True),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, max_position_embeddings=32)), True),
    "gemma": (lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(
        **SMALL, num_key_value_heads=2, head_dim=8, max_position_embeddings=32)), True),
    "phi": (lambda: transformers.PhiForCausalLM(transformers.PhiConfig(
        **SMALL, max_position_embeddings=32)), True),
    "bert": (lambda: transformers.BertModel(transformers.BertConfig(
        **SMALL, max_position_embeddings=32)), False),
    "vit": (lambda: transformers.ViTModel(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=8)), False),
}


def build(family: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = FAMILIES[family][0]().eval()
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        return model, {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    return model, {"input_ids": torch.randint(0, 60, (2, 5), generator=g)}


def _plain(model: nn.Module, path: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output of module ``path`` by a plain forward hook (first tensor of a tuple)."""
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(path).register_forward_hook(
        lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).detach()))
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_residual_stream_equals_output_hidden_states(family: str) -> None:
    model, inputs = build(family)
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True).hidden_states
    assert len(hidden) == LAYERS + 1
    names = [f"resid_post.{i}" for i in range(LAYERS)] + [f"resid_pre.{i}" for i in range(LAYERS)]
    with torch.no_grad(), hookscope.capture(model, *names, "final_norm" if FAMILIES[family][1]
                                             else "resid_pre.0") as acts:
        model(**inputs)
    for i in range(LAYERS):
        assert torch.equal(acts[f"resid_pre.{i}"], hidden[i]), (family, i)
    for i in range(LAYERS - 1):
        assert torch.equal(acts[f"resid_post.{i}"], hidden[i + 1]), (family, i)
    last = acts[f"resid_post.{LAYERS - 1}"]
    if FAMILIES[family][1]:  # the final norm is applied to the last hidden state
        assert not torch.equal(last, hidden[LAYERS])
        assert torch.equal(acts["final_norm"], hidden[LAYERS])
        final = model.get_submodule(hookscope.select(model, "final_norm").popitem()[0])
        with torch.no_grad():
            assert torch.equal(final(last), hidden[LAYERS])
    else:
        assert torch.equal(last, hidden[LAYERS])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_attn_out_and_mlp_out_rebuild_the_residual_stream(family: str) -> None:
    """resid_post = resid_pre + attn_out + mlp_out in pre-norm blocks (eval: no dropout);
    post-norm BERT: resid_post = LN2(LN1(resid_pre + attn_out) + mlp_out)."""
    model, inputs = build(family)
    names = [f"{k}.{i}" for i in range(LAYERS) for k in ("resid_pre", "attn_out", "mlp_out",
                                                         "resid_post")]
    with torch.no_grad(), hookscope.capture(model, *names) as acts:
        model(**inputs)
    for i in range(LAYERS):
        pre, attn, mlp, post = (acts[f"{k}.{i}"] for k in ("resid_pre", "attn_out", "mlp_out",
                                                           "resid_post"))
        assert attn.shape == mlp.shape == post.shape
        if family == "bert":
            layer = model.encoder.layer[i]
            middle = layer.attention.output.LayerNorm(attn + pre)
            expected = layer.output.LayerNorm(mlp + middle)
        else:
            expected = pre + attn + mlp
        torch.testing.assert_close(post, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_names_resolve_to_the_modules_of_each_family(family: str) -> None:
    model, inputs = build(family)
    expected = {
        "gpt2": ("transformer.wte", "transformer.h.1.attn", "transformer.h.1.mlp", "transformer.ln_f",
                 "lm_head"),
        "gpt_neox": ("gpt_neox.embed_in", "gpt_neox.layers.1.attention", "gpt_neox.layers.1.mlp",
                     "gpt_neox.final_layer_norm", "lm_head"),
        "llama": ("model.embed_tokens", "model.layers.1.self_attn", "model.layers.1.mlp", "model.norm",
                  "lm_head"),
        "gemma": ("model.embed_tokens", "model.layers.1.self_attn", "model.layers.1.mlp", "model.norm",
                  "lm_head"),
        "phi": ("model.embed_tokens", "model.layers.1.self_attn", "model.layers.1.mlp",
                "model.final_layernorm", "lm_head"),
        "bert": ("embeddings.word_embeddings", "encoder.layer.1.attention.output.dense",
                 "encoder.layer.1.output.dense", None, None),
        "vit": ("embeddings.patch_embeddings", "layers.1.attention", "layers.1.mlp", "layernorm", None),
    }[family]
    for name, path in zip(("embed", "attn_out.1", "mlp_out.1", "final_norm", "unembed"), expected,
                          strict=True):
        if path is None:
            with pytest.raises(SelectorError, match=f"'{name}': .* none of the modules looked for"):
                hookscope.select(model, name)
        else:
            assert list(hookscope.select(model, name)) == [path]
            with torch.no_grad(), hookscope.capture(model, name) as acts:
                model(**inputs)
            assert torch.equal(acts[name], _plain(model, path, inputs)), (family, name)
    blocks = list(hookscope.select(model, "resid_post.*"))
    assert len(blocks) == LAYERS and blocks[-1].endswith(f".{LAYERS - 1}")


def steering_script(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One script for every family: add a vector to resid_post.1; return resid_post.2 without
    and with the steering."""
    with torch.no_grad(), hookscope.capture(model, "resid_post.1", "resid_post.2") as clean:
        model(**inputs)
    vector = torch.ones(clean["resid_post.1"].shape[-1])
    with torch.no_grad(), hookscope.steer(model, {"resid_post.1": vector}), \
            hookscope.capture(model, "resid_post.1", "resid_post.2") as steered:
        model(**inputs)
    assert torch.equal(steered["resid_post.1"], clean["resid_post.1"] + vector)
    return clean["resid_post.2"], steered["resid_post.2"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_steering_script_runs_unchanged_on_every_family(family: str) -> None:
    model, inputs = build(family)
    clean, steered = steering_script(model, inputs)
    # the independent computation: block 2 run by hand on the steered block-1 output
    hidden = _plain(model, hookscope.select(model, "resid_post.1").popitem()[0], inputs)
    assert not torch.equal(clean, steered)
    block2 = hookscope.select(model, "resid_post.2").popitem()[1]
    seen: list[tuple[tuple[object, ...], dict[str, object]]] = []
    handle = block2.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
    no_cache = {} if family in ("bert", "vit") else {"use_cache": False}  # block 2 runs twice
    with torch.no_grad():
        model(**inputs, **no_cache)
    handle.remove()
    args, kwargs = seen[0]
    moved = hidden + 1
    with torch.no_grad():
        if args:
            out = block2(moved, *args[1:], **kwargs)
        else:
            out = block2(**{**kwargs, "hidden_states": moved})
    torch.testing.assert_close(steered, out[0] if isinstance(out, tuple) else out)  # float32 default


def test_unknown_family_is_refused_naming_what_was_looked_for() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(SelectorError, match="looked for a ModuleList named h, layers, layer, blocks"):
        hookscope.select(model, "resid_post.0")
    with pytest.raises(SelectorError, match="has 3 blocks"):
        hookscope.select(build("llama")[0], "mlp_out.3")


def test_a_real_module_named_like_a_standard_name_keeps_its_path() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[0](self.embed(x))

    assert list(hookscope.select(Net(), "embed")) == ["embed"]
    assert list(hookscope.select(Net(), "resid_post.0")) == ["layers.0"]


def test_tree_shows_the_standard_names() -> None:
    model, _ = build("gpt2")
    found = standard_names(index(model))
    assert found["transformer.h.0"] == ["resid_post.0"]
    assert found["transformer.h.0.attn"] == ["attn_out.0[0]", "attn.z.0::scaled_dot_product_attention"]
    assert found["transformer.drop"] == ["resid_pre.0"]
    assert found["lm_head"] == ["unembed"]
    rows = {row.path: row for row in hookscope.tree(model)}
    assert "standard name: attn_out.0[0]" in rows["transformer.h.0.attn"].note


def test_a_saved_file_and_a_store_answer_the_standard_names_they_were_made_with(
        tmp_path: Path) -> None:
    # finding 03: acts["resid_post.1"] worked on the capture only, not on load(file) or a store
    model, inputs = build("gpt2")
    with torch.no_grad(), hookscope.capture(model, "resid_post.1", "attn_out.0") as acts:
        model(**inputs)
    acts.save(tmp_path / "a.safetensors")
    loaded = hookscope.load(tmp_path / "a.safetensors")
    expected = _plain(model, "transformer.h.1", inputs)
    assert torch.equal(loaded["resid_post.1"], expected)
    assert torch.equal(loaded["attn_out.0"], acts["attn_out.0"])
    assert torch.equal(loaded["transformer.h.1"], expected)  # the path still reads
    store = hookscope.extract(model, [inputs["input_ids"]], "resid_post.1", tmp_path / "st",
                              progress=False)
    assert torch.equal(store["resid_post.1"][0:2], store["transformer.h.1"][0:2])
    assert torch.equal(store["resid_post.1"][0:2], expected)
    reopened = hookscope.open_store(tmp_path / "st")
    assert reopened.standard_names == {"resid_post.1": "transformer.h.1"}


def test_a_standard_name_not_recorded_says_what_it_is(tmp_path: Path) -> None:
    model, inputs = build("gpt2")
    with torch.no_grad(), hookscope.capture(model, "transformer.h.1") as acts:
        model(**inputs)
    acts.save(tmp_path / "a.safetensors")
    store = hookscope.extract(model, [inputs["input_ids"]], "transformer.h.1", tmp_path / "st",
                              progress=False)
    for holder in (hookscope.load(tmp_path / "a.safetensors"), store):
        with pytest.raises(hookscope.HookscopeError, match=r"'resid_post.1' is a standard name.*"
                                                          r"read the module path it resolves to"):
            holder["resid_post.1"]


@pytest.mark.parametrize(("name", "fix"), [
    ("resid_pst.1", r"did you mean 'resid_post\.1'"),
    ("atn_out.0", r"did you mean 'attn_out\.0'"),
    ("blocks.1.hook_resid_post", r"TransformerLens hook name; on this model the same quantity is "
                                 r"the standard name 'resid_post\.1' \(the output of "
                                 r"'transformer\.h\.1'\): did you mean 'resid_post\.1'\?"),
    ("blocks.0.hook_attn_out", r"standard name 'attn_out\.0' \(the output of "
                               r"'transformer\.h\.0\.attn\[0\]'\)"),
    ("hook_embed", r"standard name 'embed' \(the output of 'transformer\.wte'\)"),
    ("ln_final.hook_normalized", r"standard name 'final_norm' \(the output of 'transformer\.ln_f'\)"),
])
def test_a_misspelt_standard_or_transformer_lens_name_suggests_the_standard_name(
        name: str, fix: str) -> None:
    # finding 09: only the top-level modules were suggested
    model, _ = build("gpt2")
    with pytest.raises(SelectorError, match=fix):
        hookscope.select(model, name)


def test_transformer_lens_names_on_a_model_without_blocks_get_the_usual_message() -> None:
    with pytest.raises(SelectorError, match=r"top-level modules are '0', '1'"):
        hookscope.select(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "blocks.1.hook_resid_post")


@pytest.mark.parametrize("name", ["resid_post.1", "attn_out.0", "attn.q.1", "mlp_out.1"])
def test_a_standard_name_with_a_call_reads_as_its_record(name: str) -> None:
    """A review found ``acts["resid_post.1:0"]`` (and ``layout`` of it) raising a bare
    AssertionError: the call-numbered form of a standard name skipped the alias table."""
    from tests.models import tiny_gpt2

    model = tiny_gpt2()
    ids = torch.tensor([[3, 5, 7, 9]])
    with hookscope.capture(model, name) as acts:
        model(ids)
    assert torch.equal(acts[f"{name}:0"], acts[name])
    assert acts.layout(f"{name}:0") == acts.layout(name)
