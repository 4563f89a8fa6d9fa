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

from hookscope.engine import comparable
from hookscope.errors import ArgumentValueError, HookscopeError

__all__ = ["Call", "PairSpec", "Pairing", "Transform", "check_pair", "fingerprint", "kind", "pair_calls",
           "transform_for", "weights"]

Tensor = torch.Tensor
#: brings A's output into B's layout; a tuple or list of tensors splits it into pieces
Transform = Callable[[Tensor], "Tensor | Sequence[Tensor]"]
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
        sample: ``fingerprint`` of that tensor, or None; weights: the module's entry of
            ``weights``.
            ``auto`` prefers, among alignments with the most pairs, the one whose paired
            calls are most alike in weights and outputs.
        piece: which tensor of a transform that split the output (a fused QKV into q, k, v:
            0, 1, 2), each paired on its own; None when it was not split.
    """

    path: str
    call: int
    kind: str
    shape: tuple[int, ...]
    sample: Tensor | None = dataclasses.field(default=None, compare=False, repr=False)
    weights: tuple[int, float, float] | None = dataclasses.field(default=None, compare=False)
    piece: int | None = None

    @property
    def name(self) -> str:
        """``"path:call"``, with ``[piece]`` for a piece of a split output (``"c_attn:0[1]"``)."""
        return f"{self.path}:{self.call}" + ("" if self.piece is None else f"[{self.piece}]")

    @property
    def part(self) -> str:
        """``path``, with ``[piece]`` for a piece of a split output (``"attn.c_attn[1]"``)."""
        return self.path + ("" if self.piece is None else f"[{self.piece}]")


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


def fingerprint(t: Tensor) -> Tensor:
    """Up to 256 evenly spaced elements of ``t`` flattened, as float64 (what ``auto`` compares
    to break ties between calls of one kind and shape): the same positions for the same shape."""
    flat = t.detach().reshape(-1)
    index = torch.linspace(0, max(flat.numel() - 1, 0), min(flat.numel(), 256)).long()
    return flat[index.to(flat.device)].to(torch.float64).cpu()


Signature = tuple[int, float, float]


def weights(modules: Mapping[str, nn.Module]) -> dict[str, Signature | None]:
    """``{path: (count, sum, sum of squares)}`` of every parameter of each module (its
    children's too), in float64, each parameter reduced once without a float64 copy; None for
    a module without parameters or with meta ones. These do not change when a port copies the
    weights in another layout (a ``Conv1D``'s ``(in, out)`` as a ``Linear``'s ``(out, in)``),
    and two modules initialised apart almost never share them."""
    each: dict[int, Signature | None] = {}

    def reduced(name: str, p: nn.Parameter) -> Signature | None:
        if id(p) not in each:
            value = None if p.device.type == "meta" else comparable(p.detach(), name)
            each[id(p)] = None if value is None else (
                value.numel(), float(value.sum(dtype=torch.float64)),
                float(torch.linalg.vector_norm(value, dtype=torch.float64)) ** 2)
        return each[id(p)]

    found: dict[str, Signature | None] = {}
    for path, module in modules.items():
        parts = [reduced(name, p) for name, p in module.named_parameters()]
        found[path] = None if not parts or None in parts else (
            sum(q[0] for q in parts if q), sum(q[1] for q in parts if q), sum(q[2] for q in parts if q))
    return found


def transform_for(transforms: Mapping[str, Transform], path: str) -> Transform | None:
    """The transform of the first key of ``transforms`` (a pattern of model A, ``{name}``
    placeholders or ``re:``) that matches ``path``, or None."""
    return next((t for key, t in transforms.items() if _match(key, path) is not None), None)


def transformed(transform: Transform | None, t: Tensor) -> list[tuple[int | None, Tensor]]:
    """``t`` in B's layout as ``[(piece, tensor), ...]``: ``[(None, t)]`` without a transform,
    ``[(None, transform(t))]`` for one tensor, ``[(0, q), (1, k), (2, v)]`` when the transform
    split it (returned a tuple or list of tensors: a fused QKV).

    Raises:
        HookscopeError: the transform returned neither a tensor nor a non-empty tuple or list
            of tensors.
    """
    found = t if transform is None else transform(t)
    if isinstance(found, Tensor):
        return [(None, found)]
    if isinstance(found, (tuple, list)) and found and all(isinstance(p, Tensor) for p in found):
        return list(enumerate(found))
    raise HookscopeError(f"a transform returned {type(found).__name__}; return a tensor in B's "
                         f"layout, or a tuple of tensors to split the output into pieces paired "
                         f"one by one (lambda t: t.split(768, dim=-1) for a fused QKV)")


def pair_calls(spec: PairSpec, calls_a: Sequence[Call], calls_b: Sequence[Call],
               transforms: Mapping[str, Transform] | None = None) -> Pairing:
    """Pair the calls of two runs (each list in completion order) as ``spec`` says.

    ``"auto"`` aligns the two call sequences (a longest common subsequence, Wagner-Fischer
    dynamic programming) where two calls may pair when they have the same kind and the same
    output shape; among the alignments with the most pairs it takes the one whose paired
    calls are most alike (``_likeness``: the same ``weights`` first, then the cosine of their
    output ``sample``s), so an output projection pairs with the output projection, not with a
    query projection of the same shape one call earlier, also when a bug right there changed
    its output.
    ``transforms`` (``{pattern in A: transform}``, only with ``"auto"``) gives the pairs of
    those modules of A their transform; the calls' shapes and samples are taken after it (a
    transform that splits an output made one call of A a piece per tensor, ``Call.piece``).
    A mapping pairs by name: ``{name}`` placeholders match one name
    component (``"h.{i}.attn" -> "layers.{i}.self_attn"``); a key starting with ``re:`` is a
    regular expression over A's names whose groups fill the value (``\\1``, ``\\g<name>``).
    Calls pair when their paths pair and they are the same call of the module.

    Raises:
        HookscopeError: ``spec`` is none of the three forms, or a mapping value is not a
            name, ``(name, transform)`` or a list of these.
    """
    if spec == "auto":
        pairs = [(a, b, transform_for(transforms or {}, a.path)) for a, b in _align(calls_a, calls_b)]
        return _result("auto", pairs, calls_a, calls_b)
    if transforms:
        raise HookscopeError(
            f"transforms={dict(transforms)!r} works with pair='auto' only: with a mapping, give "
            f"each pair's transform in its value, pair={{'h.{{i}}.qkv': ('layers.{{i}}.q', "
            f"lambda t: t[..., :width])}}")
    if isinstance(spec, Mapping):
        rules = [(key, target) for key, value in spec.items() for target in _targets(key, value)]
        return _by_name("mapping", lambda path: _map(rules, path), calls_a, calls_b)
    if callable(spec):
        return _by_name("callable", lambda path: [(p, None) for p in [spec(path)] if p], calls_a,
                        calls_b)
    check_pair(spec)
    raise AssertionError("check_pair refuses every other spec")


def check_pair(spec: object) -> None:
    """Raise ``ArgumentValueError`` unless ``spec`` is a way to pair modules: ``None``,
    ``"auto"``, a mapping or a function (what ``compare(pair=)`` takes); checked at the call."""
    if spec is None or spec == "auto" or isinstance(spec, Mapping) or callable(spec):
        return
    raise ArgumentValueError(f"pair={spec!r} is not a way to pair modules: pass pair='auto', a "
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
        match = _match(key, path)
        if match is not None:
            found.append((match.expand(target) if key.startswith("re:")
                          else _fill(target, match.groupdict()), transform))
    return found


def _match(key: str, path: str) -> re.Match[str] | None:
    """``key`` (``re:`` a regular expression, else a name with ``{name}`` placeholders, each
    one name component) against the whole of ``path``."""
    if key.startswith("re:"):
        return re.fullmatch(key[3:], path)
    return re.fullmatch(_PLACEHOLDER.sub(r"(?P<\1>[^.]+)", re.escape(key).replace(
        r"\{", "{").replace(r"\}", "}")), path)


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
    output shape (Wagner and Fischer 1974, "The string-to-string correction problem"), the
    most alike among equally long ones: a pair scores 1 + likeness / (n + 1), so likeness
    (at most 1 per pair, at most n pairs) never outweighs one pair more."""
    n, m = len(calls_a), len(calls_b)
    score = [[0.0] * (m + 1) for _ in range(n + 1)]
    gain = _gains(calls_a, calls_b)
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            paired = score[i + 1][j + 1] + gain[i, j] if (i, j) in gain else 0.0
            score[i][j] = max(score[i + 1][j], score[i][j + 1], paired)
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if (i, j) in gain and score[i][j] == score[i + 1][j + 1] + gain[i, j]:
            pairs.append((calls_a[i], calls_b[j]))
            i, j = i + 1, j + 1
        elif score[i + 1][j] >= score[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _gains(calls_a: Sequence[Call], calls_b: Sequence[Call]) -> dict[tuple[int, int], float]:
    """``{(i, j): 1 + likeness / (n + 1)}`` for the calls that may pair (same kind and shape)."""
    groups: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[int]]] = {}
    for side, calls in enumerate((calls_a, calls_b)):
        for index, call in enumerate(calls):
            groups.setdefault((call.kind, call.shape), ([], []))[side].append(index)
    gain: dict[tuple[int, int], float] = {}
    for rows, columns in groups.values():
        if rows and columns:
            like = _likeness([calls_a[i] for i in rows], [calls_b[j] for j in columns])
            gain |= {(i, j): 1.0 + like[r][c] / (len(calls_a) + 1)
                     for r, i in enumerate(rows) for c, j in enumerate(columns)}
    return gain


def _likeness(calls_a: list[Call], calls_b: list[Call]) -> list[list[float]]:
    """How alike each call of ``calls_a`` is to each of ``calls_b`` (calls of one kind and
    output shape), in [0, 1]: the mean of ``_same_weights`` and of the outputs' likeness.
    Weights decide first (a bug right at a module changes its output, not its weights)."""
    outputs = _output_likeness(calls_a, calls_b)
    return [[(_same_weights(a.weights, b.weights) + outputs[r][c]) / 2
             for c, b in enumerate(calls_b)] for r, a in enumerate(calls_a)]


def _same_weights(a: tuple[int, float, float] | None, b: tuple[int, float, float] | None) -> float:
    """1.0 when two ``weights`` signatures agree (to 1e-3 of the sum of squares: rounding to
    another float format averages out), 0.0 when they differ, 0.5 when either is missing."""
    if a is None or b is None:
        return 0.5
    scale = max(a[2], b[2], 1e-30)
    close = abs(a[2] - b[2]) <= 1e-3 * scale and abs(a[1] - b[1]) <= 1e-3 * (scale * a[0]) ** 0.5
    return float(a[0] == b[0] and close)


def _output_likeness(calls_a: list[Call], calls_b: list[Call]) -> list[list[float]]:
    """``(1 + cosine) / 2`` of the samples of each call of ``calls_a`` with each of ``calls_b``,
    in [0, 1]; 0.5 where a sample is missing or zero."""
    samples = [c.sample for c in [*calls_a, *calls_b]]
    if any(s is None for s in samples):
        return [[0.5] * len(calls_b) for _ in calls_a]
    unit = torch.nn.functional.normalize(torch.stack(samples).nan_to_num(), dim=1)  # type: ignore[arg-type]
    cosine = unit[:len(calls_a)] @ unit[len(calls_a):].T
    zero = unit.norm(dim=1) == 0
    like = ((1 + cosine) / 2).masked_fill(zero[:len(calls_a), None] | zero[None, len(calls_a):], 0.5)
    return like.tolist()


def _result(how: str, pairs: Sequence[tuple[Call, Call, Transform | None]], calls_a: Sequence[Call],
            calls_b: Sequence[Call]) -> Pairing:
    used_a = {a.name for a, _, _ in pairs}
    used_b = {b.name for _, b, _ in pairs}
    total = len(calls_a) + len(calls_b)
    return Pairing(how, tuple(pairs),
                   tuple(c.name for c in calls_a if c.name not in used_a),
                   tuple(c.name for c in calls_b if c.name not in used_b),
                   (len(used_a) + len(used_b)) / total if total else 0.0)
