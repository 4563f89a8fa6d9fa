"""Wrappers: modules that only hold another module and call it, at any depth of a model.

Frameworks insert them between a model and the names its code uses: ``DataParallel`` and
``DistributedDataParallel`` (attribute ``module``), ``torch.compile``'s ``OptimizedModule``
(``_orig_mod``), FSDP v1 (``_fsdp_wrapped_module``, around the root and every auto-wrapped
block), ``checkpoint_wrapper``/``offload_wrapper`` (``_checkpoint_wrapped_module``), fairscale's
``FlattenParamsWrapper`` (``_fpw_module``), DeepSpeed's engine (``module``). hookscope looks
through every one of them, so names are the model's own (``layers.0.fc``, not
``_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.fc``). Adapter libraries wrap the same
way: peft's ``PeftModel`` holds its tuner as ``base_model`` and the tuner (``LoraModel``) holds the
user's model as ``model``, so ``base_model.model.layers.0.q_proj`` is ``layers.0.q_proj``.

A module is a wrapper when it has one child and its ``forward`` returns
``self.<attribute>(...)`` (it delegates: Opacus' ``GradSampleModule`` returns
``self._module(*args, **kwargs)``), or returns ``self.<getter>()(...)`` where the getter
(peft's ``get_base_model``) gives back the child or a module the child wraps; the source is read
without running the forward; and either the child's attribute is a conventional wrapper name
(``module``, ``model``, ``base_model``, ``_orig_mod`` or ``_<anything>_module``, e.g.
``_fsdp_wrapped_module``) or the class comes from an installed library (``engine.origin``: a
user's own ``self.body(x)`` keeps its names). Wrappers whose forward does more (gathering,
sharding, compiled frames) are known by class name under a conventional attribute. A module
that changes its child's result (``return self.module(x) * 2``) is not a wrapper: its output is its own.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

from torch import nn

from hookscope.engine.checks import check_model
from hookscope.engine.origin import library_of

__all__ = ["wrapped_attribute", "unwrap"]

_ATTRIBUTE = re.compile(r"module|model|base_model|_orig_mod|_\w+_module")
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
    attribute, child = next(iter(children.items()))
    if child is None:
        return None
    cls = type(module)
    conventional = _ATTRIBUTE.fullmatch(attribute) is not None
    if not conventional and library_of(cls.__module__) is None:
        return None  # the user's own class delegating to 'self.body': its names are the user's
    if (conventional and any(c.__name__ in _KNOWN for c in cls.__mro__)) or _delegates(cls, attribute) \
            or _getter_returns_wrapped(module, child):
        return attribute
    return None


def unwrap(model: nn.Module) -> tuple[nn.Module, tuple[str, ...]]:
    """Strip the wrappers around the root of ``model``.

    Returns:
        The innermost model and the wrapper prefixes removed, outermost first
        (e.g. ``("module.",)`` for ``DataParallel``; ``()`` for a model that is not wrapped).
    """
    check_model(model)  # every verb reaches its model through here first
    prefixes: list[str] = []
    while (attribute := wrapped_attribute(model)) is not None:
        prefixes.append(attribute + ".")
        model = model._modules[attribute]  # type: ignore[assignment]
    return model, tuple(prefixes)


_DELEGATES: dict[tuple[type[nn.Module], str], bool] = {}  # classes do not change: read once
_GETTERS: dict[type[nn.Module], str | None] = {}


def _getter_returns_wrapped(module: nn.Module, child: nn.Module) -> bool:
    """True when ``module.forward`` returns ``self.<getter>()(...)`` and the getter gives back
    ``child`` or a module that ``child`` wraps (peft's ``PeftModel.get_base_model()``)."""
    cls = type(module)
    if cls not in _GETTERS:
        _GETTERS[cls] = _called_getter(getattr(cls, "forward", None))
    getter = _GETTERS[cls]
    if getter is None:
        return False
    try:
        inner = getattr(module, getter)()
    except Exception:  # a getter that needs state the module lacks: not a plain wrapper
        return False
    while inner is not child and (attribute := wrapped_attribute(child)) is not None:
        child = child._modules[attribute]  # type: ignore[assignment]
    return inner is child


def _delegates(cls: type[nn.Module], attribute: str) -> bool:
    """True when ``cls.forward`` returns ``self.<attribute>(...)`` (or ``.forward(...)``)."""
    if (cls, attribute) not in _DELEGATES:
        _DELEGATES[cls, attribute] = _returns_call_of(getattr(cls, "forward", None), attribute)
    return _DELEGATES[cls, attribute]


def _returns_call_of(forward: object, attribute: str) -> bool:
    return any(_calls_attribute(value, attribute) for value in _returned(forward))


def _called_getter(forward: object) -> str | None:
    """``name`` when ``forward`` returns ``self.<name>()(...)``, else None."""
    for value in _returned(forward):
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Call)
                and not value.func.args and not value.func.keywords
                and _is_self_attribute(value.func.func)):
            return value.func.func.attr  # type: ignore[attr-defined,no-any-return]
    return None


def _returned(forward: object) -> list[ast.expr | None]:
    """The expressions that ``forward``'s return statements return, read from its source."""
    if forward is None or forward is nn.Module.forward:
        return []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return []
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Return)]


def _is_self_attribute(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _calls_attribute(value: ast.expr | None, attribute: str) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Attribute) and func.attr == "forward":
        func = func.value
    return _is_self_attribute(func) and func.attr == attribute  # type: ignore[attr-defined]
