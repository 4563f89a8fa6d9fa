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
- a steering vector holding NaN or infinity, or no values at all (a ``meta`` tensor);
- a count or number of the wrong type, not finite or below its minimum (``check_int``,
  ``check_number``: ``batch_size=0``, ``atol=-1``, ``scale=nan``);
- what cannot be iterated where an iterable is due (``check_iterable``: ``batches=None``),
  options that do not exist (``check_options``), a function whose signature cannot take the
  arguments it will get (``check_arity``);
- token ids that are not integers or outside the vocabulary (``check_token_ids``), positions
  of another form or past a known input length (``check_positions``), a run folder that is a
  file (``check_run_dir``).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    EmptySelectionError,
    TrainingModeWarning,
    warn,
)

__all__ = ["brief", "check_arity", "check_callable", "check_device", "check_dtype", "check_finite",
           "check_flag", "check_int", "check_iterable", "check_model", "check_nonempty", "check_number",
           "check_options", "check_positions", "check_run_dir", "check_tensor", "check_token_ids",
           "check_path", "warn_if_dropout_trains"]


def brief(value: object) -> str:
    """``repr(value)`` on one line (a sparse tensor's repr spans several), at most 60
    characters: what an error message shows of a bad argument."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _got(value: object) -> str:
    return f"{type(value).__name__} {brief(value)}"


def warn_if_dropout_trains(model: nn.Module, verb: str) -> None:
    """Warn (``TrainingModeWarning``, once per call) when ``model`` has a dropout module (``nn.Dropout``
    and its kin, or a class named ``*Dropout*``) with a rate above 0 in training mode: each of
    ``verb``'s forwards would then sample another mask, and its table compare noise."""
    active = [path for path, module in model.named_modules()
              if module.training and _is_dropout(module)]
    if active:
        warn(f"{verb} runs the model in training mode, where its {len(active)} dropout "
             f"module{'s' if len(active) != 1 else ''} ('{active[0]}'"
             f"{' …' if len(active) > 1 else ''}) sample another mask in every forward, so the "
             f"results differ from run to run: call model.eval() first (and model.train() "
             f"afterwards to train on)", TrainingModeWarning)


def _is_dropout(module: nn.Module) -> bool:
    dropout = isinstance(module, nn.modules.dropout._DropoutNd) or \
        "dropout" in type(module).__name__.lower()
    rate = getattr(module, "p", 1.0)
    return dropout and not (isinstance(rate, (int, float)) and rate == 0)


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


def check_int(name: str, value: object, *, minimum: int | None = None,
              maximum: int | None = None) -> None:
    """Raise unless ``value`` is an ``int`` (not a ``bool``: ``True`` is not a count) that is
    at least ``minimum`` and at most ``maximum`` when they are given.

    Raises:
        ArgumentTypeError: not an ``int`` (``"1"``, ``2.5``, ``True``).
        ArgumentValueError: below ``minimum`` (``batch_size=0``) or above ``maximum``.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int; got {_got(value)} (write {name}=1, "
                                f"not a string, float or bool)")
    if minimum is not None and value < minimum:
        raise ArgumentValueError(f"{name}={value} is below {minimum}: pass an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise ArgumentValueError(f"{name}={value!r:.20} is above {maximum}: pass an int <= {maximum}")


def check_number(name: str, value: object, *, minimum: float | None = None) -> None:
    """Raise unless ``value`` is a finite real number (``int`` or ``float``, not ``bool`` or
    complex) that is at least ``minimum`` when one is given (a tolerance, a scale).

    Raises:
        ArgumentTypeError: not a real number (``"big"``, ``True``, ``1j``, a tensor).
        ArgumentValueError: NaN or infinite, or below ``minimum`` (``atol=-1``).
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a real number, e.g. {name}=1e-5; got {_got(value)}")
    if isinstance(value, int) and abs(value) > 2**53:  # float(value) would round or overflow
        raise ArgumentValueError(f"{name}={value!r:.20} is too large: pass a number of at most "
                                 f"2**53 in size")
    if not math.isfinite(value):
        raise ArgumentValueError(f"{name}={value} is not finite: pass a finite number, e.g. "
                                 f"{name}=1e-5")
    if minimum is not None and value < minimum:
        raise ArgumentValueError(f"{name}={value} is below {minimum}: pass a number >= {minimum}")


def check_iterable(name: str, value: object, example: str) -> None:
    """Raise ``ArgumentTypeError`` when ``value`` cannot be iterated (``None``, a number) or is
    a lone string (read character by character it would be nonsense)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ArgumentTypeError(f"{name} must be an iterable, e.g. {example}; got {_got(value)}")


def check_options(name: str, value: object, allowed: Iterable[str]) -> None:
    """Raise unless ``value`` is ``None`` or a dict whose keys are all among ``allowed`` (the
    keyword options passed on to another function, e.g. ``run(options=)`` to ``capture``).

    Raises:
        ArgumentTypeError: not a mapping (``options="early_stop"``).
        ArgumentValueError: a key that is not an option (``{"bogus": 1}``); the message lists them.
    """
    if value is None:
        return
    known = sorted(allowed)
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{name} must be a dict of options, e.g. {name}={{'grads': True}}; "
                                f"got {_got(value)}")
    unknown = [key for key in value if key not in known]
    if unknown:
        raise ArgumentValueError(f"{name} holds {', '.join(map(repr, unknown))}, not an option; "
                                 f"the options are {', '.join(known)}")


def check_arity(name: str, fn: Callable[..., Any], count: int, fix: str) -> None:
    """Raise ``ArgumentTypeError`` when ``fn`` cannot be called with ``count`` positional
    arguments (by ``inspect.signature``; a callable without a readable signature, a builtin
    such as ``abs``, passes). ``fix`` is what to do instead, e.g. ``"pass context=True"``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(count))
    except TypeError as err:
        raise ArgumentTypeError(f"{name} will be called with {count} argument"
                                f"{'s' if count != 1 else ''}, but its signature {signature} "
                                f"cannot take that ({err}): {fix}") from None


def check_token_ids(name: str, ids: object, vocab_size: int) -> None:
    """Raise unless ``ids`` is an integer tensor of token ids in ``[0, vocab_size)`` (the rows
    of an embedding of ``vocab_size`` entries).

    Raises:
        ArgumentTypeError: not a tensor, or a floating, complex or bool tensor.
        ArgumentValueError: not 2-D ``(batch, seq)``; an id below 0 or at least ``vocab_size``.
    """
    check_tensor(name, ids, "tokenizer(text, return_tensors='pt').input_ids, (batch, seq)")
    assert isinstance(ids, torch.Tensor)
    if ids.dim() != 2:
        fix = f"{name}[None] (one sequence as a batch of one)" if ids.dim() == 1 else \
            "a (batch, seq) tensor, as the tokenizer returns"
        raise ArgumentValueError(f"{name} has shape {tuple(ids.shape)}, but token ids are "
                                 f"(batch, seq): pass {fix}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ArgumentTypeError(f"{name} must hold integer token ids (torch.long); got dtype "
                                f"{ids.dtype}: convert with {name}.long() only if the values "
                                f"are whole token ids")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ArgumentValueError(f"{name} holds ids from {int(ids.min())} to {int(ids.max())}, "
                                 f"but the model's vocabulary has {vocab_size} tokens (ids 0 … "
                                 f"{vocab_size - 1}): tokenize with the model's own tokenizer")


def check_positions(name: str, value: object, length: int | None = None) -> None:
    """Raise unless ``value`` has a form of token positions: ``None``, an ``int``, a sequence of
    ints, a ``slice``, a tensor (ints or a boolean mask), or, with ``name == "positions"`` of
    ``patch``, a mapping ``{int: int}``. With ``length`` (the token count of the input, when the
    verb knows it), an int position must lie in ``-length … length - 1``.

    Raises:
        ArgumentTypeError: another type (``"last"``, ``True``, ``{"a": "b"}``, ``[1.5]``).
        ArgumentValueError: a position outside the input of ``length`` tokens.
    """
    if value is None or isinstance(value, (slice, torch.Tensor)):
        return
    items: list[object]
    if isinstance(value, Mapping):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = list(value)
    else:
        items = [value]
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool):
            raise ArgumentTypeError(
                f"{name} must be an int, a list of ints, a slice or a tensor (token positions, "
                f"negative from the end), e.g. {name}=[-1]; got {_got(value)}")
        if length is not None and not -length <= item < length:
            raise ArgumentValueError(f"{name} holds {item}, but the input has {length} tokens: "
                                     f"use positions in {-length} … {length - 1}")


def check_path(name: str, value: object, example: str) -> None:
    """Raise ``ArgumentTypeError`` unless ``value`` is a path (``str`` or ``os.PathLike``; a
    ``bytes`` path is refused too: hookscope names files by text)."""
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{name} must be a path, e.g. {example}; got {_got(value)}")


def check_run_dir(name: str, value: object) -> None:
    """Raise unless ``value`` is ``None`` or a path (``str``/``os.PathLike``) that is a folder
    or does not exist yet (it is created); an existing file cannot hold a run.

    Raises:
        ArgumentTypeError: not a path.
        ArgumentValueError: ``value`` (or a parent of it) is an existing file.
    """
    if value is None:
        return
    check_path(name, value, f"{name}='runs/exp1'")
    path = Path(value)  # type: ignore[arg-type]
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise ArgumentValueError(f"{name}={str(value)!r}: {str(folder)!r} is a file, not a "
                                     f"folder: pass a folder path (it is created if missing)")
