"""Inventory of every hook on a model, whoever registered it, and removal of leaked ones.

Some hooks are part of how a model computes, and removing them silently changes its results:
``weight_norm``/``spectral_norm`` recompute the weight in a forward pre-hook, lazy modules
(``LazyLinear``) create their parameters in one, and DDP/FSDP, quantization observers,
accelerate, peft, transformers and Opacus (its per-sample gradient hooks are the DP mechanism)
register their own: any hook whose function an installed library defines (``engine.origin``).
``hooks(model)`` says who registered each hook (the package its function comes from) and marks
those as **internal**; ``remove_hooks`` leaves internal hooks in place unless
``include_internal=True`` (see pytorch#70455, #2847 for the 'clear every hook dictionary' recipe
that breaks them).

Torch's private hook tables are read and written only by the engine's door
(``engine.door.tables.registered`` and ``unregister``).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from hookscope.engine import (
    KNOWN_LIBRARIES,
    check_flag,
    check_model,
    index,
    library_of,
    owner,
    registered,
    unregister,
)

__all__ = ["HookInfo", "hooks", "remove_hooks", "INTERNAL_PACKAGES"]

# Packages whose hooks implement model behaviour, wherever they are installed; any other
# installed library's hooks are internal too (``engine.origin.library_of``).
INTERNAL_PACKAGES = KNOWN_LIBRARIES

@dataclass(frozen=True)
class HookInfo:
    """One registered hook.

    Attributes:
        path: qualified name of the module it is on (``""`` root; ``"*"`` for global hooks,
            which apply to every module of every model).
        kind: ``forward_pre``, ``forward``, ``backward_pre``, ``backward`` or ``global_*``.
        function: the hook's qualified name, e.g. ``"Capture._make_hook.<locals>.hook"``.
        source: ``"file.py:LINE"`` where it is defined, or ``"?"`` for builtins.
        handle_id: the id torch keys it by (what ``RemovableHandle.id`` holds).
        registered_by: the top-level package the hook's function comes from (``"torch"`` for
            ``WeightNorm`` or a lazy module's ``_infer_parameters``, ``"peft"``, ``"hookscope"``),
            or ``"user code (MODULE)"`` for anything else (a notebook's ``__main__``).
        internal: True when ``registered_by`` is a library (``engine.origin``): the hook is part of
            how the model computes, and ``remove_hooks`` keeps it unless asked.
    """

    path: str
    kind: str
    function: str
    source: str
    handle_id: int
    registered_by: str = "?"
    internal: bool = False


def hooks(model: nn.Module) -> list[HookInfo]:
    """List every forward, forward-pre and backward hook on ``model`` and its submodules, and the
    global module hooks, in ``named_modules()`` order, then globals; each says who registered it
    and whether it is internal (module docstring)."""
    found = [_info(path, kind, hid, fn) for path, module in _all_modules(model)
             for kind, hid, fn in registered(module)]
    found += [_info("*", kind, hid, fn) for kind, hid, fn in registered(None)]
    return found


def remove_hooks(model: nn.Module, *, include_global: bool = False,
                 include_internal: bool = False) -> int:
    """Remove leaked hooks from ``model`` and its submodules (hooks whose handles are lost).

    Args:
        include_global: also remove global module hooks (they affect every model).
        include_internal: also remove internal hooks (``WeightNorm``, lazy initialisation,
            DDP/FSDP, observers, accelerate/peft...). Without it they stay, so a weight-normed
            layer keeps following ``weight_g`` and a lazy layer still initialises on first call.

    Returns:
        The number of hooks removed.

    Raises:
        ArgumentTypeError: ``model`` is not a module, a flag is not a bool.
    """
    check_model(model)
    check_flag("include_global", include_global)
    check_flag("include_internal", include_internal)
    owners: list[nn.Module | None] = [module for _, module in _all_modules(model)]
    found = [(module, kind, hid, fn) for module in owners + ([None] if include_global else [])
             for kind, hid, fn in registered(module)]
    removed = 0
    for module, kind, hid, fn in found:
        if include_internal or not _is_internal(_registered_by(fn)):
            unregister(module, kind, hid)
            removed += 1
    return removed


def _all_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, wrappers and parametrizations included: a module's path, or for a
    wrapper or a parametrization module its raw ``named_modules()`` name."""
    names = index(model)
    return [(raw if raw in names.wrappers or raw in names.parametrizations
             else names.canonical.get(raw, raw), module) for raw, module in model.named_modules()]


def _info(path: str, kind: str, handle_id: int, fn: Any) -> HookInfo:
    target = _function(fn)
    name = getattr(target, "__qualname__", type(target).__name__)
    try:
        source = f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        source = "?"
    owner = _registered_by(fn)
    return HookInfo(path, kind, name, source, handle_id, owner, _is_internal(owner))


def _function(fn: Any) -> Any:
    """The code behind a hook: through ``functools.partial``, hookscope's ``OwnedHook`` and
    bound methods."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif (owned := owner(fn)) is not None:  # in a table: an OwnedHook's bound __call__
            fn = owned.function
        else:
            break
    return getattr(fn, "__func__", fn)


def _registered_by(fn: Any) -> str:
    target = _function(fn)
    module = getattr(target, "__module__", None)
    if not isinstance(module, str) or (not inspect.isfunction(target) and not inspect.isclass(target)):
        module = type(target).__module__  # a callable object (WeightNorm): its class decides
    package = module.partition(".")[0]
    if package == "hookscope":
        return package
    library = library_of(module)
    return f"user code ({module})" if library is None else library


def _is_internal(owner: str) -> bool:
    """True for a hook a library registered (it is part of how the model works: Opacus'
    per-sample gradients, WeightNorm); hookscope's and the user's own are not."""
    return owner != "hookscope" and not owner.startswith("user code")
