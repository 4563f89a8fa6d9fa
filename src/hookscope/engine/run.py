"""Private: what one batch means to the model, the same in ``extract``, ``stats`` and the CLI.

A batch is what a ``DataLoader`` yields. A tensor is the input (``model(batch)``); a dict, such as
a tokenizer's output, holds keyword inputs (``model(**batch)``). A tuple or list is
``(inputs, labels, ...)``, as a DataLoader over a labelled data set yields it (torchvision's
``ImageFolder``, ``TensorDataset(x, y)``): its first item is the inputs (a tensor, a dict, or a
tuple/list of positional arguments, ``model(*inputs)``) and the rest is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hookscope.errors import HookscopeError

__all__ = ["model_inputs"]


def model_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``(args, kwargs)`` to call the model with on ``batch`` (see the module docstring).

    Raises:
        HookscopeError: ``batch`` is none of a tensor, a dict, or a non-empty tuple/list whose
            first item is a tensor, dict, tuple or list.
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and batch:
        inputs = batch[0]
        if isinstance(inputs, (tuple, list)):
            return tuple(inputs), {}
        if isinstance(inputs, (torch.Tensor, Mapping)):
            return model_inputs(inputs)
    raise HookscopeError(
        f"a batch is a {type(batch).__name__}{_first_item(batch)}; a batch is a tensor "
        f"(model(batch)), a dict of keyword inputs (model(**batch)), or a tuple/list "
        f"(inputs, labels, ...) whose first item is a tensor, a dict, or a tuple of positional "
        f"inputs (model(*inputs))")


def _first_item(batch: Any) -> str:
    if isinstance(batch, (tuple, list)) and batch:
        return f" whose first item is a {type(batch[0]).__name__}"
    return ""
