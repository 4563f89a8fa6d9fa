"""The user's hooks for tests/test_copies.py, importable without hookscope (a checkpoint names
them, and ``tests.models.ReluBlocks``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def double_head(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The user's own hook (module level, so a pickle can hold it): doubles the output."""
    return output * 2


def note_kwargs(module: nn.Module, args: Any, kwargs: Any, output: torch.Tensor) -> None:
    """The user's own hook taking keyword arguments, always called: changes nothing."""
