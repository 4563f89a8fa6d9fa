"""Inventory of every hook on a model, whoever registered it, and removal of leaked ones.

Reading torch's private hook dictionaries is confined to ``_HOOK_DICTS`` and ``_GLOBAL_DICTS``;
``tests/test_hooks_inventory.py`` fails loudly if torch renames them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

from hookscope.select import unwrap

__all__ = ["HookInfo", "hooks", "remove_hooks"]

# kind -> attribute of nn.Module holding {handle id: hook}
_HOOK_DICTS = {
    "forward_pre": "_forward_pre_hooks",
    "forward": "_forward_hooks",
    "backward_pre": "_backward_pre_hooks",
    "backward": "_backward_hooks",
}
# Side tables keyed by the same handle ids, cleared together with their hook.
_SIDE_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_GLOBAL_DICTS = {
    "global_forward_pre": "_global_forward_pre_hooks",
    "global_forward": "_global_forward_hooks",
    "global_backward_pre": "_global_backward_pre_hooks",
    "global_backward": "_global_backward_hooks",
}


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
    """

    path: str
    kind: str
    function: str
    source: str
    handle_id: int


def hooks(model: nn.Module) -> list[HookInfo]:
    """List every forward, forward-pre and backward hook on ``model`` and its submodules, and the
    global module hooks, in ``named_modules()`` order, then globals."""
    found = [_info(path, kind, hid, fn)
             for path, module in _all_modules(model)
             for kind, attr in _HOOK_DICTS.items()
             for hid, fn in getattr(module, attr).items()]
    found += [_info("*", kind, hid, fn) for kind, attr in _GLOBAL_DICTS.items()
              for hid, fn in getattr(torch_module, attr).items()]
    return found


def remove_hooks(model: nn.Module, *, include_global: bool = False) -> int:
    """Remove every hook from ``model`` and its submodules (for leaked hooks in a notebook).

    Args:
        include_global: also clear global module hooks (they affect every model).

    Returns:
        The number of hooks removed.
    """
    removed = 0
    for _, module in _all_modules(model):
        for attr in _HOOK_DICTS.values():
            table = getattr(module, attr)
            removed += len(table)
            table.clear()
        for attr in _SIDE_DICTS:
            getattr(module, attr, {}).clear()
    if include_global:
        for attr in _GLOBAL_DICTS.values():
            table = getattr(torch_module, attr)
            removed += len(table)
            table.clear()
    return removed


def _all_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module including wrappers: wrapper levels keep their own (prefixed) names."""
    root, prefixes = unwrap(model)
    prefix = "".join(prefixes)
    outer = [(p, m) for p, m in model.named_modules() if not p.startswith(prefix) or not prefix]
    return outer if not prefix else outer + [(p, m) for p, m in root.named_modules() if p]


def _info(path: str, kind: str, handle_id: int, fn: Any) -> HookInfo:
    target = getattr(fn, "__func__", fn)
    name = getattr(target, "__qualname__", type(target).__name__)
    try:
        source = f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        source = "?"
    return HookInfo(path, kind, name, source, handle_id)
