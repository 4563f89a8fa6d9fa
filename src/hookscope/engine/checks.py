"""The argument checks every public verb shares: one function per kind of argument.

A bad argument is refused when the call is made, before any hook is registered or any forward
runs, with a hookscope exception (``ArgumentTypeError``, a ``TypeError``, for a wrong type;
``ArgumentValueError``, a ``ValueError``, for a value that cannot work; ``EmptySelectionError``
for a selection of nothing) whose message names the parameter, what it got and what to pass.
The verbs call these and never repeat them: a fix for a kind of argument goes here once.

What is refused rather than warned about (the README's "Bad arguments" says the same):

- a model that is not an ``nn.Module`` (``None``, a string, a function);
- a flag (``grads=``, ``inputs=`` ...) that is not a ``bool``: ``grads="no"`` is truthy;
- a device that torch cannot parse (``to="nodevice"``), or a CUDA/MPS device this machine lacks;
- a ``dtype`` that is not a ``torch.dtype`` (``"half"``), or, for captured activations, not a
  floating dtype (a cast to ``torch.int8`` truncates every value; quantize explicitly instead);
- an empty selection: no pattern, ``{}`` of edits or vectors, ``layers=[]``, ``positions=[]``
  (a call that would do nothing and say nothing);
- a steering vector holding NaN or infinity, or no values at all (a ``meta`` tensor).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch
from torch import nn

from hookscope.errors import ArgumentTypeError, ArgumentValueError, EmptySelectionError

__all__ = ["check_callable", "check_device", "check_dtype", "check_finite", "check_flag",
           "check_model", "check_nonempty", "check_tensor"]


def _got(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_model(model: object) -> None:
    """Raise ``ArgumentTypeError`` unless ``model`` is an ``nn.Module`` (wrappers included)."""
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"model must be a torch.nn.Module (the root module whose submodules are hooked); got "
            f"{_got(model)}. Pass the model object itself, e.g. hookscope.capture(model, 'fc1'), "
            f"not its name, its output or a function building it")


def check_flag(name: str, value: object) -> None:
    """Raise ``ArgumentTypeError`` unless ``value`` is a ``bool`` (``"yes"``, ``"no"``, ``1`` are
    refused: every non-empty string is truthy, so ``grads="no"`` would turn gradients on)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False; got {_got(value)} (a string or "
                                f"number is not read as a flag: write {name}=True)")


def check_device(name: str, value: object) -> None:
    """Raise unless ``value`` is ``None`` or a device torch parses and this machine has.

    Raises:
        ArgumentTypeError: not a ``str``, ``int`` or ``torch.device``.
        ArgumentValueError: a string torch cannot parse (``"nodevice"``), or a ``cuda``/``mps``
            device that is not available here (``"cuda:7"`` on a machine with one GPU).
    """
    if value is None:
        return
    if not isinstance(value, (str, int, torch.device)) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a device such as 'cpu', 'cuda:0' or "
                                f"torch.device('cpu'); got {_got(value)}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ArgumentValueError(f"{name}={value!r} is not a device torch knows: use 'cpu', "
                                 f"'cuda', 'cuda:N', 'mps' or None") from None
    missing = _unavailable(device)
    if missing:
        raise ArgumentValueError(f"{name}={value!r}: {missing}; use 'cpu' or None")


def _unavailable(device: torch.device) -> str | None:
    """Why ``device`` cannot be used on this machine, or None when it can (cpu, meta, ...)."""
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            return f"this machine has {count} CUDA device{'s' if count != 1 else ''}"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available on this machine"
    return None


def check_dtype(name: str, value: object, *, floating: bool = False) -> None:
    """Raise unless ``value`` is ``None`` or a ``torch.dtype`` (a floating one with
    ``floating=True``: casting float activations to an integer dtype truncates them).

    Raises:
        ArgumentTypeError: not a ``torch.dtype`` (``"half"``, ``"float16"``, ``numpy.float16``).
        ArgumentValueError: ``floating=True`` and an integer, bool or complex dtype.
    """
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise ArgumentTypeError(f"{name} must be a torch.dtype such as torch.float16 or "
                                f"torch.bfloat16; got {_got(value)}")
    if floating and not value.is_floating_point:
        raise ArgumentValueError(
            f"{name}={value} would cast floating activations to {value}, truncating every value "
            f"(a silent loss): use a floating dtype (torch.float16, torch.bfloat16, "
            f"torch.float32), and quantize explicitly afterwards if you need integers")


def check_nonempty(name: str, value: object, example: str) -> None:
    """Raise ``EmptySelectionError`` when ``value`` (patterns, a dict of edits, positions) is
    empty: every verb refuses a selection of nothing rather than doing nothing silently."""
    empty = value.numel() == 0 if isinstance(value, torch.Tensor) else (
        isinstance(value, Sized) and len(value) == 0)
    if empty:
        raise EmptySelectionError(f"{name} selects nothing (got {value!r}): a call that would do "
                                  f"nothing is refused; give at least one, e.g. {example}")


def check_finite(name: str, value: Any) -> None:
    """Raise ``ArgumentValueError`` when tensor ``value`` holds no values (``meta``, a
    FakeTensor) or any NaN or infinity (added to an activation it would poison every later one)."""
    if value.device.type == "meta" or type(value).__name__ == "FakeTensor":
        raise ArgumentValueError(f"{name} is a {value.device.type} tensor of shape "
                                 f"{tuple(value.shape)} that holds no values: give a tensor with "
                                 f"values (on any device; it is moved to the output's)")
    if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ArgumentValueError(f"{name} holds {bad} NaN or infinite value{'s' if bad != 1 else ''} "
                                 f"of {value.numel()}: adding it would make every later activation "
                                 f"non-finite; fix the vector (torch.nan_to_num, or recompute it)")


def check_callable(name: str, value: object, example: str) -> None:
    """Raise ``ArgumentTypeError`` unless ``value`` is callable (a metric, a loss function)."""
    if not callable(value):
        raise ArgumentTypeError(f"{name} must be a function, e.g. {example}; got {_got(value)}")


def check_tensor(name: str, value: object, example: str) -> None:
    """Raise ``ArgumentTypeError`` unless ``value`` is a ``torch.Tensor``."""
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a tensor, e.g. {example}; got {_got(value)}")
