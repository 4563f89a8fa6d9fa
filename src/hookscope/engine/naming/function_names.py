"""Private: the names of function calls inside a forward, and the addresses that select them.

``function_name`` gives a torch function the name its author wrote (``F.relu``, ``torch.relu`` and
``Tensor.relu`` are all ``"relu"``), ``bind_arguments`` binds a call's arguments to the function's
parameter names, ``split_address``/``parse_op`` read ``path::name#N[parts]``, and
``functional_counterpart`` says which function name reaches the value of an ``nn.ReLU`` that a
forward replaced by ``F.relu``. ``refuse_uninterceptable`` refuses, before running, models whose
calls cannot be seen one by one (TorchScript). ``custom_function`` names the custom
``torch.autograd.Function`` a call is made inside, whose calls are not the module's own, and
``function_refusal`` says why its address records nothing (case 71).
"""

from __future__ import annotations

import inspect
import re
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import get_testing_overrides

from hookscope.errors import HookscopeError, SelectorError

__all__ = ["function_name", "bind_arguments", "split_address", "parse_op", "refuse_uninterceptable",
           "functional_counterpart", "functional_hint", "custom_function", "function_refusal"]


# ------------------------------------------------------------------------------- addresses
_OP = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:#(?P<occurrence>\d+))?")


def split_address(pattern: str) -> tuple[str, str | None, str]:
    """Split a function-level address into its module pattern, its op and its output parts.

    ``"h.*.attn::softmax#0[0]"`` -> ``("h.*.attn", "softmax#0", "[0]")``; ``"::relu"`` ->
    ``("", "relu", "")``; a pattern without ``::`` -> ``(pattern, None, "")``.

    Raises:
        SelectorError: the op is not ``NAME`` or ``NAME#N`` (N a call index from 0).
    """
    base, separator, rest = pattern.rpartition("::")
    if not separator:
        return pattern, None, ""
    bracket = rest.find("[")
    op, parts = (rest, "") if bracket < 0 else (rest[:bracket], rest[bracket:])
    if not _OP.fullmatch(op.strip()):
        raise SelectorError(
            f"'{pattern}': after '::' comes the name of a function the module's forward calls, "
            f"as written in code ('relu' for F.relu, 'softmax', 'scaled_dot_product_attention'), "
            f"optionally '#N' for its N-th call (from 0) in each forward and output parts in "
            f"brackets: e.g. 'h.*.attn::softmax', '::relu#1', 'attn::unbind[0]'")
    return base.strip(), op.strip(), parts


def parse_op(op: str) -> tuple[str, int | None]:
    """``"relu"`` -> ``("relu", None)``; ``"relu#1"`` -> ``("relu", 1)``."""
    match = _OP.fullmatch(op)
    if match is None:
        raise ValueError(f"not an op: {op!r}")
    occurrence = match["occurrence"]
    return match["name"], None if occurrence is None else int(occurrence)


# ------------------------------------------------------------------------------- names
_NAMES: dict[Any, str] = {}


def function_name(func: Callable[..., Any]) -> str:
    """The name a user writes for ``func``: its ``__name__`` without dunder underscores.

    ``F.relu``, ``torch.relu``, ``Tensor.relu`` -> ``"relu"``; ``F.max_pool2d`` (a
    ``boolean_dispatch`` wrapper) -> ``"max_pool2d"``; ``Tensor.__getitem__`` -> ``"getitem"``;
    reading a tensor property (``x.T``, ``x.shape``) -> the property's name (``"T"``).
    """
    try:
        return _NAMES[func]
    except (KeyError, TypeError):
        pass
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a getset_descriptor's __get__: x.T, x.shape, x.grad
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
    try:
        _NAMES[func] = name
    except TypeError:
        pass
    return name


_SIGNATURES: dict[Any, inspect.Signature | None] = {}


def bind_arguments(func: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Bind ``args`` and ``kwargs`` to ``func``'s parameter names, defaults filled in.

    Builtins (``F.scaled_dot_product_attention``, ``torch.softmax``) have no Python signature;
    theirs comes from the documentation for SDPA (``query, key, value, attn_mask, dropout_p,
    is_causal, scale, enable_gqa``) and otherwise from ``torch.overrides.get_testing_overrides()``,
    whose dummy for each overridable function has its parameters. A function bound by neither gives
    ``{"0": args[0], ..., **kwargs}``.
    """
    signature = _signature(func)
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            pass
        else:
            bound.apply_defaults()
            return dict(bound.arguments)
    return {**{str(i): a for i, a in enumerate(args)}, **kwargs}


def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    if func in _SIGNATURES:
        return _SIGNATURES[func]
    signature: inspect.Signature | None
    try:
        signature = inspect.signature(func)
        if any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
            raise ValueError("only *args")
    except (TypeError, ValueError):
        dummy = _DOCUMENTED.get(function_name(func)) or _testing_overrides().get(func)
        signature = inspect.signature(dummy) if dummy is not None else None
    _SIGNATURES[func] = signature
    return signature


_OVERRIDES: dict[Any, Callable[..., Any]] = {}


def _sdpa(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> None:
    """The documented signature of ``F.scaled_dot_product_attention`` (torch 2.5+), which its
    builtin lacks and whose testing override stops at ``dropout_p``."""


_DOCUMENTED: dict[str, Callable[..., Any]] = {"scaled_dot_product_attention": _sdpa}


def _testing_overrides() -> dict[Any, Callable[..., Any]]:
    if not _OVERRIDES:
        _OVERRIDES.update(get_testing_overrides())
    return _OVERRIDES


_ACRONYMS = re.compile(r"(?<![A-Z])(SE|E|G|Si|PRe|Re)LU")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def functional_counterpart(module: nn.Module) -> str | None:
    """The ``torch.nn.functional`` name of what a module computes, when ``F`` has one: the
    name a forward that applies the functional form (with the module's own weights, if any)
    instead of calling the module is addressed by (``"parent::conv1d"``); ``None`` otherwise.

    ``ReLU`` -> ``"relu"``, ``LeakyReLU`` -> ``"leaky_relu"``, ``MaxPool2d`` -> ``"max_pool2d"``,
    ``LogSoftmax`` -> ``"log_softmax"``, ``SiLU`` and transformers' ``SiLUActivation`` ->
    ``"silu"``, ``Conv1d`` -> ``"conv1d"`` (Mamba's mixer calls ``F.conv1d`` with
    ``conv1d.weight``), ``Linear`` -> ``"linear"``, ``BatchNorm1d`` -> ``"batch_norm"``.
    """
    name = type(module).__name__.removesuffix("Activation")
    name = _CAMEL.sub("_", _ACRONYMS.sub(lambda m: m.group(1).capitalize() + "lu", name)).lower()
    for candidate in (name, _DIMENSION.sub("", name)):
        if candidate and callable(getattr(torch.nn.functional, candidate, None)):
            return candidate
    return None


_DIMENSION = re.compile(r"\d+d$")  # batch_norm1d -> batch_norm, instance_norm2d -> instance_norm


def functional_hint(parent: str, module: nn.Module) -> str:
    """Say which address reaches the value when ``parent`` applies ``module``'s functional form:
    ``"'encoder::gelu'"``; ``""`` when the module has no functional counterpart."""
    name = functional_counterpart(module)
    return f"'{parent}::{name}'" if name else ""


# ------------------------------------------------------------------------------- refusals
def refuse_uninterceptable(model: nn.Module, address: str) -> None:
    """Raise before running when calls inside ``model``'s forward cannot be seen one by one.
    (A ``torch.compile`` wrapper's can: dynamo traces the calls, and ``function_mode`` hands
    them out of the graph.)

    Raises:
        HookscopeError: ``model`` (or the module addressed) is a TorchScript module, whose code
            runs in the TorchScript interpreter, which never dispatches to a
            ``TorchFunctionMode``; or ``address`` names a tensor attribute (``x.T``,
            ``x.shape``) in a ``torch.compile`` wrapper: dynamo computes it while it traces,
            and no call of it is left in the graph (found by an attack: ``::T`` recorded
            nothing, and the report said the forward never made it).
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise HookscopeError(
            f"'{address}' addresses a function call inside forward, but this is a TorchScript "
            f"module ({type(model).__name__}): its code runs in the TorchScript interpreter, "
            f"which does not dispatch calls to Python, so they cannot be seen. Address the eager "
            f"module (before torch.jit.script/trace), or a module-level name without '::'")
    name = parse_op(split_address(address)[1] or "")[0] if "::" in address else ""
    if name and _compiled(model) and isinstance(inspect.getattr_static(torch.Tensor, name, None),
                                                  (property, types.GetSetDescriptorType)):
        raise HookscopeError(
            f"'{address}' addresses a tensor attribute (x.{name}) inside a torch.compile'd model: "
            f"dynamo computes attributes while it traces, and no call of them is left in the "
            f"compiled graph to hand out. Address the call that uses the value, or capture "
            f"'{address}' on the eager model (model._orig_mod)")


def _compiled(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (``OptimizedModule``)."""
    return hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule"


# ------------------------------------------------------------- custom autograd.Functions
_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]
#: code objects of ``nn.Module.__call__``: a module's forward is called from one of them
_MODULE_CALL = frozenset([nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__,
                          *(c for c in nn.Module._call_impl.__code__.co_consts
                            if isinstance(c, types.CodeType))])


def custom_function() -> type | None:
    """The custom ``torch.autograd.Function`` whose forward is making the torch call now being
    dispatched, or None: its ``apply`` frame stands between this call and the watched module's
    own forward (the frames are walked up to the nearest module call, a few frames). In eager
    mode ``Function.apply`` never reaches a ``TorchFunctionMode`` (pytorch/pytorch#196048): the
    mode sees the calls inside the Function's forward instead, as if the module made them.
    torch's own Functions (``torch.utils.checkpoint``'s) are not the user's: their calls are
    the module's."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code is _APPLY:
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type) and not cls.__module__.startswith("torch."):
                return cls
        elif code in _MODULE_CALL:
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def function_refusal(where: str, name: str) -> str:
    """Why ``path::Name`` of a custom ``torch.autograd.Function`` records nothing, and the fix."""
    return (f"{where} calls {name}, a custom torch.autograd.Function (case 71): a function-level "
            f"address sees torch calls, and {name}.apply is none (torch runs the Function's "
            f"forward itself, and the calls inside it are the Function's, not {where}'s own). "
            f"Wrap the call in a module (a submodule whose forward returns {name}.apply(...)) "
            f"and address that module, or address the call that uses its result (its args hold "
            f"the value)")
