"""A stand-in for TransformerLens's ``HookedTransformer`` (transformer_lens 2.x/3.x,
``HookedTransformer.py``, ``components/*.py``): the same module tree, attribute and parameter
names and hook points, computing what TL computes for a GPT-2-style config (LayerNorm, learned
positions, GELU MLP, causal attention, no attention dropout). transformer_lens 4 ships a
``TransformerBridge`` instead and needs wandb, datasets and jaxtyping, so it is not installed here.

Tree (``HookedTransformer(Config(...))``)::

    embed.W_E  hook_embed  pos_embed.W_pos  hook_pos_embed
    blocks.{i}: hook_resid_pre, ln1 (w, b, hook_scale, hook_normalized),
        attn (W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O; hook_q, hook_k, hook_v, hook_attn_scores,
        hook_pattern, hook_z), hook_attn_out, hook_resid_mid, ln2, mlp (W_in, b_in, W_out,
        b_out; hook_pre, hook_post), hook_mlp_out, hook_resid_post
    ln_final  unembed.W_U, unembed.b_U
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


@dataclass
class Config:
    """The fields of ``HookedTransformerConfig`` this stand-in reads."""

    n_layers: int = 2
    d_model: int = 32
    n_heads: int = 4
    d_head: int = 8
    d_mlp: int = 64
    d_vocab: int = 60
    n_ctx: int = 32
    eps: float = 1e-5


class HookPoint(nn.Module):
    """TL's ``HookPoint``: the identity, a module to hook."""

    def forward(self, x: Tensor) -> Tensor:
        return x


class Embed(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.randn(cfg.d_vocab, cfg.d_model) * 0.5)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.W_E[tokens]


class PosEmbed(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.W_pos = nn.Parameter(torch.randn(cfg.n_ctx, cfg.d_model) * 0.1)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.W_pos[: tokens.shape[-1]].expand(tokens.shape[0], -1, -1)


class LayerNorm(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.w = nn.Parameter(1 + 0.1 * torch.randn(cfg.d_model))
        self.b = nn.Parameter(0.1 * torch.randn(cfg.d_model))
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale) * self.w + self.b


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        h, d, e = cfg.n_heads, cfg.d_head, cfg.d_model
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(torch.randn(h, e, d) / e ** 0.5) for _ in range(3))
        self.W_O = nn.Parameter(torch.randn(h, d, e) / (h * d) ** 0.5)
        self.b_Q, self.b_K, self.b_V = (nn.Parameter(0.1 * torch.randn(h, d)) for _ in range(3))
        self.b_O = nn.Parameter(0.1 * torch.randn(e))
        self.register_buffer("mask", torch.ones(cfg.n_ctx, cfg.n_ctx, dtype=torch.bool).tril())
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))
        self.attn_scale = d ** 0.5
        self.hook_k, self.hook_q, self.hook_v, self.hook_z = (HookPoint() for _ in range(4))
        self.hook_attn_scores, self.hook_pattern = HookPoint(), HookPoint()

    def forward(self, query_input: Tensor, key_input: Tensor, value_input: Tensor) -> Tensor:
        q = self.hook_q(torch.einsum("bpm,hmd->bphd", query_input, self.W_Q) + self.b_Q)
        k = self.hook_k(torch.einsum("bpm,hmd->bphd", key_input, self.W_K) + self.b_K)
        v = self.hook_v(torch.einsum("bpm,hmd->bphd", value_input, self.W_V) + self.b_V)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.attn_scale
        n = scores.shape[-1]
        scores = self.hook_attn_scores(torch.where(self.mask[:n, :n], scores, self.IGNORE))
        pattern = self.hook_pattern(F.softmax(scores, dim=-1))
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.W_in = nn.Parameter(torch.randn(cfg.d_model, cfg.d_mlp) / cfg.d_model ** 0.5)
        self.b_in = nn.Parameter(0.1 * torch.randn(cfg.d_mlp))
        self.W_out = nn.Parameter(torch.randn(cfg.d_mlp, cfg.d_model) / cfg.d_mlp ** 0.5)
        self.b_out = nn.Parameter(0.1 * torch.randn(cfg.d_model))
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        pre = self.hook_pre(x @ self.W_in + self.b_in)
        return self.hook_post(F.gelu(pre, approximate="tanh")) @ self.W_out + self.b_out


class TransformerBlock(nn.Module):
    def __init__(self, cfg: Config, block_index: int) -> None:
        super().__init__()
        self.layer_id = block_index
        self.ln1, self.ln2 = LayerNorm(cfg), LayerNorm(cfg)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)
        for name in ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in",
                     "hook_attn_out", "hook_mlp_out", "hook_resid_pre", "hook_resid_mid",
                     "hook_resid_post"):
            setattr(self, name, HookPoint())

    def forward(self, resid_pre: Tensor) -> Tensor:
        resid_pre = self.hook_resid_pre(resid_pre)
        normed = self.ln1(resid_pre)
        attn_out = self.hook_attn_out(self.attn(normed, normed, normed))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid_mid)))
        return self.hook_resid_post(resid_mid + mlp_out)


class Unembed(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.W_U = nn.Parameter(torch.randn(cfg.d_model, cfg.d_vocab) / cfg.d_model ** 0.5)
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))

    def forward(self, residual: Tensor) -> Tensor:
        return residual @ self.W_U + self.b_U


class HookedTransformer(nn.Module):
    """``HookedTransformer(cfg)(tokens)`` -> logits ``(batch, seq, d_vocab)``; ``attention_mask``
    is accepted (keyword, as TL's) and must be ``None`` or all ones here."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed, self.hook_embed = Embed(cfg), HookPoint()
        self.pos_embed, self.hook_pos_embed = PosEmbed(cfg), HookPoint()
        self.blocks = nn.ModuleList([TransformerBlock(cfg, i) for i in range(cfg.n_layers)])
        self.ln_final = LayerNorm(cfg)
        self.unembed = Unembed(cfg)

    def forward(self, input: Tensor, return_type: str = "logits",  # noqa: A002 (TL's name)
                attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("the stand-in runs unpadded batches only")
        residual = self.hook_embed(self.embed(input)) + self.hook_pos_embed(self.pos_embed(input))
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))


def build(seed: int = 0, **fields: int) -> HookedTransformer:
    """A stand-in from ``Config(**fields)``, weights drawn from ``seed``; eval mode."""
    torch.manual_seed(seed)
    return HookedTransformer(Config(**fields)).eval()
