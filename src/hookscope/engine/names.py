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

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from hookscope.engine.wrappers import unwrap, wrapped_attribute

__all__ = ["ModuleIndex", "index"]


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
    """

    root: nn.Module
    modules: dict[str, nn.Module] = field(default_factory=dict)
    canonical: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    parametrizations: dict[str, str] = field(default_factory=dict)
    wrappers: dict[str, str] = field(default_factory=dict)

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


def index(model: nn.Module) -> ModuleIndex:
    """Walk ``model`` once and return every name of every module (see the module docstring).

    Every attribute path of every module is visited (shared modules once per path), depth first
    in ``named_modules()`` order. Modules inside a parametrization get the path of the layer that
    owns them; a module that holds one of its ancestors (a cycle) is skipped."""
    found = ModuleIndex(unwrap(model)[0])
    modules, canonical, aliases = found.modules, found.canonical, found.aliases
    first: dict[int, str] = {}
    wrapper_paths: dict[str, str] = {}
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
            canonical.setdefault(raw, primary)
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
