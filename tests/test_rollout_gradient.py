"""Gradient-weighted attention rollout (Chefer, Gur & Wolf 2021, eq. 5-6) on a ViT from a config
with 2 layers and 2 heads: equal to the recipe computed by hand from the attentions HF returns
(``output_attentions=True``) and their gradients (plain autograd), with eager and SDPA attention."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope import AttentionError, GradcamError

transformers = pytest.importorskip("transformers")
LAYERS = "vit.layers.*.attention"


def _vit(implementation: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.ViTConfig(image_size=16, patch_size=8, num_hidden_layers=2,
                                    hidden_size=8, num_attention_heads=2, intermediate_size=16,
                                    num_labels=3, attn_implementation=implementation)
    return transformers.ViTForImageClassification(config).eval()


def _by_hand(model: nn.Module, x: torch.Tensor, target: list[int]) -> torch.Tensor:
    """R = I; for each layer R += mean_h(relu(dA * A)) @ R, element by element."""
    eager = _vit("eager")
    eager.load_state_dict(model.state_dict())
    output = eager(x, output_attentions=True)
    maps = output.attentions  # 2 x (batch, heads, 5, 5), each in the graph
    score = sum(output.logits[b, t] for b, t in enumerate(target))
    grads = torch.autograd.grad(score, maps)
    maps = tuple(a.detach() for a in maps)
    batch, heads, tokens = x.shape[0], 2, maps[0].shape[-1]
    relevance = torch.zeros(batch, tokens, tokens)
    for b in range(batch):
        r = [[1.0 if i == j else 0.0 for j in range(tokens)] for i in range(tokens)]
        for a, g in zip(maps, grads):
            bar = [[sum(max(float(g[b, h, i, j] * a[b, h, i, j]), 0.0) for h in range(heads)) / heads
                    for j in range(tokens)] for i in range(tokens)]
            r = [[r[i][j] + sum(bar[i][k] * r[k][j] for k in range(tokens)) for j in range(tokens)]
                 for i in range(tokens)]
        relevance[b] = torch.tensor(r)
    return relevance


@settings(max_examples=6, deadline=None)
@given(implementation=st.sampled_from(["eager", "sdpa"]), seed=st.integers(0, 50),
       target=st.lists(st.integers(0, 2), min_size=2, max_size=2))
def test_gradient_rollout_equals_chefer_by_hand(implementation: str, seed: int,
                                                target: list[int]) -> None:
    model = _vit(implementation, seed)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    got = hookscope.rollout(model, x, layers=LAYERS, target=target)
    assert got.shape == (2, 5, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got, _by_hand(model, x, target), rtol=1e-4, atol=1e-6)


def test_default_target_is_the_predicted_class_and_gradient_flag_alone_works() -> None:
    model = _vit("sdpa")
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    predicted = model(x).logits.argmax(dim=1).tolist()
    got = hookscope.rollout(model, x, layers=LAYERS, gradient=True)
    torch.testing.assert_close(got, _by_hand(model, x, predicted), rtol=1e-4, atol=1e-6)
    other = [(p + 1) % 3 for p in predicted]
    assert not torch.allclose(got, _by_hand(model, x, other), rtol=1e-4, atol=1e-6)


def test_frozen_model_under_no_grad_is_left_as_found() -> None:
    model = _vit("eager").requires_grad_(False)
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = hookscope.rollout(model, x, layers=LAYERS, target=2)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    model.requires_grad_(True)
    torch.testing.assert_close(got, _by_hand(model, x, [2]), rtol=1e-4, atol=1e-6)


def test_refusals_name_the_fix() -> None:
    model, x = _vit("eager"), torch.randn(1, 3, 16, 16)
    with pytest.raises(AttentionError, match="leave head_fusion='mean'"):
        hookscope.rollout(model, x, layers=LAYERS, target=0, head_fusion="max")
    with pytest.raises(GradcamError, match="out of range: the model has 3 classes"):
        hookscope.rollout(model, x, layers=LAYERS, target=7)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.head = mha, nn.Linear(8, 3)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            out, _ = self.attn(t, t, t, need_weights=True, average_attn_weights=False)
            return self.head(out.mean(dim=1))

    with pytest.raises(AttentionError, match="gradient=False"):
        hookscope.rollout(Classifier().eval(), torch.randn(1, 4, 8), layers="attn", target=0)


def _eager_reference(model: nn.Module, score: Any, *args: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eager twin's attentions and d score / d attention (plain autograd)."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    output = eager(*args, output_attentions=True)
    grads = torch.autograd.grad(score(output), output.attentions)
    return [(a.detach(), g) for a, g in zip(output.attentions, grads)]


def test_attention_gradients_of_sdpa_equal_the_eager_twins() -> None:
    """SDPA's ``dO @ V^T`` against the eager softmax's own gradient: a ViT, and a Llama with
    grouped-query attention (4 query heads sharing 2 key/value heads) scored on a next token."""
    torch.manual_seed(3)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=40, attn_implementation="sdpa")).eval()
    cases = [(_vit("sdpa", 4), LAYERS, lambda out: out.logits[:, 1].sum(), torch.randn(2, 3, 16, 16)),
             (llama, "model.layers.*.self_attn", lambda out: out.logits[:, -1, 7].sum(),
              torch.tensor([[1, 5, 9, 3], [2, 8, 4, 6]]))]
    for model, layers, score, x in cases:
        got = hookscope.attention_gradients(model, x, layers=layers, score=score)
        expected = _eager_reference(model, score, x)
        assert len(got) == len(expected) == 2
        for (probabilities, grads), (a, g) in zip(got.values(), expected):
            torch.testing.assert_close(probabilities, a, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(grads, g, rtol=1e-4, atol=1e-6)
            assert float(grads.abs().max()) > 0
