"""Wrappers: modules that only hold another module and call it, at any depth of a model.

Frameworks insert them between a model and the names its code uses: ``DataParallel`` and
``DistributedDataParallel`` (attribute ``module``), ``torch.compile``'s ``OptimizedModule``
(``_orig_mod``), FSDP v1 (``_fsdp_wrapped_module``, around the root and every auto-wrapped
block), ``checkpoint_wrapper``/``offload_wrapper`` (``_checkpoint_wrapped_module``), fairscale's
``FlattenParamsWrapper`` (``_fpw_module``), DeepSpeed's engine (``module``). hookscope looks
through every one of them, so names are the model's own (``layers.0.fc``, not
``_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.fc``).

A module is a wrapper when its only child sits under a wrapper attribute (``module``,
``_orig_mod`` or ``_<anything>_module``, e.g. ``_fsdp_wrapped_module``) and either its class is
a known wrapper kind (by class name, so no framework is imported) or its ``forward`` returns
``self.<attribute>(...)``, read from the source without running it. A module that changes its
child's result (``return self.module(x) * 2``) is not a wrapper: its output is its own.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

from torch import nn

__all__ = ["wrapped_attribute", "unwrap"]

_ATTRIBUTE = re.compile(r"module|_orig_mod|_\w+_module")
# Class names of wrappers whose forward does more than return self.<attr>(...) (gathering,
# sharding, compiled frames) but whose result is the wrapped module's.
_KNOWN = frozenset({
    "DataParallel", "DistributedDataParallel", "OptimizedModule", "FullyShardedDataParallel",
    "CheckpointWrapper", "OffloadWrapper", "ActivationWrapper", "FlattenParamsWrapper",
    "DeepSpeedEngine", "ShardedDataParallel", "ApexDistributedDataParallel",
})


def wrapped_attribute(module: nn.Module) -> str | None:
    """The attribute under which ``module`` holds the module it wraps, or None if it is not a
    wrapper (see the module docstring for the rule)."""
    children = module._modules
    if len(children) != 1:
        return None
    attribute = next(iter(children))
    if children[attribute] is None or not _ATTRIBUTE.fullmatch(attribute):
        return None
    cls = type(module)
    if any(c.__name__ in _KNOWN for c in cls.__mro__) or _delegates(cls, attribute):
        return attribute
    return None


def unwrap(model: nn.Module) -> tuple[nn.Module, tuple[str, ...]]:
    """Strip the wrappers around the root of ``model``.

    Returns:
        The innermost model and the wrapper prefixes removed, outermost first
        (e.g. ``("module.",)`` for ``DataParallel``; ``()`` for a model that is not wrapped).
    """
    prefixes: list[str] = []
    while (attribute := wrapped_attribute(model)) is not None:
        prefixes.append(attribute + ".")
        model = model._modules[attribute]  # type: ignore[assignment]
    return model, tuple(prefixes)


_DELEGATES: dict[tuple[type[nn.Module], str], bool] = {}  # classes do not change: read once


def _delegates(cls: type[nn.Module], attribute: str) -> bool:
    """True when ``cls.forward`` returns ``self.<attribute>(...)`` (or ``.forward(...)``)."""
    if (cls, attribute) not in _DELEGATES:
        _DELEGATES[cls, attribute] = _returns_call_of(getattr(cls, "forward", None), attribute)
    return _DELEGATES[cls, attribute]


def _returns_call_of(forward: object, attribute: str) -> bool:
    if forward is None or forward is nn.Module.forward:
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(node, ast.Return) and _calls_attribute(node.value, attribute)
               for node in ast.walk(tree))


def _calls_attribute(value: ast.expr | None, attribute: str) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Attribute) and func.attr == "forward":
        func = func.value
    return (isinstance(func, ast.Attribute) and func.attr == attribute
            and isinstance(func.value, ast.Name) and func.value.id == "self")
