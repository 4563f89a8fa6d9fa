"""Every name a user can see for a module, mapped to one canonical path.

``named_modules()`` gives each module one name and includes wrapper levels. People use more
names than that: the wrapped model's own paths (``layers.0.fc`` under FSDP or DDP), the raw paths
with wrapper segments, the other attribute paths of a module registered twice (T5/BART share one
``nn.Embedding`` as ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens``; only the
first is in ``named_modules()``), and names inside parametrizations
(``layer.parametrizations.weight.original0``). ``index(model)`` walks the module graph once and
maps all of them:

- **path** (canonical): the module's first name in ``named_modules()`` order, with every wrapper
  segment removed (see ``hookscope.wrappers``); ``""`` is the root. Records are keyed by it.
- **aliases**: the other paths of the same module object, wrapper segments removed.
- parametrization modules (``layer.parametrizations.weight`` and below) compute a weight when it
  is read; they are not activations, so they are not selectable modules: their names and keys
  map to the layer that owns them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.utils import parametrize

from hookscope.engine.wrappers import unwrap, wrapped_attribute

__all__ = ["ModuleIndex", "index", "one_index", "one_index_per_call"]


@dataclass
class ModuleIndex:
    """The names of one model's modules.

    Attributes:
        root: the innermost module under the root's wrappers.
        modules: ``{path: module}`` for every module once, ``named_modules()`` order, root ``""``
            first; wrappers and parametrization modules are left out.
        canonical: ``{any name: path}``: paths, aliases and raw paths with wrapper segments.
        aliases: ``{path: (other names,)}`` for modules registered under several names.
        parametrizations: ``{name of a parametrization module: path of the layer it belongs to}``.
        wrappers: ``{raw path of a wrapper: its class name}``.
        visible: the names without wrapper segments (paths and aliases): the names the
            unwrapped model has; ``canonical`` also holds the raw names with wrapper segments.
    """

    root: nn.Module
    modules: dict[str, nn.Module] = field(default_factory=dict)
    canonical: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    parametrizations: dict[str, str] = field(default_factory=dict)
    wrappers: dict[str, str] = field(default_factory=dict)
    visible: frozenset[str] = frozenset()

    def path_of(self, name: str) -> str | None:
        """The canonical path a module name (any spelling) stands for, or None."""
        return self.canonical.get(name)

    def owner_of_key(self, key: str) -> str | None:
        """The path of the module that holds the ``state_dict()`` / parameter key ``key``
        (``"conv2.weight"`` -> ``"conv2"``; ``"layer.parametrizations.weight.original0"`` and
        ``"layer.weight_g"`` -> ``"layer"``), or None when no module holds it."""
        owner, _, leaf = key.rpartition(".")
        if not leaf:
            return None
        if owner in self.parametrizations:
            return self.parametrizations[owner]
        path = self.canonical.get(owner)
        if path is None or not _holds(self.modules[path], leaf):
            return None
        return path


T = TypeVar("T")
_held = threading.local()  # .index: the ModuleIndex of this thread's open ``one_index`` block


def index(model: nn.Module) -> ModuleIndex:
    """Every name of every module of ``model`` (see the module docstring): inside a
    ``one_index(model)`` block of this thread, the index built when it opened; else a new walk."""
    held: ModuleIndex | None = getattr(_held, "index", None)
    if held is not None and held.root is unwrap(model)[0]:
        return held
    return _walk(model)


@contextmanager
def one_index(model: nn.Module) -> Iterator[ModuleIndex]:
    """Build ``model``'s index once for a verb that opens several sessions (a sweep's layers and
    chunks, Grad-CAM's passes, extract's batches): every ``index(model)`` of this thread inside
    the block returns it. The verb holds the model for the block's length, so its structure does
    not change; another thread's blocks walk their own."""
    previous = getattr(_held, "index", None)
    _held.index = _walk(model)
    try:
        yield _held.index
    finally:
        _held.index = previous


def one_index_per_call(verb: Callable[..., T]) -> Callable[..., T]:
    """Decorate a verb whose first argument is the model: its whole call runs in
    ``one_index(model)`` (a value that is not a module is left to the verb's own check)."""
    @functools.wraps(verb)
    def call(model: Any, *args: Any, **kwargs: Any) -> T:
        if not isinstance(model, nn.Module):
            return verb(model, *args, **kwargs)
        with one_index(model):
            return verb(model, *args, **kwargs)
    return call


def _walk(model: nn.Module) -> ModuleIndex:
    """Walk ``model`` once and return every name of every module (see the module docstring).

    Every attribute path of every module is visited (shared modules once per path), depth first
    in ``named_modules()`` order. Modules inside a parametrization get the path of the layer that
    owns them; a module that holds one of its ancestors (a cycle) is skipped."""
    found = ModuleIndex(unwrap(model)[0])
    modules, canonical, aliases = found.modules, found.canonical, found.aliases
    first: dict[int, str] = {}
    wrapper_paths: dict[str, str] = {}
    raw_paths: dict[str, str] = {}  # raw name -> primary path, added after every visible name
    on_path: set[int] = set()

    def visit(raw: str, path: str, module: nn.Module, owner: str | None) -> None:
        children = module._modules
        inner = wrapped_attribute(module) if len(children) == 1 else None
        if owner is not None:  # the owner came first: its primary path is known
            found.parametrizations[raw] = found.parametrizations[path] = canonical[owner]
        elif inner is not None:
            found.wrappers[raw] = type(module).__name__
            wrapper_paths[raw] = path
        else:
            primary = first.setdefault(id(module), path)
            canonical.setdefault(path, primary)
            raw_paths.setdefault(raw, primary)
            if primary == path:
                modules[path] = module
            elif path not in aliases.get(primary, ()):
                aliases[primary] = (*aliases.get(primary, ()), path)
        if not children:
            return
        on_path.add(id(module))
        parametrized = (owner is None and "parametrizations" in children
                        and parametrize.is_parametrized(module))
        for name, child in children.items():
            if child is None or id(child) in on_path:
                continue
            child_path = path if name == inner else (f"{path}.{name}" if path else name)
            child_owner = owner if owner is not None else (
                path if name == "parametrizations" and parametrized else None)
            visit(f"{raw}.{name}" if raw else name, child_path, child, child_owner)
        on_path.discard(id(module))

    visit("", "", model, None)
    # a visible name wins over a raw one spelled the same (the model's own child 'module' under
    # DDP's 'module'), so an exact name means on the wrapped model what it means unwrapped
    found.visible = frozenset(canonical)
    for raw, primary in raw_paths.items():
        canonical.setdefault(raw, primary)
    for raw, path in wrapper_paths.items():  # a wrapper's raw path names what it wraps
        canonical.setdefault(raw, canonical.get(path, path))
    return found


def _holds(module: nn.Module, leaf: str) -> bool:
    """True when ``leaf`` is a tensor that ``module`` itself holds: a parameter, a buffer, a
    parametrized weight, or a tensor attribute (``weight_norm``'s computed ``weight``, FSDP's
    views of flattened parameters). Nothing is computed."""
    if leaf in module._parameters or leaf in module._buffers:
        return True
    if parametrize.is_parametrized(module, leaf):
        return True
    return isinstance(module.__dict__.get(leaf), torch.Tensor)
