"""Tiny models whose values are computed by functions inside forward, not by modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SeedLeNet(nn.Module):
    """The seed blog's LeNet (kuangliu/pytorch-cifar): four ``F.relu`` and two ``F.max_pool2d``
    calls in the root's own forward; ``relu`` declared but never called (case 02)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)
        self.relu = nn.ReLU()  # declared, never called: forward uses F.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x))
        out = F.max_pool2d(out, 2)
        out = F.relu(self.conv2(out))
        out = F.max_pool2d(out, 2)
        out = out.view(out.size(0), -1)
        out = F.relu(self.fc1(out))
        out = F.relu(self.fc2(out))
        return self.fc3(out)


class EagerSelfAttention(nn.Module):
    """Eager multi-head attention: ``softmax`` of the ``(batch, heads, query, key)`` scores."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, d = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return q, k, v  # each (batch, heads, seq, d_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        probs = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(dim=-1)
        return self.out((probs @ v).transpose(1, 2).flatten(2))


class FusedSelfAttention(EagerSelfAttention):
    """The same weights through ``F.scaled_dot_product_attention``, causal if asked."""

    def __init__(self, d: int = 16, heads: int = 4, causal: bool = False) -> None:
        super().__init__(d, heads)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(context.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A transformer block: attention, then an MLP whose activation is ``F.gelu``."""

    def __init__(self, attention: nn.Module, d: int = 16) -> None:
        super().__init__()
        self.attn = attention
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + F.gelu(self.fc(x))


class TwoAttentions(nn.Module):
    """A block that runs two attention modules: asking it for 'the' attention is ambiguous."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.first = EagerSelfAttention(d)
        self.second = FusedSelfAttention(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def two_blocks() -> nn.Module:
    """Factory for the CLI: a fused-attention block, then an eager one (d=16, 4 heads)."""
    torch.manual_seed(0)
    return nn.Sequential(Block(FusedSelfAttention(causal=True)), Block(EagerSelfAttention()))
