"""Per-head standard names attn.q/k/v/z.{i} on the seven Hugging Face families of
test_standard_names: each against the projection computed by hand from the model's weights (GPT-2's
fused c_attn cut in three, GPT-NeoX's q, k, v inside each head), z against what the output
projection receives and, on GPT-2, against softmax(q k^T / sqrt(d)) v by hand; heads= and
positions= edit the right columns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope
from hookscope.engine.naming.names import index
from hookscope.engine.naming.standard_naming import standard_names
from hookscope.errors import SelectorError
from tests.test_standard_names import FAMILIES, build, transformers

LETTERS = ("q", "k", "v")
LLAMA_LIKE = (tuple(f"model.layers.1.self_attn.{x}_proj" for x in LETTERS), "model.layers.1.self_attn.o_proj")
# family -> (projection paths of block 1 for q, k, v (one path: fused), output projection)
PROJECTIONS = {
    "gpt2": (("transformer.h.1.attn.c_attn",), "transformer.h.1.attn.c_proj"),
    "gpt_neox": (("gpt_neox.layers.1.attention.query_key_value",), "gpt_neox.layers.1.attention.dense"),
    "llama": LLAMA_LIKE,
    "gemma": LLAMA_LIKE,
    "phi": (LLAMA_LIKE[0], "model.layers.1.self_attn.dense"),
    "bert": (tuple(f"encoder.layer.1.attention.self.{x}" for x in ("query", "key", "value")),
             "encoder.layer.1.attention.output.dense"),
    "vit": (tuple(f"layers.1.attention.{x}_proj" for x in LETTERS), "layers.1.attention.o_proj"),
}
HEAD_DIM = 8


def _inputs_of(model: nn.Module, paths: tuple[str, ...],
               inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The first argument each module of ``paths`` receives, by plain pre-hooks."""
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(p).register_forward_pre_hook(
        lambda m, a, p=p: seen.setdefault(p, a[0].detach())) for p in paths]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return [seen[p] for p in paths]


def _by_hand(model: nn.Module, family: str, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """q, k, v of block 1 from the projections' weights: (batch, seq, heads, head_dim) each."""
    paths, _ = PROJECTIONS[family]
    xs = _inputs_of(model, paths, inputs)
    if family == "gpt2":  # Conv1D: x @ W + b, q | k | v one after the other
        c_attn = model.get_submodule(paths[0])
        out = xs[0] @ c_attn.weight + c_attn.bias
        return [piece.unflatten(-1, (-1, HEAD_DIM)) for piece in out.chunk(3, dim=-1)]
    if family == "gpt_neox":  # per head: q, k, v
        linear = model.get_submodule(paths[0])
        out = (xs[0] @ linear.weight.T + linear.bias).unflatten(-1, (-1, 3 * HEAD_DIM))
        return list(out.chunk(3, dim=-1))
    found = []
    for x, path in zip(xs, paths, strict=True):
        linear = model.get_submodule(path)
        out = x @ linear.weight.T + (linear.bias if linear.bias is not None else 0)
        found.append(out.unflatten(-1, (-1, HEAD_DIM)))
    return found


@pytest.mark.parametrize("family", list(FAMILIES))
def test_q_k_v_equal_the_projections_by_hand(family: str) -> None:
    model, inputs = build(family)
    with torch.no_grad(), hookscope.capture(model, "attn.q.1", "attn.k.1", "attn.v.1") as acts:
        model(**inputs)
    for letter, expected in zip(LETTERS, _by_hand(model, family, inputs), strict=True):
        torch.testing.assert_close(acts[f"attn.{letter}.1"], expected, rtol=1e-5, atol=1e-5)
        layout = acts.layout(f"attn.{letter}.1")
        assert (layout.seq, layout.heads) == (1, 2)
    grouped = family in ("llama", "gemma")  # num_key_value_heads=2
    assert acts["attn.k.1"].shape[2] == (2 if grouped else 4) and acts["attn.q.1"].shape[2] == 4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_z_is_what_the_output_projection_receives(family: str) -> None:
    model, inputs = build(family)
    with torch.no_grad(), hookscope.capture(model, "attn.z.1") as acts:
        model(**inputs)
    z = acts["attn.z.1"]  # (batch, heads, seq, head_dim)
    (received,) = _inputs_of(model, (PROJECTIONS[family][1],), inputs)
    assert torch.equal(z.transpose(1, 2).flatten(2), received)
    assert (acts.layout("attn.z.1").heads, acts.layout("attn.z.1").seq) == (1, 2)


def test_z_equals_attention_by_hand_on_gpt2() -> None:
    model, inputs = build("gpt2")
    q, k, v = (t.transpose(1, 2) for t in _by_hand(model, "gpt2", inputs))  # (batch, heads, seq, d)
    scores = q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5
    causal = torch.ones(scores.shape[-1], scores.shape[-1], dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    with torch.no_grad(), hookscope.capture(model, "attn.z.1") as acts:
        model(**inputs)
    torch.testing.assert_close(acts["attn.z.1"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("family", "letter", "columns"), [
    ("gpt2", "q", slice(8, 16)),          # q is features 0:32, head 1 its 8:16
    ("gpt2", "v", slice(72, 80)),         # v is features 64:96
    ("gpt_neox", "k", slice(56, 64)),     # head 2 holds features 48:72 as q | k | v
    ("llama", "k", slice(8, 16)),
])
def test_heads_and_positions_edit_the_right_columns(family: str, letter: str, columns: slice) -> None:
    model, inputs = build(family)
    head = 2 if family == "gpt_neox" else 1
    path = PROJECTIONS[family][0][0 if len(PROJECTIONS[family][0]) == 1 else LETTERS.index(letter)]

    def zero(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        new = output.clone()
        new[:, 3, columns] = 0
        return new

    handle = model.get_submodule(path).register_forward_hook(zero)
    with torch.no_grad():
        expected = model(**inputs)[0]
    handle.remove()
    with torch.no_grad(), hookscope.ablate(model, f"attn.{letter}.1", heads=[head], positions=[3],
                                           absolute=True):
        edited = model(**inputs)[0]
    assert torch.equal(edited, expected)


def test_tree_notes_and_refusal() -> None:
    model, _ = build("gpt2")
    found = standard_names(index(model))
    assert found["transformer.h.0.attn.c_attn"] == ["attn.q.0[heads:8:0/3]", "attn.k.0[heads:8:1/3]",
                                                    "attn.v.0[heads:8:2/3]"]
    assert "attn.z.0::scaled_dot_product_attention" in found["transformer.h.0.attn"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mix(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[0](x)

    with pytest.raises(SelectorError, match=r"'attn.q.0': block 'layers.0' \(Block\) has none "
                                            r"of the modules looked for: attn.c_attn, "
                                            r".*select it by its own path"):
        hookscope.select(Net(), "attn.q.0")


def test_z_of_an_eager_attention_is_refused_naming_the_fix() -> None:
    """An eager attention never calls scaled_dot_product_attention: attn.z would never fire."""
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        vocab_size=60, attn_implementation="eager"))
    with pytest.raises(SelectorError, match=r"'attn.z.0' .* is 'eager' .*load the model with "
                                            r"attn_implementation='sdpa'"):
        hookscope.select(llama, "attn.z.0")
    assert list(hookscope.select(llama, "attn.q.0")) == ["model.layers.0.self_attn.q_proj"]
    assert "attn.z.0" not in str(standard_names(index(llama)))
