"""Attention rollout (Abnar & Zuidema 2020) on a ViT from a config: equal to the paper's recipe
computed by hand from the queries and keys (plain forward hooks), for every head fusion."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope import AttentionError

transformers = pytest.importorskip("transformers")
HEADS = 4


def _vit() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=3,
                                    hidden_size=32, num_attention_heads=HEADS,
                                    intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification(config).eval()


def _probabilities_by_hand(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """softmax(q k^T / sqrt(d)) per layer, from each layernorm_before's output."""
    kept: list[torch.Tensor] = []
    handles = [block.layernorm_before.register_forward_hook(lambda m, a, o: kept.append(o))
               for block in model.vit.layers]
    try:
        with torch.no_grad():
            model(x)
            maps = []
            for block, h in zip(model.vit.layers, kept):
                def heads(t: torch.Tensor) -> torch.Tensor:
                    return t.reshape(t.shape[0], t.shape[1], HEADS, -1).transpose(1, 2)
                q, k = heads(block.attention.q_proj(h)), heads(block.attention.k_proj(h))
                maps.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1))
    finally:
        for handle in handles:
            handle.remove()
    return maps


def _rollout_by_hand(maps: list[torch.Tensor], fusion: str, ratio: float) -> torch.Tensor:
    batch, tokens = maps[0].shape[0], maps[0].shape[-1]
    flow = torch.eye(tokens).expand(batch, tokens, tokens)
    for probabilities in maps:
        fused = getattr(probabilities, fusion if fusion == "mean" else f"a{fusion}")(dim=1)
        for b in range(batch):  # the smallest entries zeroed, column 0 spared
            order = fused[b].flatten().argsort()[:int(tokens * tokens * ratio)]
            for index in order.tolist():
                if index % tokens != 0:
                    fused[b].view(-1)[index] = 0.0
        step = 0.5 * fused + 0.5 * torch.eye(tokens)
        flow = (step / step.sum(-1, keepdim=True)) @ flow
    return flow


@settings(max_examples=6, deadline=None)
@given(fusion=st.sampled_from(["mean", "max", "min"]), ratio=st.sampled_from([0.0, 0.5, 0.9]),
       batch=st.integers(1, 2))
def test_rollout_equals_the_recipe_by_hand(fusion: Any, ratio: float, batch: int) -> None:
    model, x = _vit(), torch.randn(batch, 3, 32, 32)
    flow = hookscope.rollout(model, x, layers="vit.layers.*.attention", head_fusion=fusion,
                             discard_ratio=ratio)
    assert flow.shape == (batch, 17, 17) and flow.dtype == torch.float32
    expected = _rollout_by_hand(_probabilities_by_hand(model, x), fusion, ratio)
    torch.testing.assert_close(flow, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flow.sum(-1), torch.ones(batch, 17))


def test_rollout_errors_say_what_to_do() -> None:
    model, x = _vit(), torch.randn(1, 3, 32, 32)
    with pytest.raises(AttentionError, match=r"head_fusion='sum': choose 'mean', 'max' or 'min'"):
        hookscope.rollout(model, x, layers="vit.layers.*.attention", head_fusion="sum")  # type: ignore[arg-type]
    with pytest.raises(AttentionError, match=r"discard_ratio=1.0 is outside \[0, 1\)"):
        hookscope.rollout(model, x, layers="vit.layers.*.attention", discard_ratio=1.0)
