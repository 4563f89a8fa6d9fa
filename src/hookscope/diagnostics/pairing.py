"""Which module of model B corresponds to which of model A: by a name mapping, a function, or
automatically by call order, output shape and module kind.

Two implementations of one network (a Hugging Face model and a port, an eager and a fused
variant, a float model and its quantized version) name their modules differently. ``compare``
asks this module for the pairs of calls to compare; each pair may carry a transform that brings
A's output into B's layout (a fused QKV projection against one of three, ``(B, T, H, D)``
against ``(B, H, T, D)``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from hookscope.errors import HookscopeError

Tensor = torch.Tensor
Transform = Callable[[Tensor], Tensor]
#: ``pair=`` of ``compare``: ``"auto"``; ``{pattern in A: pattern in B}`` (a value may be
#: ``(pattern in B, transform)``, or a list of those); or ``f(path in A) -> path in B or None``
PairSpec = str | Mapping[str, object] | Callable[[str], str | None]

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of one module, as ``compare`` saw it return.

    Attributes:
        path: the module's name; ``call``: which of its calls (0 for the first).
        kind: ``"linear"``, ``"norm"``, ``"embedding"``, ``"dropout"``, ``"activation"``, the
            class name of another leaf module, or ``"container"`` (a module with children).
        shape: shape of the first tensor of its output (``()`` when it returned none).
    """

    path: str
    call: int
    kind: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Pairing:
    """What was paired with what, and what was not.

    Attributes:
        how: ``"auto"``, ``"mapping"`` or ``"callable"``.
        pairs: ``((call in A, call in B, transform or None), ...)`` in A's call order.
        unpaired_a, unpaired_b: ``"path:call"`` of the calls that found no partner.
        confidence: the fraction of all calls of both models that found a partner,
            ``(paired calls of A + paired calls of B) / (calls of A + calls of B)``: 1.0
            when every call of both pairs.
    """

    how: str
    pairs: tuple[tuple[Call, Call, Transform | None], ...]
    unpaired_a: tuple[str, ...]
    unpaired_b: tuple[str, ...]
    confidence: float


def kind(module: nn.Module) -> str:
    """The kind ``auto`` pairing matches on: modules of one kind pair with each other whatever
    their class (``nn.Linear`` with transformers' ``Conv1D`` or a dynamically quantized
    ``Linear``; ``LayerNorm`` with ``RMSNorm``; ``GELU`` with ``NewGELUActivation``)."""
    name = type(module).__name__
    if isinstance(module, nn.Linear) or "Linear" in name or name == "Conv1D":
        return "linear"
    if "Norm" in name:
        return "norm"
    if "Embedding" in name:
        return "embedding"
    if "Dropout" in name:
        return "dropout"
    if type(module).__module__ == "torch.nn.modules.activation" or "Activation" in name:
        return "activation"
    return name if next(module.children(), None) is None else "container"


def pair_calls(spec: PairSpec, calls_a: Sequence[Call], calls_b: Sequence[Call]) -> Pairing:
    """Pair the calls of two runs (each list in completion order) as ``spec`` says.

    ``"auto"`` aligns the two call sequences (a longest common subsequence, Hirschberg/Wagner-
    Fischer dynamic programming) where two calls may pair when they have the same kind and
    the same output shape. A mapping pairs by name: ``{name}`` placeholders match one name
    component (``"h.{i}.attn" -> "layers.{i}.self_attn"``); a key starting with ``re:`` is a
    regular expression over A's names whose groups fill the value (``\\1``, ``\\g<name>``).
    Calls pair when their paths pair and they are the same call of the module.

    Raises:
        HookscopeError: ``spec`` is none of the three forms, or a mapping value is not a
            name, ``(name, transform)`` or a list of these.
    """
    if spec == "auto":
        pairs = [(a, b, None) for a, b in _align(calls_a, calls_b)]
        return _result("auto", pairs, calls_a, calls_b)
    if isinstance(spec, Mapping):
        rules = [(key, target) for key, value in spec.items() for target in _targets(key, value)]
        return _by_name("mapping", lambda path: _map(rules, path), calls_a, calls_b)
    if callable(spec):
        return _by_name("callable", lambda path: [(p, None) for p in [spec(path)] if p], calls_a,
                        calls_b)
    raise HookscopeError(f"pair={spec!r} is not a way to pair modules: pass pair='auto', a "
                         f"mapping {{'h.{{i}}.attn': 'layers.{{i}}.self_attn'}}, or a function "
                         f"from a path of model A to a path of model B (or None)")


def _targets(key: str, value: object) -> list[tuple[str, Transform | None]]:
    values = value if isinstance(value, list) else [value]
    found: list[tuple[str, Transform | None]] = []
    for item in values:
        if isinstance(item, str):
            found.append((item, None))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) \
                and callable(item[1]):
            found.append((item[0], item[1]))
        else:
            raise HookscopeError(
                f"pair[{key!r}] = {item!r} is not a pattern of model B: give a name "
                f"('layers.{{i}}.attn'), a (name, transform) tuple whose transform maps A's "
                f"output to B's layout, or a list of these")
    return found


def _map(rules: list[tuple[str, tuple[str, Transform | None]]],
         path: str) -> list[tuple[str, Transform | None]]:
    """Every ``(path in B, transform)`` the rules give for ``path`` of model A."""
    found = []
    for key, (target, transform) in rules:
        if key.startswith("re:"):
            match = re.fullmatch(key[3:], path)
            if match:
                found.append((match.expand(target), transform))
            continue
        match = re.fullmatch(_PLACEHOLDER.sub(r"(?P<\1>[^.]+)", re.escape(key).replace(
            r"\{", "{").replace(r"\}", "}")), path)
        if match:
            found.append((_fill(target, match.groupdict()), transform))
    return found


def _fill(target: str, groups: dict[str, str]) -> str:
    """``target`` with each ``{name}`` replaced by the component it matched in A's path."""
    return _PLACEHOLDER.sub(lambda m: groups[m.group(1)], target)


def _by_name(how: str, lookup: Callable[[str], list[tuple[str, Transform | None]]],
             calls_a: Sequence[Call], calls_b: Sequence[Call]) -> Pairing:
    by_key = {(c.path, c.call): c for c in calls_b}
    pairs = [(a, by_key[(path, a.call)], transform) for a in calls_a
             for path, transform in lookup(a.path) if (path, a.call) in by_key]
    return _result(how, pairs, calls_a, calls_b)


def _align(calls_a: Sequence[Call], calls_b: Sequence[Call]) -> list[tuple[Call, Call]]:
    """The longest sequence of pairs, in order on both sides, of calls of the same kind and
    output shape (Wagner and Fischer 1974, "The string-to-string correction problem")."""
    n, m = len(calls_a), len(calls_b)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            same = _fits(calls_a[i], calls_b[j])
            best[i][j] = max(best[i + 1][j], best[i][j + 1], best[i + 1][j + 1] + 1 if same else 0)
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if _fits(calls_a[i], calls_b[j]) and best[i][j] == best[i + 1][j + 1] + 1:
            pairs.append((calls_a[i], calls_b[j]))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _fits(a: Call, b: Call) -> bool:
    return a.kind == b.kind and a.shape == b.shape


def _result(how: str, pairs: Sequence[tuple[Call, Call, Transform | None]], calls_a: Sequence[Call],
            calls_b: Sequence[Call]) -> Pairing:
    used_a = {(a.path, a.call) for a, _, _ in pairs}
    used_b = {(b.path, b.call) for _, b, _ in pairs}
    total = len(calls_a) + len(calls_b)
    return Pairing(how, tuple(pairs),
                   tuple(f"{c.path}:{c.call}" for c in calls_a if (c.path, c.call) not in used_a),
                   tuple(f"{c.path}:{c.call}" for c in calls_b if (c.path, c.call) not in used_b),
                   (len(used_a) + len(used_b)) / total if total else 0.0)
