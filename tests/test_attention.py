"""Attention probabilities: recomputed SDPA against the fused kernel, eager softmax, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.diagnostics.attention_maps import sdpa_probabilities
from hookscope.errors import AttentionError
from tests.functional_models import Block, EagerSelfAttention, FusedSelfAttention, TwoAttentions


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), groups=st.integers(1, 2),
       length=st.integers(1, 6), source=st.integers(1, 6), width=st.sampled_from([4, 8]),
       mask=st.sampled_from(["none", "bool", "float", "causal"]),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**16))
def test_recomputed_probabilities_reproduce_the_fused_output(
        batch: int, kv_heads: int, groups: int, length: int, source: int, width: int, mask: str,
        scale: float | None, seed: int) -> None:
    """probabilities @ value must equal what F.scaled_dot_product_attention returned."""
    generator = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    query = torch.randn(batch, heads, length, width, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, source, width, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, source, 3, generator=generator, dtype=torch.float64)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(batch, 1, length, source, generator=generator) > 0.3
        attn_mask[..., 0] = True  # no fully masked row
    elif mask == "float":
        attn_mask = torch.randn(length, source, generator=generator, dtype=torch.float64)
    causal = mask == "causal"
    gqa = groups > 1
    fused = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                           is_causal=causal, scale=scale, enable_gqa=gqa)
    probs = sdpa_probabilities(query, key, attn_mask, causal, scale, gqa)
    assert probs.shape == (batch, heads, length, source)
    value = value.repeat_interleave(groups, dim=1)
    if causal and source < length:  # rows with no key at or before them: NaN in both
        rows = slice(0, source)
        torch.testing.assert_close(probs[..., rows, :] @ value, fused[..., rows, :])
    else:
        torch.testing.assert_close(probs @ value, fused)
        torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs[..., 0]))


def test_eager_and_fused_modules_give_the_same_probabilities() -> None:
    eager = Block(EagerSelfAttention())
    fused = Block(FusedSelfAttention())
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, 5, 16)
    q, k, _ = eager.attn.split(x)
    expected = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)  # d_head 4: scale 1/2
    for model in (eager, fused):
        probs = hookscope.attention(model, x, layers="attn")
        assert list(probs) == ["attn"]
        torch.testing.assert_close(probs["attn"], expected)


def test_a_block_holding_one_attention_is_selectable() -> None:
    model = nn.Sequential(Block(FusedSelfAttention(causal=True)), Block(EagerSelfAttention()))
    x = torch.randn(1, 4, 16)
    probs = hookscope.attention(model, x, layers="*")
    assert list(probs) == ["0", "1"]
    assert torch.equal(probs["0"][0, :, 0, 1:], torch.zeros(4, 3))  # causal: the first token
    torch.testing.assert_close(probs["0"], hookscope.attention(model, x, layers="0.attn")["0.attn"])


def test_reused_module_gives_one_entry_per_call() -> None:
    attention = EagerSelfAttention()
    model = nn.Sequential(attention, attention)
    x = torch.randn(1, 3, 16)
    probs = hookscope.attention(model, x, layers="0")
    assert list(probs) == ["0:0", "0:1"]
    q, k, _ = attention.split(attention(x))
    torch.testing.assert_close(probs["0:1"], torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1))


def test_two_attentions_in_one_call_is_ambiguous() -> None:
    model = nn.Sequential(TwoAttentions())
    with pytest.raises(AttentionError, match=r"computed 2 attentions.*select a module holding "
                                             r"exactly one, e.g. '0\.\*'"):
        hookscope.attention(model, torch.randn(1, 3, 16), layers="0")


def test_no_attention_and_never_ran_are_errors() -> None:
    model = Block(EagerSelfAttention())
    with pytest.raises(AttentionError, match=r"call 0 of 'fc' computed no attention"):
        hookscope.attention(model, torch.randn(1, 3, 16), layers="fc")
    with pytest.raises(AttentionError, match=r"'1' never ran"):
        hookscope.attention(Unused(), torch.randn(1, 3, 16), layers="*")


class Unused(nn.Sequential):
    """Runs only its first attention module."""

    def __init__(self) -> None:
        super().__init__(EagerSelfAttention(), EagerSelfAttention())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self[0](x)


class MhaBlock(nn.Module):
    """nn.MultiheadAttention called with or without per-head weights."""

    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.per_head = per_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.mha(x, x, x, need_weights=self.per_head, average_attn_weights=False)
        return out


def test_multihead_attention_gives_its_per_head_weights_or_says_how() -> None:
    x = torch.randn(2, 5, 16)
    model = MhaBlock(per_head=True)
    with torch.no_grad():
        probs = hookscope.attention(model, x, layers="mha")
        _, expected = model.mha(x, x, x, need_weights=True, average_attn_weights=False)
    assert probs["mha"].shape == (2, 4, 5, 5)
    assert torch.equal(probs["mha"], expected)
    with pytest.raises(AttentionError, match=r"need_weights=True, average_attn_weights=False"):
        hookscope.attention(MhaBlock(per_head=False), x, layers="mha")
