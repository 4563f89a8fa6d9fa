"""Resolve names and patterns to submodules: ``"pos_block.*.proj.0"`` -> ``{path: module}``.

A **path** is a module's canonical name (``hookscope.names``): its qualified name as
``named_modules()`` gives it, without wrapper segments (``"layers.3.mlp"``). A **pattern** is
what a user types, resolved here without registering anything:

- an exact path, any other name of the same module (a second attribute path of a shared module,
  a path with wrapper segments), or a ``state_dict()`` / parameter key, resolved to the module
  that owns it (``"conv2.weight"`` -> ``"conv2"``, ``"layer.weight_g"`` and
  ``"layer.parametrizations.weight.original0"`` -> ``"layer"``);
- Python's own spelling, as copied from code: ``"pos_block[3].proj[0]"`` is
  ``"pos_block.3.proj.0"``, ``"blocks['attn']"`` is ``"blocks.attn"``;
- a glob over dot-separated segments: ``*`` matches one segment (and wildcards
  inside a segment, ``*relu*``, ``?``), ``**`` any number of segments (``"**"`` alone: every
  submodule, never the root);
- ``re:REGEX``, matched against the whole path; ``type:Conv2d`` (``isinstance``, by class name
  or qualified class name, subclasses included);
- ``"(root)"`` or ``""``: the model itself (patterns never match the root otherwise);
- any of these may end with parts of a structured output in brackets: ``"lstm[0]"``,
  ``"lstm[1][0]"``, ``"bert[last_hidden_state]"``. A trailing ``[k]`` that names a child module
  (``"features[0]"`` of a ``Sequential``) selects that child instead.

A **function-level address** ``PATTERN::NAME`` selects the calls of function ``NAME`` made by
the own forward of each module ``PATTERN`` selects (not by its children): ``"::relu"`` (the root
model's ``F.relu`` calls), ``"h.*.attn::softmax"``; ``NAME#N`` keeps only call ``N`` of each
forward (``"::relu#1"``); output parts follow the name (``"attn::unbind[0]"``). See
``engine.function_mode`` for how the calls are seen.


Wrappers are transparent at any depth (``hookscope.wrappers``: DataParallel/DDP ``module.``,
``torch.compile`` ``_orig_mod.``, FSDP ``_fsdp_wrapped_module.``, checkpoint wrappers and
look-alikes): globs, regexes and exact names match with or without their segments.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from hookscope.engine.checks import brief, check_iterable, check_nonempty
from hookscope.engine.function_names import split_address
from hookscope.engine.names import ModuleIndex, index
from hookscope.engine.record_key import ROOT, RecordKey, record_name
from hookscope.engine.standard_naming import (
    Resolved,
    from_transformer_lens,
    is_standard,
    known_standard_names,
    resolve_standard,
)
from hookscope.engine.wrappers import unwrap
from hookscope.errors import SelectorError

__all__ = ["flat_patterns", "Target", "select", "resolve", "unwrap", "is_container", "ROOT", "as_patterns",
           "asked_names"]

_PART = re.compile(r"\[([^\[\]]+)\]$")
_INNER_INDEX = re.compile(r"\[\s*(['\"]?)([^\[\]'\"]+)\1\s*\](?=[.\[]|$)")


class Target:
    """One selected module, and which part of its output a pattern asked for.

    Attributes:
        path: canonical path, e.g. ``"pos_block.3.proj.0"``; ``""`` for the root.
        module: the submodule itself.
        parts: keys into a structured output, e.g. ``(1, 0)`` for ``"lstm[1][0]"``; empty for all.
        aliases: the module's other names (a module registered under several attribute paths).
        op: a function called by the module's own forward, ``"relu"`` (every call) or
            ``"relu#1"`` (its call 1 in each forward); ``None`` for the module's output.
        key: the record name, the path, ``::op`` and parts: ``"lstm[1][0]"``,
            ``"h.0.attn::softmax"``, ``"::relu#1"``; ``"(root)"`` for the root's output.
        wide: selected by a glob, ``re:`` or ``type:`` pattern (not by its exact name): if it
            never runs, the report summarises it in one line rather than warning about it; a
            function-level target selected so need not make the call (only some modules do).

    Read-only by convention; a class with ``__slots__``: a capture of every module builds one
    per module (``python -m bench.dispatch``).
    """

    __slots__ = ("path", "module", "parts", "aliases", "op", "wide", "key", "standard")

    def __init__(self, path: str, module: nn.Module, parts: tuple[int | str, ...] = (),
                 aliases: tuple[str, ...] = (), op: str | None = None, wide: bool = False,
                 standard: tuple[str, ...] = ()):
        self.path, self.module, self.parts, self.aliases = path, module, parts, aliases
        self.op, self.wide, self.key = op, wide, record_name(path, op, parts)
        self.standard = standard  # the standard names it was selected by: ("resid_post.3",)

    def __repr__(self) -> str:
        return (f"Target(path={self.path!r}, module={type(self.module).__name__}, "
                f"parts={self.parts!r}, op={self.op!r}, wide={self.wide})")

    @property
    def name(self) -> str:
        """The name the user asked for: the first standard name it was selected by
        (``"attn.z.0"``), else its record name ``key`` (a glob's match, an exact path). Results
        are keyed and printed by it, with ``key`` (the module path) beside it."""
        return self.standard[0] if self.standard else self.key

    @property
    def record_key(self) -> RecordKey:
        """The ``RecordKey`` of its records: path, op and parts, no call."""
        return RecordKey(self.path, None, self.parts, self.op)


def is_container(module: nn.Module) -> bool:
    """True for a module with no ``forward`` of its own (``ModuleList``, ``ModuleDict``):
    nothing ever calls it, so a hook on it can never fire."""
    # getattr with a default: a RecursiveScriptModule's class-level forward raises on access
    return getattr(type(module), "forward", None) is nn.Module.forward


def select(model: nn.Module, *layers: str | Sequence[str]) -> dict[str, nn.Module]:
    """Return the submodules that the patterns ``layers`` name, keyed by path, in ``named_modules()`` order.

    Args:
        model: root module (wrappers are looked through, see the module docstring).
        *layers: patterns: exact paths, ``state_dict()`` keys, globs, ``re:``, ``type:`` patterns.
            Output parts in brackets are accepted and ignored here. A list or tuple of patterns
            stands for its patterns (``select(model, ["fc1", "fc2"])``), as in every verb.

    Returns:
        ``{path: module}`` without duplicates.

    Raises:
        SelectorError: a pattern matches nothing (the message lists the closest real paths, or
            says what the name is instead: a functional call, a name with the model's variable
            in front), or names a container such as ``ModuleList`` exactly (the message gives
            the pattern of its children and how many modules that matches).
    """
    return {t.path: t.module for t in resolve(model, flat_patterns(layers))}


def resolve(model: nn.Module, patterns: tuple[str, ...] | list[str], *,
            names: ModuleIndex | None = None) -> list[Target]:
    """Resolve ``patterns`` to ``Target`` s: modules in ``named_modules()`` order, one per
    distinct (path, parts). ``names`` is ``index(model)`` when the caller already has it (a
    session builds it once); else it is built here. Raises ``SelectorError`` as ``select`` does."""
    patterns = flat_patterns([patterns] if isinstance(patterns, str) else patterns)
    check_nonempty("layers", patterns, "'conv2', 'blocks.*', 'type:Linear' or '**' for every module")
    names = index(model) if names is None else names
    if len(patterns) == 1 and isinstance(patterns[0], str):  # already distinct, in module order
        return _resolve_address(names, patterns[0].strip())
    order = {path: i for i, path in enumerate(names.modules)}
    chosen: dict[tuple[str, tuple[int | str, ...], str | None], Target] = {}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise SelectorError(f"layers are patterns, each a string; got {type(pattern).__name__} "
                                f"{brief(pattern)}: pass strings, e.g. capture(model, 'fc1', "
                                f"'blocks.*') or a list of them, capture(model, ['fc1', 'fc2'])")
        for target in _resolve_address(names, pattern.strip()):
            known = chosen.get((target.path, target.parts, target.op))
            if known is None or known.wide and not target.wide:  # a name typed too: not wide
                chosen[(target.path, target.parts, target.op)] = target
            if known is not None:  # resid_pre.3 and resid_post.2: one module, both names kept
                kept = chosen[(target.path, target.parts, target.op)]
                kept.standard = tuple(dict.fromkeys(known.standard + target.standard))
    return sorted(chosen.values(), key=lambda t: order[t.path])


def asked_names(targets: Sequence[Target]) -> tuple[list[str], list[str]]:
    """The distinct record names of ``targets`` (what a verb captures and edits) and, beside
    each, the name the user asked for (``Target.name``: ``"attn.z.0"`` for
    ``"h.0.attn::scaled_dot_product_attention"``), which results are keyed and printed by."""
    first = {t.key: t for t in reversed(targets)}  # the first target of each record name wins
    keys = list(dict.fromkeys(t.key for t in targets))
    return keys, [first[key].name for key in keys]


def flat_patterns(patterns: Sequence[object]) -> list[str]:
    """The patterns with each list or tuple among them replaced by its items (one level): the
    one rule by which every verb takes names one by one, as a list, or both
    (``capture(model, ["fc1", "fc2"])`` is ``capture(model, "fc1", "fc2")``)."""
    flat: list[Any] = []  # a non-string item stays, for resolve to name it
    for pattern in patterns:
        flat.extend(pattern if isinstance(pattern, (list, tuple)) else [pattern])
    return flat


def _resolve_address(names: ModuleIndex, pattern: str) -> list[Target]:
    """A module pattern, or a function-level address ``module pattern::op[parts]``."""
    base, op, op_parts = split_address(pattern)
    wide = base.startswith(("re:", "type:")) or "*" in base or "?" in base
    if op is None:
        modules, aliases = names.modules, names.aliases  # one Target per module: no call each
        standard = _standard(names, pattern)
        if standard is not None:
            return [Target(path, modules[path], parts, aliases.get(path, ()), op, wide, (label,))
                    for label, path, parts, op in standard]
        return [Target(path, modules[path], parts, aliases.get(path, ()), None, wide)
                for path, parts in _resolve_one(names, pattern)]
    _, parts = _split_parts("_" + op_parts)
    if not base:
        return [_target(names, "", parts, op)]
    found = _resolve_one(names, base)
    if any(p for _, p in found):
        raise SelectorError(f"'{pattern}': output parts of a function call come after its name, "
                            f"e.g. '{base.split('[')[0]}::{op}[0]'")
    return [_target(names, path, parts, op, wide) for path, _ in found]


def _target(names: ModuleIndex, path: str, parts: tuple[int | str, ...], op: str | None = None,
            wide: bool = False) -> Target:
    return Target(path, names.modules[path], parts, names.aliases.get(path, ()), op, wide)


def _split_parts(pattern: str) -> tuple[str, tuple[int | str, ...]]:
    """``"pos_block[3].proj[0]"`` -> ``("pos_block.3.proj", (0,))``: an index followed by more
    of the name is a path segment; trailing ones are output parts (or children, see below)."""
    if pattern.startswith("re:"):
        return pattern, ()
    parts: list[int | str] = []
    while m := _PART.search(pattern):
        raw = m.group(1).strip().strip("'\"")
        parts.insert(0, int(raw) if re.fullmatch(r"-?\d+", raw) else raw)
        pattern = pattern[: m.start()]
    return _INNER_INDEX.sub(lambda m: "." + m.group(2).strip(), pattern), tuple(parts)


def _standard(names: ModuleIndex, pattern: str) -> list[Resolved] | None:
    """``[(standard name, path, parts, op)]`` when ``pattern`` is a standard name
    (``resid_post.3``, ``engine.standard_naming``) that is not also a real path of the model;
    else None."""
    base, parts = _split_parts(pattern)
    if not is_standard(base) or names.path_of(base) is not None:
        return None
    return [(label, path, own + parts, op) for label, path, own, op in resolve_standard(names, base)]


def _resolve_one(names: ModuleIndex, pattern: str) -> list[tuple[str, tuple[int | str, ...]]]:
    base, parts = _split_parts(pattern)
    if base in ("", ROOT):
        return [("", parts)]
    standard = _standard(names, pattern)
    if standard is not None:
        return [(path, own) for _, path, own, _ in standard]
    base, parts = _fold_children(names, base, parts)
    if base.startswith("re:"):
        paths = _match_regex(base[3:], names)
    elif base.startswith("type:"):
        paths = _match_type(base[5:], names.modules)
    elif "*" in base or "?" in base:
        paths = _match_glob(base, names)
    else:
        return [(_exact(names, base, parts), parts)]
    hookable = [p for p in paths if not is_container(names.modules[p])]
    if not hookable:
        raise SelectorError(_no_match_message(pattern, names, paths))
    return [(p, parts) for p in hookable]


def _fold_children(names: ModuleIndex, base: str,
                   parts: tuple[int | str, ...]) -> tuple[str, tuple[int | str, ...]]:
    """'features[0]' of a Sequential means the child 'features.0', not part 0 of the output."""
    while parts and names.path_of(f"{base}.{parts[0]}") is not None:
        base, parts = f"{base}.{parts[0]}", parts[1:]
    return base, parts


def _exact(names: ModuleIndex, name: str, parts: tuple[int | str, ...] = ()) -> str:
    path = names.path_of(name)
    if path is None and name in names.parametrizations:
        raise SelectorError(_parametrization_message(name, names.parametrizations[name]))
    if path is None:
        path = names.owner_of_key(name)
    if path is None:
        raise SelectorError(_unknown_message(names, name, parts))
    if is_container(names.modules[path]) and path:
        raise SelectorError(_container_message(path, names.modules))
    return path


def _parametrization_message(name: str, owner: str) -> str:
    return (f"'{name}' is part of a parametrization of '{owner or ROOT}' (torch.nn.utils."
            f"parametrize / weight_norm / spectral_norm): it computes a weight each time the "
            f"weight is read, it is not an activation of the model. Select the layer itself, "
            f"'{owner or ROOT}', whose output uses that weight")


def _match_regex(expr: str, names: ModuleIndex) -> list[str]:
    try:
        compiled = re.compile(expr)
    except re.error as err:
        raise SelectorError(f"'re:{expr}' is not a valid regular expression ({err}); "
                            f"escape dots as '\\.' and anchor nothing: it must match the whole path") from err
    return _matching(names, compiled, lambda segment: segment in expr)


def _match_type(name: str, modules: dict[str, nn.Module]) -> list[str]:
    def matches(m: nn.Module) -> bool:
        return any(name in (c.__name__, f"{c.__module__}.{c.__qualname__}") for c in type(m).__mro__)
    return [p for p, m in modules.items() if p and matches(m)]


def _match_glob(pattern: str, names: ModuleIndex) -> list[str]:
    literal = set(pattern.split("."))
    return _matching(names, re.compile(_glob_to_regex(pattern)), literal.__contains__)


def _matching(names: ModuleIndex, compiled: re.Pattern[str],
              spelled: Callable[[str], bool]) -> list[str]:
    """Paths of the modules whose names ``compiled`` matches; never the root.

    The names matched are those of the unwrapped model (paths and aliases, ``names.visible``),
    so a wildcard never matches a wrapper's own segment and a pattern selects on a wrapped model
    exactly what it selects on the unwrapped one (``select(torch.compile(m), "*.0")`` is
    ``select(m, "*.0")``, not also ``"_orig_mod.0"``'s root). Only when no such name matches, a
    pattern written with wrapper segments (``"module.layers.*"``) matches the raw names in which
    the pattern spells every wrapper segment out (``spelled(segment)``: a literal glob segment,
    text of a regex)."""
    if compiled.pattern == _EVERY:
        return [p for p in names.modules if p]
    found = {names.canonical[n] for n in names.visible if n and compiled.fullmatch(n)}
    if not found and names.wrappers:
        found = {names.canonical[n] for n in names.canonical if n not in names.visible
                 and compiled.fullmatch(n) and all(map(spelled, _wrapper_segments(names, n)))}
    return [p for p in names.modules if p and p in found]


def _wrapper_segments(names: ModuleIndex, raw: str) -> list[str]:
    """The segments of the raw name ``raw`` that are wrappers' attributes
    (``"_orig_mod.0.module"`` -> ``["_orig_mod"]`` when only the root is a wrapper)."""
    segments = raw.split(".")
    return [segment for i, segment in enumerate(segments)
            if ".".join(segments[:i]) in names.wrappers]


_EVERY = r"(?:[^.]+(?:\.[^.]+)*)?"  # what '**' compiles to: every name


def _glob_to_regex(pattern: str) -> str:
    regex = ""
    for i, segment in enumerate(pattern.split(".")):
        if segment == "**":  # zero or more whole segments, with their dots
            regex += _EVERY if i == 0 else r"(?:\.[^.]+)*"
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


def _unknown_message(names: ModuleIndex, name: str, parts: tuple[int | str, ...] = ()) -> str:
    head, _, rest = name.partition(".")
    if rest and names.path_of(head) is None and (names.path_of(rest) or names.owner_of_key(rest)):
        rest, parts = _fold_children(names, rest, parts)
        fix = rest + "".join(f"[{p}]" for p in parts)
        return (f"no module named '{name}': did you mean '{fix}'? Paths start below the model; "
                f"'{head}.' is the variable that holds it in your code, not part of any path")
    functional = _functional_message(names, name) or _transformer_lens_message(names, name)
    if functional:
        return functional
    keys = [p for p, m in names.modules.items() if p and not is_container(m)]
    keys += known_standard_names(names)
    keys += [a for aliases in names.aliases.values() for a in aliases]
    keys += [f"{p}.{k}" if p else k for p, m in names.modules.items()
             for k in (*m._parameters, *m._buffers)]
    close = difflib.get_close_matches(_without_wrappers(names, name), keys, n=5, cutoff=0.5)
    top = [p for p in names.modules if p and "." not in p]
    hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else (
        f"the model's top-level modules are {', '.join(repr(p) for p in top)[:400]}"
        if top else f"the model is a single {type(names.root).__name__} with no submodules: select "
                    f"it with '{ROOT}' (or '')")
    return (f"no module or state_dict key named '{name}': {hint} "
            f"(names are as model.named_modules() gives them; 'hookscope tree MODEL' lists them all)"
            f"{_graph_module_hint(names.root)}")


def _transformer_lens_message(names: ModuleIndex, name: str) -> str | None:
    """``'blocks.1.hook_resid_post'`` (a TransformerLens hook name) on a model that has the
    standard name it means (``resid_post.1``): say which, and the module it resolves to."""
    standard = from_transformer_lens(name)
    if standard is None:
        return None
    try:
        ((_, path, parts, _),) = resolve_standard(names, standard)
    except SelectorError:
        return None
    where = path + "".join(f"[{p}]" for p in parts)
    return (f"no module named '{name}': it is a TransformerLens hook name; on this model the same "
            f"quantity is the standard name '{standard}' (the output of '{where}'): did you mean "
            f"'{standard}'?")


def _without_wrappers(names: ModuleIndex, name: str) -> str:
    """``name`` with its longest known prefix written as a canonical path
    (``"module.fc_1"`` -> ``"fc_1"`` under DataParallel)."""
    segments = name.split(".")
    for i in range(len(segments) - 1, 0, -1):
        path = names.path_of(".".join(segments[:i]))
        if path is not None:
            return ".".join(([path] if path else []) + segments[i:])
    return name


def _functional_message(names: ModuleIndex, name: str) -> str | None:
    """``'block.relu'`` (or ``'relu'``) where ``block``'s forward calls ``F.relu`` /
    ``torch.relu`` / ``x.relu()``: the name of a function a forward calls (read from the code
    object's names, nothing is run), not of a module."""
    parent, _, function = name.rpartition(".")
    path = names.path_of(parent)
    if path is None or not function.isidentifier():
        return None
    callers = [p for p in names.modules if _calls(names.modules[p], function)
               and (p == path or (not parent and p))]
    if not callers or (parent and callers != [path]):
        return None
    classes = sorted({type(names.modules[p]).__name__ for p in callers})
    where = ", ".join(f"'{p}'" if p else "the model" for p in callers[:4])
    where += " …" if len(callers) > 4 else ""
    return (f"'{name}' is not a module: {'/'.join(classes)}.forward ({where}) calls {function} as a "
            f"function (F.{function}, torch.{function} or x.{function}()), and module hooks only "
            f"see modules. Capture that call's result with the function address "
            f"'{callers[0]}::{function}', or capture {where.split(',')[0]} or the module that feeds it")


def _calls(module: nn.Module, function: str) -> bool:
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return code is not None and function in code.co_names


def _graph_module_hint(root: nn.Module) -> str:
    """For a ``torch.fx.GraphModule``: modules the tracer inlined are gone (pytorch/pytorch#105445)."""
    if not isinstance(root, torch.fx.GraphModule):
        return ""
    called = [str(n.target) for n in root.graph.nodes if n.op == "call_module"]
    return (f". The model is a torch.fx.GraphModule: a module that symbolic tracing inlined is not "
            f"present in the traced graph. call_module targets are: {called}; hook one of those, "
            f"or capture the eager model before tracing")


def _no_match_message(pattern: str, names: ModuleIndex, matched: list[str]) -> str:
    modules = names.modules
    if matched:  # only containers matched
        return (f"pattern '{pattern}' matched only containers with no forward ({', '.join(matched[:5])}), "
                f"whose hooks can never fire: select their children, e.g. '{matched[0]}.*'")
    if len(modules) == 1:
        return (f"pattern '{pattern}' matched no module: the model is a single "
                f"{type(names.root).__name__} with no submodules, and patterns never match the "
                f"model itself. Select it with '{ROOT}' (or '')")
    if pattern.startswith("type:"):
        classes = sorted({type(m).__name__ for p, m in modules.items() if p})
        close = difflib.get_close_matches(pattern[5:], classes, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr('type:' + c) for c in close)}? " if close else ""
        return (f"pattern '{pattern}' matched no module: {hint}the classes in this model are "
                f"{', '.join(classes)[:600]}")
    literal = re.sub(r"[*?\[\]]", "", pattern.split(":", 1)[-1]).strip(".")
    hookable = [p for p, m in modules.items() if p and not is_container(m)]
    close = difflib.get_close_matches(literal, hookable, n=5, cutoff=0.4)
    hint = f"; closest paths: {', '.join(repr(c) for c in close)}" if close else ""
    deeper = f" ('**.{pattern}' searches every depth)" if "." not in pattern and ":" not in pattern else ""
    return (f"pattern '{pattern}' matched no module{hint}. Globs: '*' is one dotted segment, "
            f"'**' any number of them{deeper}; 'hookscope tree MODEL' lists every path")

def as_patterns(layers: str | Sequence[str], name: str = "layers") -> list[str]:
    """One pattern or a list of patterns -> a list of patterns: ``"fc1"`` -> ``["fc1"]``.

    Every public function that takes "a pattern or a list of patterns" (``layers=``) reads it
    through this; a lone string is never split into its characters. An empty list raises
    ``EmptySelectionError`` naming the parameter ``name`` (``engine.checks.check_nonempty``),
    ``None`` or a number ``ArgumentTypeError``."""
    if isinstance(layers, str):
        return [layers]
    check_iterable(name, layers, f"{name}='blocks.*' or {name}=['fc1', 'fc2']")
    patterns = list(layers)
    check_nonempty(name, patterns, f"{name}='blocks.*'")
    return patterns
