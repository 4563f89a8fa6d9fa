"""Direct logit attribution (issue 50 item 1) against a hand computation with plain torch hooks
on every family with standard names (GPT-2, GPT-NeoX, Llama, Mistral, Qwen2, Gemma, Phi, a
TransformerLens HookedTransformer stand-in; transformer_lens itself is not installed here, so
its decompose_resid / stack_head_results are computed by hand as TL defines them): each head is
its z slice through its part of the output projection, each MLP its output, the embeddings
their table rows, the bias the output projections' biases plus the final norm's and the
unembedding's, all read out through the final norm with the run's scale (LayerNorm or RMSNorm,
Gemma's 1 + weight) and W_U[a] - W_U[b]; the components sum to the model's own logit difference.
Refusals: a softcap by name, a norm after each branch, bad arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import ArgumentTypeError, ArgumentValueError, EditError, SelectorError
from tests.hooked_transformer import build as build_tl

transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             vocab_size=60, max_position_embeddings=32)
Tensor = torch.Tensor


@dataclass(frozen=True)
class Family:
    """How to read a family by hand: the blocks, each block's output projection (its input is
    the heads' z, merged) and MLP, the final norm and its form, the embeddings."""

    build: Callable[[], nn.Module]
    blocks: str
    projection: str          # inside a block
    mlp: str                 # inside a block
    final_norm: str
    centred: bool            # LayerNorm (True) or RMSNorm
    gain_offset: float       # Gemma: x * (1 + weight)
    positions: str | None    # the learned position table
    embed_scale: Callable[[nn.Module], float] = lambda model: 1.0


FAMILIES = {
    "gpt2": Family(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=60, n_positions=32, bos_token_id=0,
        eos_token_id=0)), "transformer.h", "attn.c_proj", "mlp", "transformer.ln_f", True, 0.0,
        "transformer.wpe"),
    "gpt_neox": Family(lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**SMALL)),
                       "gpt_neox.layers", "attention.dense", "mlp", "gpt_neox.final_layer_norm",
                       True, 0.0, None),
    "llama": Family(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2)), "model.layers", "self_attn.o_proj", "mlp", "model.norm",
        False, 0.0, None),
    "mistral": Family(lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **SMALL, num_key_value_heads=2)), "model.layers", "self_attn.o_proj", "mlp", "model.norm",
        False, 0.0, None),
    "qwen2": Family(lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2)), "model.layers", "self_attn.o_proj", "mlp", "model.norm",
        False, 0.0, None),
    "gemma": Family(lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(
        **SMALL, num_key_value_heads=2, head_dim=8)), "model.layers", "self_attn.o_proj", "mlp",
        "model.norm", False, 1.0, None, lambda model: 32 ** 0.5),
    "phi": Family(lambda: transformers.PhiForCausalLM(transformers.PhiConfig(**SMALL)),
                  "model.layers", "self_attn.dense", "mlp", "model.final_layernorm", True, 0.0, None),
    "hooked_transformer": Family(build_tl, "blocks", "attn.hook_z", "mlp", "ln_final", True, 0.0,
                                 "pos_embed.W_pos"),
}


def _randomise(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn afresh (norm gains and biases too, unembedding bias included):
    the decomposition must not lean on an initialisation's zeros and ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if p.dim() == 1 else 1.0 / max(p.shape[-1], p.shape[0]) ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name and
                                                                 name.endswith("weight") else 0.0))
    return model


def _plain_run(model: nn.Module, family: Family, ids: Tensor) -> dict[str, object]:
    """Plain torch hooks: each projection's input (z merged, or TL's hook_z output), each MLP's
    output, the final norm's input; and the logits."""
    seen: dict[str, object] = {}
    blocks = model.get_submodule(family.blocks)
    handles = []
    for layer, block in enumerate(blocks):
        projection = block.get_submodule(family.projection)
        if family.projection.endswith("hook_z"):
            handles.append(projection.register_forward_hook(
                lambda m, a, out, layer=layer: seen.__setitem__(f"z{layer}", out.detach())))
        else:
            handles.append(projection.register_forward_pre_hook(
                lambda m, a, layer=layer: seen.__setitem__(f"z{layer}", a[0].detach())))
        handles.append(block.get_submodule(family.mlp).register_forward_hook(
            lambda m, a, out, layer=layer: seen.__setitem__(f"m{layer}", out.detach())))
    handles.append(model.get_submodule(family.final_norm).register_forward_pre_hook(
        lambda m, a: seen.__setitem__("final", a[0].detach())))
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for handle in handles:
            handle.remove()
    seen["logits"] = out if isinstance(out, Tensor) else out.logits
    return seen


def _unembedding(model: nn.Module) -> tuple[Tensor, Tensor]:
    """``(W_U (vocab, d_model), b_U (vocab,))`` from the parameters."""
    if hasattr(model, "unembed"):  # HookedTransformer: W_U (d_model, vocab)
        return model.unembed.W_U.detach().T, model.unembed.b_U.detach()
    head = model.lm_head
    return head.weight.detach(), (head.bias.detach() if head.bias is not None
                                  else torch.zeros(head.weight.shape[0]))


def _head_result(projection: nn.Module, z: Tensor, head: int, head_dim: int) -> Tensor:
    """What head ``head`` writes: its z slice through its rows (columns) of the projection."""
    if z.dim() == 4:  # HookedTransformer: (batch, seq, heads, head_dim) and W_O (heads, head_dim, d)
        return z[:, :, head] @ projection.W_O[head].detach()
    rows = slice(head * head_dim, (head + 1) * head_dim)
    weight = projection.weight.detach()
    if isinstance(projection, nn.Linear):
        return z[..., rows] @ weight[:, rows].T
    return z[..., rows] @ weight[rows]  # GPT-2's Conv1D: x @ W


def _projection_bias(projection: nn.Module) -> Tensor:
    bias = getattr(projection, "bias", getattr(projection, "b_O", None))  # b_O: HookedTransformer
    return bias.detach() if isinstance(bias, Tensor) else torch.zeros(())


def hand_attribution(model: nn.Module, family: Family, ids: Tensor,
                     a: int, b: int) -> tuple[dict[str, Tensor], Tensor]:
    """``({component: (batch, seq)}, the model's logit difference)`` computed by hand:
    ``apply_ln_to_stack`` (centre if LayerNorm, divide by the final norm's scale of the run,
    times its gain) and ``W_U[a] - W_U[b]``."""
    seen = _plain_run(model, family, ids)
    norm = model.get_submodule(family.final_norm)
    final = seen["final"].double()  # type: ignore[union-attr]
    moved = final - final.mean(-1, keepdim=True) if family.centred else final
    eps = next(getattr(norm, n) for n in ("eps", "variance_epsilon") if hasattr(norm, n))
    scale = (moved.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    gain = getattr(norm, "weight", getattr(norm, "w", None)).detach().double() + family.gain_offset
    norm_bias = getattr(norm, "bias", getattr(norm, "b", None))
    W_U, b_U = _unembedding(model)
    direction = (W_U[a] - W_U[b]).double()

    def read(x: Tensor) -> Tensor:
        x = x.double()
        x = x - x.mean(-1, keepdim=True) if family.centred else x
        return ((x / scale) * gain * direction).sum(-1)

    embedding = model.embed if hasattr(model, "embed") else model.get_input_embeddings()
    table = embedding.W_E if hasattr(embedding, "W_E") else embedding.weight
    found = {"embed": read(table.detach()[ids] * family.embed_scale(model))}
    if family.positions is not None:
        found["pos_embed"] = read(model.get_parameter(family.positions).detach()[: ids.shape[1]]
                                  if family.positions.endswith("W_pos") else
                                  model.get_submodule(family.positions).weight.detach()[: ids.shape[1]])
    blocks = model.get_submodule(family.blocks)
    bias = (norm_bias.detach().double() * direction).sum() if norm_bias is not None else torch.zeros(())
    bias = bias + float(b_U[a] - b_U[b])
    heads = model.cfg.n_heads if hasattr(model, "cfg") else model.config.num_attention_heads
    for layer, block in enumerate(blocks):
        projection = block.get_submodule(family.projection if not family.projection.endswith("hook_z")
                                         else "attn")
        z = seen[f"z{layer}"]
        head_dim = z.shape[-1] // heads if z.dim() == 3 else z.shape[-1]  # type: ignore[union-attr]
        for h in range(heads):
            found[f"a{layer}.h{h}"] = read(_head_result(projection, z, h, head_dim))  # type: ignore[arg-type]
        found[f"m{layer}"] = read(seen[f"m{layer}"])  # type: ignore[arg-type]
        bias = bias + read(_projection_bias(projection).expand_as(final))
    found["bias"] = bias.expand(ids.shape).clone()
    logits = seen["logits"]
    return found, (logits[..., a] - logits[..., b]).double()  # type: ignore[index]


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _randomise(FAMILIES[name].build().eval(), seed)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_component_equals_the_hand_computation(name: str) -> None:
    model = _build(name)
    ids = torch.randint(0, 60, (3, 6), generator=torch.Generator().manual_seed(1))
    hand, difference = hand_attribution(model, FAMILIES[name], ids, 5, 11)
    dla = hookscope.direct_logit_attribution(model, ids, tokens=(5, 11))
    assert dla.components == list(hand), (dla.components, list(hand))
    assert dla.values.shape == (len(hand), 3, 6) and dla.values.dtype == torch.float64
    for component, expected in hand.items():
        assert torch.allclose(dla[component], expected, atol=2e-5, rtol=1e-4), component
    assert torch.allclose(dla.target, difference, atol=1e-6, rtol=0)
    assert torch.allclose(dla.values.sum(0), difference, atol=2e-5, rtol=0)
    assert dla.values[:-1].abs().sum(0).min() > 0  # the premise: components that are not nothing


@settings(max_examples=12, deadline=None)
@given(family=st.sampled_from(["gpt2", "llama"]), layers=st.integers(1, 3),
       heads=st.sampled_from([1, 2, 4]), batch=st.integers(1, 3), seq=st.integers(1, 7),
       seed=st.integers(0, 1000), a=st.integers(0, 59), b=st.integers(0, 59))
def test_sizes_and_tokens_drawn_by_hypothesis(family: str, layers: int, heads: int, batch: int,
                                              seq: int, seed: int, a: int, b: int) -> None:
    torch.manual_seed(seed)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=32, n_head=heads, vocab_size=60, n_positions=32,
            bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**SMALL, "num_hidden_layers": layers, "num_attention_heads": heads},
            num_key_value_heads=1))
    model = _randomise(model.eval(), seed)
    ids = torch.randint(0, 60, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    hand, difference = hand_attribution(model, FAMILIES[family], ids, a, b)
    dla = hookscope.direct_logit_attribution(model, ids, tokens=(a, b))
    assert dla.components == list(hand)
    assert torch.allclose(dla.values, torch.stack(list(hand.values())), atol=2e-5, rtol=1e-4)
    assert torch.allclose(dla.values.sum(0), difference, atol=2e-5, rtol=0)


def test_a_pair_per_row_and_a_direction() -> None:
    """tokens=(tensor, tensor): each row its own pair, equal to that row decomposed alone;
    direction=W_U[a] - W_U[b]: the same components, the unembedding's bias left out."""
    model = _build("gpt_neox")
    ids = torch.randint(0, 60, (2, 5), generator=torch.Generator().manual_seed(2))
    both = hookscope.direct_logit_attribution(model, ids, tokens=(torch.tensor([3, 8]), torch.tensor([9, 1])))
    for row, (a, b) in enumerate([(3, 9), (8, 1)]):
        alone = hookscope.direct_logit_attribution(model, ids[row:row + 1], tokens=(a, b))
        assert torch.allclose(both.values[:, row], alone.values[:, 0], atol=1e-6)
    W_U, b_U = _unembedding(model)
    read = hookscope.direct_logit_attribution(model, ids, direction=W_U[3] - W_U[9])
    plain = hookscope.direct_logit_attribution(model, ids, tokens=(3, 9))
    assert torch.allclose(read.values[:-1], plain.values[:-1], atol=1e-6)
    assert torch.allclose(read.values[-1], plain.values[-1] - float(b_U[3] - b_U[9]), atol=1e-6)
    assert torch.allclose(read.values.sum(0), read.target, atol=1e-5)


def test_softcap_and_branch_norms_are_refused() -> None:
    torch.manual_seed(0)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SMALL, num_key_value_heads=2, head_dim=8)).eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(SelectorError, match=r"final_logit_softcapping=30.0.*direction=model\.lm_head"):
        hookscope.direct_logit_attribution(gemma2, ids, tokens=(1, 2))
    olmo2 = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SMALL, num_key_value_heads=2)).eval()
    with pytest.raises(EditError, match=r"resid_post\.1 .*a norm after each branch"):
        hookscope.direct_logit_attribution(olmo2, ids, tokens=(1, 2))


def test_bad_arguments_are_refused() -> None:
    model = _build("gpt2")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ArgumentTypeError, match=r"pass tokens=\(a, b\)"):
        hookscope.direct_logit_attribution(model, ids)
    with pytest.raises(ArgumentTypeError, match="not both"):
        hookscope.direct_logit_attribution(model, ids, tokens=(1, 2), direction=torch.ones(32))
    with pytest.raises(ArgumentValueError, match="outside the vocabulary 0 … 59"):
        hookscope.direct_logit_attribution(model, ids, tokens=(1, 60))
    with pytest.raises(ArgumentTypeError, match="token id"):
        hookscope.direct_logit_attribution(model, ids, tokens=(1, 2.0))
    with pytest.raises(ArgumentValueError, match=r"give a float vector \(32,\)"):
        hookscope.direct_logit_attribution(model, ids, direction=torch.ones(31))


def test_table_lists_the_largest_components() -> None:
    model = _build("gpt2")
    dla = hookscope.direct_logit_attribution(model, torch.tensor([[4, 5, 6, 7]]), tokens=(2, 3))
    lines = dla.table(3).splitlines()
    assert len(lines) == 4 and lines[0].split()[0] == "target"
    top = dla.values[:, 0, -1].abs().argmax()
    assert lines[1].split()[0] == dla.components[int(top)]
    with pytest.raises(KeyError, match="is not a component"):
        dla["a9.h9"]
