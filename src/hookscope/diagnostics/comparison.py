"""The comparison of two runs, layer by layer: where they first diverge.

Two models (or one model under two settings: a copy in bfloat16, another checkpoint, train vs
eval) run on the same input. Model A's selected outputs are kept (cloned when returned, so a
later in-place operation cannot change them); model B's are compared inside its hooks as they
are returned and dropped, so memory holds one run's activations, not two. The runs are
``forwards.py``'s; each pair of outputs is measured by ``differences.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.diagnostics.differences import Key, LayerDiff, _diff, _real, _values
from hookscope.diagnostics.forwards import (
    _local,
    _require_hooks_fired,
    _run,
    _targets,
    _token_watch,
    _watched_forward,
    _watching,
)
from hookscope.diagnostics.pairing import (
    Call,
    Pairing,
    PairSpec,
    Transform,
    check_pair,
    pair_calls,
    transformed,
)
from hookscope.engine import (
    MaskWatcher,
    Target,
    Tokens,
    as_patterns,
    check_number,
    comparable,
    untouched,
    unwrap,
)
from hookscope.errors import ArgumentTypeError, ArgumentValueError, HookscopeError, SelectorError
from hookscope.record import padding_dropped
from hookscope.util import Keys, new_figure, save_figure

__all__ = ["Comparison", "PairDiff", "compare", "plot_errors"]

Tensor = torch.Tensor
#: default ``(atol, rtol)`` of a pair by the lowest precision on either side (``pair=`` mode):
#: float32's are ``compare``'s fixed defaults; the others grow with the unit roundoff of the
#: format (2**-11 for float16, 2**-8 for bfloat16) times the depth of a typical layer's sums;
#: ``int8`` is any quantized module or output (scale / 2 per element, accumulated)
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-8), "float32": (1e-5, 1e-4), "float16": (1e-3, 1e-2),
    "bfloat16": (1e-2, 5e-2), "int8": (5e-2, 1e-1)}
_PRECISION_ORDER = ("int8", "bfloat16", "float16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class PairDiff:
    """One pair of calls of two different implementations (``compare(..., pair=...)``).

    Attributes:
        path_a, path_b: the modules' names in model A and model B (A's with ``[piece]`` for a
            piece of an output a transform split, ``"h.0.attn.c_attn[1]"``); ``call``: call
            index in A.
        accumulated: A's output against B's output in the two full runs (the error the whole
            network up to here has built), first output tensor of each (after ``transform``).
        local: A's output against what B's module returns on A's *recorded inputs* (the same
            input to both): the error this module adds by itself; ``None`` when B's module
            could not run on A's inputs (``local_error`` says why).
        precision: lowest precision on either side, ``"float32"``, ``"bfloat16"``, ``"int8"``
            (quantized) ...; ``atol``, ``rtol``: the tolerances used for both figures.
        local_error: why ``local`` is ``None`` (``""`` otherwise).
    """

    path_a: str
    path_b: str
    call: int
    accumulated: LayerDiff
    local: LayerDiff | None
    precision: str
    atol: float
    rtol: float
    local_error: str = ""

    @property
    def origin(self) -> bool:
        """The module itself differs: B's module on A's inputs is outside tolerance."""
        return self.local is not None and not self.local.close

    @property
    def propagated(self) -> bool:
        """The outputs differ only because the inputs already did (local error within tolerance)."""
        return not self.accumulated.close and self.local is not None and self.local.close


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The result of ``compare``: one ``LayerDiff`` per module call, in the order the calls
    returned in run A (children before their parents), the models' outputs last.

    Attributes:
        diffs: the comparisons.
        unmatched: ``"path:k"`` for calls that ran in only one of the two runs.
        atol, rtol: the tolerances used for ``LayerDiff.close``.
        unfired: ``{path: why it never ran}`` for selected modules that ran in neither run
            (an unused branch, a module called through ``.forward``), run A's cause first.
        pairs: with ``pair=``, one ``PairDiff`` per pair of calls in A's call order (``diffs``
            then holds their ``accumulated`` figures, named by A's paths); else empty.
        pairing: with ``pair=``, what was paired, what was not and how surely; else None.

    With ``pair=`` and tolerances by dtype, ``atol`` and ``rtol`` are NaN: each pair has its own.
    """

    diffs: tuple[LayerDiff, ...]
    unmatched: tuple[str, ...]
    atol: float
    rtol: float
    unfired: dict[str, str] = dataclasses.field(default_factory=dict)
    pairs: tuple[PairDiff, ...] = ()
    pairing: Pairing | None = None

    @property
    def first_origin(self) -> PairDiff | None:
        """The first pair (A's call order) whose module differs by itself (``PairDiff.origin``):
        where the implementations part, as against where a difference first shows."""
        return next((p for p in self.pairs if p.origin), None)

    @property
    def first_divergent(self) -> LayerDiff | None:
        """The first call, in completion order, that is not within tolerance; None if all are."""
        return next((d for d in self.diffs if not d.close), None)

    def __getitem__(self, path: str) -> LayerDiff:
        """The first call of ``path`` (``comparison[path]``); raises KeyError if not compared."""
        for diff in self.diffs:
            if diff.path == path:
                return diff
        raise KeyError(f"'{path}' was not compared; compared paths: "
                       f"{sorted({d.path for d in self.diffs})[:10]} ...")


def compare(model_a: nn.Module, model_b: nn.Module, *args: Any, layers: str | list[str] = "**",
            atol: float | None = None, rtol: float | None = None, pair: PairSpec | None = None,
            tolerances: Mapping[str, tuple[float, float]] | None = None,
            transforms: Mapping[str, Transform] | None = None, **kwargs: Any) -> Comparison:
    """Run both models on the same input and compare the outputs of the same modules.

    Floating-point tensors in ``args``/``kwargs`` are cast to the dtype of each model's first
    floating-point parameter and moved to where its first computation runs
    (``engine.run.input_device``: accelerate's execution device for an offloaded model), so
    ``compare(model, copy.deepcopy(model).to(torch.bfloat16), x)`` compares float32 with
    bfloat16. Both forwards run under ``torch.no_grad()`` in each model's current train/eval
    mode; hooks are removed on return.
    Each run leaves its model as it was found, also on an error (BatchNorm statistics,
    spectral norm, train/eval flags, ``requires_grad``, ``.grad``, the RNG state:
    ``engine.run.untouched``), so run B starts from the state run A started from: the same
    RNG state (the same dropout masks for the same architecture), and ``compare(model, model,
    x)`` of a model in training mode sees the same BatchNorm and spectral-norm state twice.
    Every tensor of an output is compared as float64 values: integer and bool ones exactly
    (up to 2**53), quantized ones dequantized, complex ones by real and imaginary parts, a
    ``DTensor`` (tensor parallelism) as its global tensor, so a sharded model compares with
    the unsharded one. With an ``attention_mask`` only the real tokens of each output are
    compared, on its token axis (``engine.values.layout``: dim 1 of a module output, the queries of
    ``scaled_dot_product_attention``, dim 0 of a sequence-first ``nn.MultiheadAttention``):
    what padding holds is no model's answer (SDPA and eager attention fill it differently);
    ``LayerDiff.shape`` is still the whole output's. Without ``pair=``.

    Args:
        model_a: Reference model.
        model_b: Model to compare: a copy of ``model_a`` in another dtype, device or mode,
            another checkpoint, its peft/LoRA version (modules pair by their names without
            wrapper and adapter prefixes); ``model_a`` itself checks that two runs are
            deterministic.
        *args, **kwargs: Inputs of one forward call.
        layers: Pattern or list of patterns for ``hookscope.select`` (default every module;
            output parts such as ``"lstm[0]"`` allowed), resolved in each model; paths selected
            in only one model are not compared.
        atol, rtol: Absolute and relative tolerance (relative to run A) of ``LayerDiff.close``;
            ``None``: 1e-5 and 1e-4, or with ``pair=`` the defaults of each pair's precision
            (``TOLERANCES``).
        pair: ``None`` pairs modules by identical names. For two implementations with other
            names: ``"auto"`` aligns the calls of both runs by call order, output shape and
            module kind (``pairing.pair_calls``); a mapping ``{"h.{i}.attn": "layers.{i}.attn"}``
            (``re:`` keys with groups too; a value ``(name, transform)`` compares
            ``transform(A's output)`` with B's, for layouts that differ: a slice of a fused QKV,
            ``lambda t: t.transpose(1, 2)``); or a function from A's path to B's (or None).
            Each pair compares the first tensor of each output (a Hugging Face layer's hidden
            states, not its attention weights), and B's module is also run on A's recorded
            inputs (``capture(..., inputs=True)``; its positional first argument and the
            keyword arguments its ``forward`` names) to tell an origin from propagation
            (``PairDiff``, ``Comparison.first_origin``).
        tolerances: with ``pair=``, ``{precision: (atol, rtol)}`` replacing entries of
            ``TOLERANCES`` (``{"bfloat16": (0.05, 0.1)}``).
        transforms: with ``pair="auto"``, ``{pattern in A: transform}``: the output of those
            modules of A is ``transform``ed before ``auto`` pairs it (by the transformed
            shape) and before it is compared (``{"h.{i}.attn.c_attn": lambda t: t[..., :768]}``
            pairs GPT-2's fused QKV with a port's query projection). A transform that returns
            a tuple of tensors splits the output into pieces, each paired on its own
            (``lambda t: t.split(768, dim=-1)`` pairs the fused QKV's pieces ``c_attn[0]``,
            ``[1]``, ``[2]`` with the query, key and value projections).

    Returns:
        A ``Comparison``; ``.first_divergent`` is the first call outside tolerance, and with
        ``pair=`` ``.first_origin`` the first module that differs by itself.

    Raises:
        SelectorError: a pattern matches no module in one of the models.
        SelectorError: without ``pair=``, fewer than half of the smaller model's selected
            modules have a counterpart of the same name in the other model (a renamed port or
            two unrelated models; the message lists names of each side that found no partner
            and gives ``pair='auto'`` and name rules, with their ``hookscope diff --pair`` form).
        ArgumentTypeError, ArgumentValueError: at the call, before either model runs: ``atol``
            or ``rtol`` not a finite number >= 0; ``pair`` not ``"auto"``, a mapping or a
            function; ``tolerances`` not ``{precision: (atol, rtol)}`` of such numbers.
        HookscopeError: a model is TorchScript, or none of its selected modules' hooks fired
            (a ``torch.compile``'d model compiled earlier: the message gives the fix), or a
            selected output is a meta tensor or FakeTensor
            (no values); with ``pair="auto"``, fewer than half of the smaller run's calls
            found a partner; with a mapping or function, none did (the message names the
            unpaired modules of each side); ``transforms`` without ``pair="auto"``.
    """
    patterns = as_patterns(layers)
    _check_tolerances(atol, rtol, pair, tolerances)
    if pair is not None:
        return _compare_paired(model_a, model_b, args, kwargs, patterns, pair, transforms or {},
                               (atol, rtol), {**TOLERANCES, **(tolerances or {})})
    if transforms:
        raise HookscopeError("transforms= needs pair='auto': without pair= modules pair by "
                             "identical names and outputs are compared as they are")
    atol, rtol = 1e-5 if atol is None else atol, 1e-4 if rtol is None else rtol
    (targets_a, names_a), (targets_b, names_b) = _targets(model_a, patterns), _targets(model_b, patterns)
    common = [key for key in targets_a if key in targets_b]
    _require_pairs(targets_a, targets_b, common)
    reference: dict[Key, dict[Keys, Tensor]] = {}
    tokens: dict[Key, Tokens] = {}
    order: list[Key] = []

    watcher_a, watcher_b = MaskWatcher(unwrap(model_a)[0]), MaskWatcher(unwrap(model_b)[0])
    root_a, root_b = Target("", unwrap(model_a)[0]), Target("", unwrap(model_b)[0])  # OUTPUT's

    def keep(key: Key, output: Any) -> None:
        reference[key] = {k: t.detach().clone() for k, t in _values(key[0], output).items()}
        tokens[key] = watcher_a.tokens  # the tokens of the forward (the stack) that made it
        order.append(key)

    diffs: dict[Key, LayerDiff] = {}
    unmatched: list[str] = []

    def check(key: Key, output: Any) -> None:
        if key not in reference:
            unmatched.append(f"{key[0]}:{key[1]}")
            return
        a_values, b_values = reference.pop(key), _values(key[0], output)
        diff = _diff(key, _real(a_values, targets_a.get(key[0], root_a), tokens[key]),
                     _real(b_values, targets_b.get(key[0], root_b), watcher_b.tokens), atol, rtol)
        diffs[key] = dataclasses.replace(  # the shapes of the outputs, padding included
            diff, shape=next((tuple(t.shape) for t in a_values.values()), ()),
            shape_b=diff.shape_b and tuple(tuple(t.shape) for t in b_values.values()))

    session_a = _watched_forward(_watching(model_a, names_a, [targets_a[k] for k in common], keep),
                                 _token_watch(model_a, watcher_a), model_a, keep, args, kwargs)
    session_b = _watched_forward(_watching(model_b, names_b, [targets_b[k] for k in common], check),
                                 _token_watch(model_b, watcher_b), model_b, check, args, kwargs)
    _require_hooks_fired(model_a, not common or len(order) > 1)  # order always holds OUTPUT
    _require_hooks_fired(model_b, not common or len(diffs) + len(unmatched) > 1)
    unmatched += [f"{path}:{k}" for path, k in reference]
    return Comparison(diffs=tuple(diffs[key] for key in order if key in diffs),
                      unmatched=tuple(unmatched), atol=atol, rtol=rtol,
                      unfired={k: v for k, v in session_a.unfired.items() if k in session_b.unfired})


def _check_tolerances(atol: object, rtol: object, pair: object, tolerances: object) -> None:
    """``atol``/``rtol`` (None or finite numbers >= 0), ``pair``, and ``tolerances``
    (``{precision: (atol, rtol)}``), at the call: before either model runs."""
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is not None:
            check_number(name, value, minimum=0)
    check_pair(pair)
    if tolerances is None:
        return
    if not isinstance(tolerances, Mapping):
        raise ArgumentTypeError(f"tolerances must be a dict {{precision: (atol, rtol)}}, e.g. "
                                f"{{'float16': (1e-3, 1e-2)}}; got {type(tolerances).__name__}")
    for precision, pair_ in tolerances.items():
        if precision not in TOLERANCES:
            raise ArgumentValueError(f"tolerances[{precision!r}]: not a precision; use one of "
                                     f"{', '.join(TOLERANCES)}")
        if not isinstance(pair_, (tuple, list)) or len(pair_) != 2:
            raise ArgumentTypeError(f"tolerances[{precision!r}] must be a pair (atol, rtol), e.g. "
                                    f"(1e-3, 1e-2); got {pair_!r}")
        for name, value in zip(("atol", "rtol"), pair_, strict=True):
            check_number(f"tolerances[{precision!r}] {name}", value, minimum=0)


def _compare_paired(model_a: nn.Module, model_b: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any], patterns: list[str], spec: PairSpec,
                    transforms: Mapping[str, Transform],
                    given: tuple[float | None, float | None],
                    table: dict[str, tuple[float, float]]) -> Comparison:
    """``compare`` with ``pair=``: run both, pair their calls, compare each pair twice."""
    calls_a, outputs_a, acts_a, modules_a = _run(model_a, patterns, args, kwargs, transforms)
    calls_b, outputs_b, acts_b, modules_b = _run(model_b, patterns, args, kwargs, {})
    pairing = pair_calls(spec, calls_a, calls_b, transforms)
    _require_paired(pairing, calls_a, calls_b)
    diffs = []
    with untouched(model_b), torch.no_grad():
        for a, b, transform in pairing.pairs:
            out_a = outputs_a[(a.path, a.call)]
            out_a = None if out_a is None else dict(transformed(transform, out_a))[a.piece]
            precision = _precision(modules_a[a.path], modules_b[b.path], out_a,
                                   outputs_b[(b.path, b.call)])
            atol, rtol = (value if value is not None else default
                          for value, default in zip(given, table[precision]))
            key = (a.part, a.call)
            local, why = _local(model_b, modules_b[b.path], acts_a.inputs(a.path, a.call))
            # real tokens only: each value by its own module's layout and its run's mask
            tokens_a, tokens_b = acts_a.tokens(a.path, a.call), acts_b.tokens(b.path, b.call)
            real_a = _real_part(out_a, Target(a.path, modules_a[a.path]), tokens_a)
            real_b = _real_part(outputs_b[(b.path, b.call)], Target(b.path, modules_b[b.path]), tokens_b)
            real_local = _real_part(local, Target(b.path, modules_b[b.path]), tokens_a)
            shape = () if out_a is None else tuple(out_a.shape)
            diffs.append(PairDiff(
                a.part, b.path, a.call,
                dataclasses.replace(_diff(key, _parts(real_a), _parts(real_b), atol, rtol), shape=shape),
                None if local is None else dataclasses.replace(
                    _diff(key, _parts(real_a), _parts(real_local), atol, rtol), shape=shape),
                precision, atol, rtol, why))
    return Comparison(diffs=tuple(d.accumulated for d in diffs), unmatched=(),
                      atol=math.nan if given[0] is None else given[0],
                      rtol=math.nan if given[1] is None else given[1],
                      pairs=tuple(diffs), pairing=pairing)


def _real_part(value: Tensor | None, target: Target, tokens: Tokens) -> Tensor | None:
    """The real tokens of a paired value (``record.padding_dropped``), ``None`` for none."""
    return None if value is None else padding_dropped(value, target, tokens)


def _parts(t: Tensor | None) -> dict[Keys, Tensor]:
    return {} if t is None else {(): comparable(t, "compare")}


def _precision(module_a: nn.Module, module_b: nn.Module, *outputs: Tensor | None) -> str:
    """The lowest precision of a pair: ``"int8"`` for a module that is or holds a quantized
    module (a float block of dynamically quantized linears computes in int8) or a quantized
    output, else the lowest floating dtype of the outputs (``"float32"`` when none is floating)."""
    if any(".quantized" in type(sub).__module__ for m in (module_a, module_b) for sub in m.modules()) or \
            any(t is not None and t.is_quantized for t in outputs):
        return "int8"
    found = [str(t.dtype).removeprefix("torch.") for t in outputs
             if t is not None and t.is_floating_point()]
    return min((f for f in found if f in _PRECISION_ORDER), key=_PRECISION_ORDER.index,
               default="float32")


def _require_paired(pairing: Pairing, calls_a: list[Call], calls_b: list[Call]) -> None:
    """Raise when nothing paired, or with ``auto`` when fewer than half of the smaller run's
    calls did (two unrelated models: a table of a few chance pairs would mislead)."""
    paired = len({a.name for a, _, _ in pairing.pairs})
    if paired and (pairing.how != "auto" or 2 * paired >= min(len(calls_a), len(calls_b))):
        return
    raise HookscopeError(
        f"cannot compare: pair={pairing.how!r} paired {paired} of {len(calls_a)} calls of model "
        f"A with {len(calls_b)} of model B (unpaired in A: {_listed(pairing.unpaired_a)}; "
        f"unpaired in B: {_listed(pairing.unpaired_b)}). Pass a mapping naming the modules "
        f"that correspond, pair={{'h.{{i}}.attn': 'layers.{{i}}.attn'}}, or compare the "
        f"submodules that do, compare(model_a.encoder, model_b.backbone, x, pair='auto')")


def _listed(names: tuple[str, ...], most: int = 10) -> str:
    """``names`` as a list, the first ``most`` and how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{list(names[:most])}{more}"


def _require_pairs(targets_a: dict[str, Target], targets_b: dict[str, Target],
                   common: list[str]) -> None:
    """Raise unless at least half of the smaller side's selected modules pair by name (wrapper
    and adapter prefixes are not part of names, so a model and its DDP/compiled/PEFT version
    pair fully; an adapter's own modules, ``lora_A`` and the like, are simply unpaired)."""
    if 2 * len(common) >= min(len(targets_a), len(targets_b)):
        return
    only_a = [key for key in targets_a if key not in targets_b][:4]
    only_b = [key for key in targets_b if key not in targets_a][:4]
    raise SelectorError(
        f"cannot compare name by name: only {len(common)} of {len(targets_a)} selected modules "
        f"of model A and {len(targets_b)} of model B have the same name in both (only A: "
        f"{only_a}; only B: {only_b}). To compare two implementations (a renamed port), pair "
        f"their modules: by call order, output shape and kind, pair='auto' (hookscope diff "
        f"--pair auto), or by name rules, pair={{'h.{{i}}.attn': 'layers.{{i}}.attn'}} (hookscope "
        f"diff --pair 'h.{{i}}.attn=layers.{{i}}.attn'); or compare the submodules that "
        f"correspond, compare(model_a.encoder, model_b.backbone, x), or select names both have "
        f"with layers=[...] (--layers)")


def plot_errors(comparison: Comparison, file: str | os.PathLike[str]) -> Path:
    """Write a PNG of the error along the network: the accumulated and the local relative
    error (``||a - b|| / ||a||``) of each pair in call order, log scale, origins marked.

    Needs a comparison made with ``pair=`` (``comparison.pairs``). Zero errors are drawn at
    1e-12 (a log axis has no zero). Returns the file's path.

    Raises:
        HookscopeError: the comparison has no pairs (made without ``pair=``).
        MissingExtraError: matplotlib is not installed.
    """
    if not comparison.pairs:
        raise HookscopeError("plot_errors needs the pairs of compare(..., pair='auto' or a "
                             "mapping): this comparison paired modules by name only")
    figure = new_figure("plot_errors")
    axes = figure.add_subplot()
    steps = range(len(comparison.pairs))
    floor = 1e-12
    accumulated = [max(p.accumulated.rel, floor) for p in comparison.pairs]
    local = [max(p.local.rel, floor) if p.local is not None else math.nan for p in comparison.pairs]
    axes.semilogy(steps, accumulated, marker="o", label="accumulated (full runs)")
    axes.semilogy(steps, local, marker="x", label="local (B's module on A's inputs)")
    origins = [i for i, p in enumerate(comparison.pairs) if p.origin]
    axes.scatter(origins, [local[i] for i in origins], s=120, facecolors="none",
                 edgecolors="red", label="origin", zorder=3)
    axes.set_xticks(list(steps), [p.path_a for p in comparison.pairs], rotation=90, fontsize=6)
    axes.set_ylabel("relative error")
    axes.legend()
    figure.tight_layout()
    return save_figure(figure, Path(file))
