"""Resolve names and patterns to submodules: ``"pos_block.*.proj.0"`` -> ``{path: module}``.

A **path** is a qualified name exactly as ``named_modules()`` yields it (``"layers.3.mlp"``);
a **pattern** is what a user types, resolved here without registering anything:

- an exact path, or a ``state_dict()`` key, resolved to the module that owns it
  (``"conv2.weight"`` -> ``"conv2"``);
- a glob over dot-separated segments: ``*`` matches one segment (and wildcards
  inside a segment, ``*relu*``, ``?``), ``**`` any number of segments (``"**"`` alone: every module);
- ``re:REGEX``, matched against the whole path; ``type:Conv2d`` (``isinstance``, by class name
  or qualified class name, subclasses included);
- any of these may end with parts of a structured output in brackets: ``"lstm[0]"``,
  ``"lstm[1][0]"``, ``"bert[last_hidden_state]"``. A trailing ``[k]`` that names a child module
  (``"features[0]"`` of a ``Sequential``) selects that child instead.

Wrappers are transparent: for ``DataParallel``/``DistributedDataParallel`` (``module.``) and
``torch.compile`` (``_orig_mod.``), paths are those of the wrapped model, and patterns may be
given with or without the prefix. The root module itself is never matched by a pattern.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

from hookscope.errors import SelectorError

__all__ = ["Target", "select", "resolve", "unwrap", "is_container"]

_WRAPPER_ATTRS = ("module", "_orig_mod")  # DataParallel/DDP, torch.compile's OptimizedModule
_PART = re.compile(r"\[([^\[\]]+)\]$")


@dataclass(frozen=True)
class Target:
    """One selected module, and which part of its output a pattern asked for.

    Attributes:
        path: qualified name in the unwrapped model, e.g. ``"pos_block.3.proj.0"``.
        module: the submodule itself.
        parts: keys into a structured output, e.g. ``(1, 0)`` for ``"lstm[1][0]"``; empty for all.
        key: the record name, the path followed by its parts: ``"lstm[1][0]"``.
    """

    path: str
    module: nn.Module
    parts: tuple[int | str, ...] = ()

    key: str = field(init=False, repr=False)  # record name: path and parts, "lstm[1][0]"

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", self.path + "".join(f"[{p}]" for p in self.parts))


def unwrap(model: nn.Module) -> tuple[nn.Module, tuple[str, ...]]:
    """Strip ``DataParallel``/``DDP`` and ``torch.compile`` wrappers.

    Returns:
        The innermost model and the wrapper prefixes removed, outermost first
        (e.g. ``("module.",)``).
    """
    prefixes: list[str] = []
    while True:
        inner = _wrapped(model)
        if inner is None:
            return model, tuple(prefixes)
        attr, model = inner
        prefixes.append(attr + ".")


def is_container(module: nn.Module) -> bool:
    """True for a module with no ``forward`` of its own (``ModuleList``, ``ModuleDict``):
    nothing ever calls it, so a hook on it can never fire."""
    # getattr with a default: a RecursiveScriptModule's class-level forward raises on access
    return getattr(type(module), "forward", None) is nn.Module.forward


def select(model: nn.Module, *patterns: str) -> dict[str, nn.Module]:
    """Return the submodules that ``patterns`` name, keyed by path, in ``named_modules()`` order.

    Args:
        model: root module (wrappers are looked through, see the module docstring).
        *patterns: exact paths, ``state_dict()`` keys, globs, ``re:``, ``type:`` patterns.
            Output parts in brackets are accepted and ignored here.

    Returns:
        ``{path: module}`` without duplicates.

    Raises:
        SelectorError: a pattern matches nothing (the message lists the closest real paths), or
            names a container such as ``ModuleList`` exactly (the message gives the pattern of
            its children and how many modules that matches).
    """
    return {t.path: t.module for t in resolve(model, patterns)}


def resolve(model: nn.Module, patterns: tuple[str, ...] | list[str]) -> list[Target]:
    """Resolve ``patterns`` to ``Target`` s: modules in ``named_modules()`` order, one per
    distinct (path, parts). Raises ``SelectorError`` as ``select`` does."""
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise SelectorError("no pattern given: name at least one module, e.g. 'conv2', "
                            "'blocks.*', 'type:Linear' or '**' for every module")
    root, prefixes = unwrap(model)
    modules = {path: m for path, m in root.named_modules() if path}
    order = {path: i for i, path in enumerate(modules)}
    chosen: dict[tuple[str, tuple[int | str, ...]], Target] = {}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise SelectorError(f"patterns are strings; got {type(pattern).__name__} {pattern!r}")
        for target in _resolve_one(root, modules, _strip_prefixes(pattern, prefixes)):
            chosen.setdefault((target.path, target.parts), target)
    return sorted(chosen.values(), key=lambda t: order[t.path])


def _wrapped(model: nn.Module) -> tuple[str, nn.Module] | None:
    for attr in _WRAPPER_ATTRS:
        # ScriptModule's _modules has no .get(): index it
        inner = (model._modules[attr] if attr in model._modules else None) if attr == "module" \
            else getattr(model, attr, None)
        if isinstance(inner, nn.Module) and _is_wrapper(model, attr):
            return attr, inner
    return None


def _is_wrapper(model: nn.Module, attr: str) -> bool:
    if attr == "_orig_mod":
        return True
    # DataParallel, DistributedDataParallel and look-alikes: a single child named 'module'.
    return type(model).__name__ in ("DataParallel", "DistributedDataParallel") or (
        list(model._modules) == ["module"] and type(model).__name__.endswith(("Parallel", "Wrapper")))


def _strip_prefixes(pattern: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if pattern.startswith(prefix):
            pattern = pattern[len(prefix):]
    return pattern


def _split_parts(pattern: str) -> tuple[str, tuple[int | str, ...]]:
    parts: list[int | str] = []
    while (m := _PART.search(pattern)) and not pattern.startswith("re:"):
        raw = m.group(1).strip().strip("'\"")
        parts.insert(0, int(raw) if re.fullmatch(r"-?\d+", raw) else raw)
        pattern = pattern[: m.start()]
    return pattern, tuple(parts)


def _resolve_one(root: nn.Module, modules: dict[str, nn.Module], pattern: str) -> list[Target]:
    base, parts = _split_parts(pattern)
    # 'features[0]' of a Sequential means the child 'features.0', not part 0 of the output.
    while parts and isinstance(parts[0], int) and f"{base}.{parts[0]}" in modules:
        base, parts = f"{base}.{parts[0]}", parts[1:]
    if base.startswith("re:"):
        paths = _match_regex(base[3:], modules)
    elif base.startswith("type:"):
        paths = _match_type(base[5:], modules)
    elif "*" in base or "?" in base:
        paths = _match_glob(base, modules)
    else:
        path = _exact(root, modules, base)
        return [Target(path, modules[path], parts)]
    hookable = [p for p in paths if not is_container(modules[p])]
    if not hookable:
        raise SelectorError(_no_match_message(pattern, modules, paths))
    return [Target(p, modules[p], parts) for p in hookable]


def _exact(root: nn.Module, modules: dict[str, nn.Module], name: str) -> str:
    if name in modules:
        path = name
    else:
        owner = _state_dict_owner(root, name)
        if owner is None:
            raise SelectorError(_unknown_message(root, modules, name))
        path = owner
    if is_container(modules[path]):
        raise SelectorError(_container_message(path, modules))
    return path


def _state_dict_owner(root: nn.Module, key: str) -> str | None:
    owner, _, leaf = key.rpartition(".")
    try:
        module = root.get_submodule(owner)
    except AttributeError:
        return None
    if leaf in module._parameters or leaf in module._buffers:
        return owner if owner else None
    return None


def _match_regex(expr: str, modules: dict[str, nn.Module]) -> list[str]:
    try:
        compiled = re.compile(expr)
    except re.error as err:
        raise SelectorError(f"'re:{expr}' is not a valid regular expression ({err}); "
                            f"escape dots as '\\.' and anchor nothing: it must match the whole path") from err
    return [p for p in modules if compiled.fullmatch(p)]


def _match_type(name: str, modules: dict[str, nn.Module]) -> list[str]:
    def matches(m: nn.Module) -> bool:
        return any(name in (c.__name__, f"{c.__module__}.{c.__qualname__}") for c in type(m).__mro__)
    return [p for p, m in modules.items() if matches(m)]


def _match_glob(pattern: str, modules: dict[str, nn.Module]) -> list[str]:
    compiled = re.compile(_glob_to_regex(pattern))
    return [p for p in modules if compiled.fullmatch(p)]


def _glob_to_regex(pattern: str) -> str:
    regex = ""
    for i, segment in enumerate(pattern.split(".")):
        if segment == "**":  # zero or more whole segments, with their dots
            regex += r"(?:[^.]+(?:\.[^.]+)*)?" if i == 0 else r"(?:\.[^.]+)*"
            continue
        if i and not regex.endswith(")?"):
            regex += r"\."
        elif i:  # after a leading '**' that matched nothing there is no dot to eat
            regex = regex[:-2] + r"\.)?"
        regex += "".join(_glob_char(ch) for ch in segment)
    return regex


def _glob_char(ch: str) -> str:
    return {"*": "[^.]*", "?": "[^.]"}.get(ch, re.escape(ch))


def _children_pattern(path: str, modules: dict[str, nn.Module]) -> tuple[str, list[str]]:
    prefix = path + "."
    children = [p for p in modules if p.startswith(prefix) and "." not in p[len(prefix):]]
    return f"{path}.*", children


def _container_message(path: str, modules: dict[str, nn.Module]) -> str:
    module = modules[path]
    kind = f"{type(module).__module__}.{type(module).__qualname__}"
    pattern, children = _children_pattern(path, modules)
    classes = sorted({type(modules[c]).__name__ for c in children})
    if children:
        span = children[0] if len(children) == 1 else f"{children[0]} … {children[-1]}"
        fix = (f"To hook its children instead, select '{pattern}' (matches {len(children)} "
               f"module{'s' if len(children) != 1 else ''}: {span}, {', '.join(classes)}).")
    else:
        fix = "It has no children either: select a module that the model calls."
    return (f"'{path}' is a {kind}, a container with no forward(): the model calls its children, "
            f"never the container, so a hook on it would never fire.\n\n  {fix}")


def _unknown_message(root: nn.Module, modules: dict[str, nn.Module], name: str) -> str:
    keys = [p for p, m in modules.items() if not is_container(m)]
    keys += [k for k, _ in root.named_parameters()] + [k for k, _ in root.named_buffers()]
    close = difflib.get_close_matches(name, keys, n=5, cutoff=0.5)
    if "." in name and not close:  # 'model.layers.0' copied from code: drop the variable name
        close = difflib.get_close_matches(name.split(".", 1)[1], keys, n=5, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else (
        f"the model's top-level modules are {', '.join(repr(p) for p in modules if '.' not in p)[:400]}")
    return (f"no module or state_dict key named '{name}': {hint} "
            f"(names are as model.named_modules() gives them; 'hookscope tree MODEL' lists them all)"
            f"{_graph_module_hint(root)}")


def _graph_module_hint(root: nn.Module) -> str:
    """For a ``torch.fx.GraphModule``: modules the tracer inlined are gone (pytorch/pytorch#105445)."""
    if not isinstance(root, torch.fx.GraphModule):
        return ""
    called = [str(n.target) for n in root.graph.nodes if n.op == "call_module"]
    return (f". The model is a torch.fx.GraphModule: a module that symbolic tracing inlined is not "
            f"present in the traced graph. call_module targets are: {called}; hook one of those, "
            f"or capture the eager model before tracing")


def _no_match_message(pattern: str, modules: dict[str, nn.Module], matched: list[str]) -> str:
    if matched:  # only containers matched
        return (f"pattern '{pattern}' matched only containers with no forward ({', '.join(matched[:5])}), "
                f"whose hooks can never fire: select their children, e.g. '{matched[0]}.*'")
    if pattern.startswith("type:"):
        classes = sorted({type(m).__name__ for m in modules.values()})
        close = difflib.get_close_matches(pattern[5:], classes, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr('type:' + c) for c in close)}? " if close else ""
        return (f"pattern '{pattern}' matched no module: {hint}the classes in this model are "
                f"{', '.join(classes)[:600]}")
    literal = re.sub(r"[*?\[\]]", "", pattern.split(":", 1)[-1]).strip(".")
    hookable = [p for p, m in modules.items() if not is_container(m)]
    close = difflib.get_close_matches(literal, hookable, n=5, cutoff=0.4)
    hint = f"; closest paths: {', '.join(repr(c) for c in close)}" if close else ""
    deeper = f" ('**.{pattern}' searches every depth)" if "." not in pattern and ":" not in pattern else ""
    return (f"pattern '{pattern}' matched no module{hint}. Globs: '*' is one dotted segment, "
            f"'**' any number of them{deeper}; 'hookscope tree MODEL' lists every path")

def as_patterns(layers: str | Sequence[str]) -> list[str]:
    """One pattern or a list of patterns -> a list of patterns: ``"fc1"`` -> ``["fc1"]``.

    Every public function that takes "a pattern or a list of patterns" (``layers=``) reads it
    through this; a lone string is never split into its characters."""
    return [layers] if isinstance(layers, str) else list(layers)
