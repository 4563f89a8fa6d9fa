"""Private: what one batch means to the model, the same in ``extract``, ``stats`` and the CLI.

A batch is what a ``DataLoader`` yields. A tensor is the input (``model(batch)``); a dict, such as
a tokenizer's output, holds keyword inputs (``model(**batch)``). A tuple or list is
``(inputs, labels, ...)``, as a DataLoader over a labelled data set yields it (torchvision's
``ImageFolder``, ``TensorDataset(x, y)``): its first item is the inputs (a tensor, a dict, or a
tuple/list of positional arguments, ``model(*inputs)``) and the rest is ignored.

Where the batch goes (``input_device``) is where the model's first computation runs, which is not
always where its first parameter is: accelerate's ``cpu_offload``/``disk_offload``/
``dispatch_model`` keep parameters on ``meta`` (or spread over devices) and load them in their own
pre-forward hooks onto an execution device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hookscope.errors import HookscopeError

__all__ = ["model_inputs", "input_device"]


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


def input_device(model: nn.Module) -> torch.device:
    """The device ``model``'s inputs belong on: the execution device of the first module that
    accelerate placed (``module._hf_hook.execution_device``, in ``named_modules()`` order), else
    the device of its first parameter or buffer that is not on ``meta``, else the CPU."""
    for module in model.modules():
        device = _execution_device(getattr(module, "_hf_hook", None))
        if device is not None:
            return device
    tensors = (t for ts in (model.parameters(), model.buffers()) for t in ts)
    return next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))


def _execution_device(hook: Any) -> torch.device | None:
    """The execution device of an accelerate hook (a ``SequentialHook``'s first that has one)."""
    for inner in (hook, *getattr(hook, "hooks", ())):
        device = getattr(inner, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None
