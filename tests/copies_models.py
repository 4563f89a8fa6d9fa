"""Models for tests/test_copies.py, importable without hookscope (a checkpoint names them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    """Its own forward calls ``F.relu`` (for ``::relu`` addresses)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def double_head(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The user's own hook (module level, so a pickle can hold it): doubles the output."""
    return output * 2


def note_kwargs(module: nn.Module, args: Any, kwargs: Any, output: torch.Tensor) -> None:
    """The user's own hook taking keyword arguments, always called: changes nothing."""
