"""One captured forward pass per tool, behind a common shape: a ``Case``.

A case's ``run()`` does everything a user pays for once: set up the capture, run the model, take
the capture down, and return what was kept. ``values(kept)`` gives ``{path: [tensor per call]}``
(the first tensor of each output) for checking the kept values against a reference, and
``tensors(kept)`` every kept tensor, for counting bytes. Peers are imported only when their case
is built, so a missing peer skips its cases (``PeerMissing``) instead of failing the run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor
Values = dict[str, list[Tensor | None]]


class PeerMissing(Exception):
    """A peer library is not installed in the running environment."""


@dataclass
class Case:
    """One way of capturing, ready to run.

    Attributes:
        name: row label, e.g. ``"hookscope, every module"``.
        tool: ``bare``, ``plain hooks``, ``hookscope``, ``nnsight``, ``TransformerLens`` or
            ``torchlens``.
        run: one captured forward pass; returns what the tool kept.
        tensors: every tensor in what ``run`` kept.
        values: ``{path: [first tensor of each call]}`` for the correctness check (``None`` for
            a call the tool refuses to return), or ``None`` when the tool's records do not map
            onto module paths.
        floor: name of the case that is this case's own bare forward (TransformerLens runs its
            own model), or ``None`` for the workload's bare forward only.
        note: what differs from the other tools' capture, for the table.
    """

    name: str
    tool: str
    run: Callable[[], Any]
    tensors: Callable[[Any], Iterable[Tensor]]
    values: Callable[[Any], Values] | None = None
    floor: str | None = None
    note: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def _first_tensor(obj: Any) -> Tensor:
    from hookscope.util.nested import iter_tensors

    return next(iter(iter_tensors(obj)))


def _all_tensors(obj: Any) -> Iterator[Tensor]:
    from hookscope.util.nested import iter_tensors

    yield from iter_tensors(obj)


def bare(model: nn.Module, *example: Any, name: str = "bare forward") -> Case:
    """The floor: the model's forward pass with nothing attached."""
    return Case(name, "bare", lambda: model(*example), lambda kept: ())


def plain_hooks(model: nn.Module, example: Sequence[Any], paths: Sequence[str], *,
                clone: bool = False, name: str) -> Case:
    """``register_forward_hook`` on each path, appending ``output.detach()`` (or ``.clone()``)."""
    modules = dict(model.named_modules())
    selected = [(path, modules[path]) for path in paths]

    def run() -> dict[str, list[Any]]:
        kept: dict[str, list[Any]] = {path: [] for path in paths}
        handles = []
        for path, module in selected:
            store = kept[path]
            if clone:
                def hook(m: nn.Module, args: Any, output: Any, store: list[Any] = store) -> None:
                    store.append(output.detach().clone() if isinstance(output, Tensor)
                                 else _detach_all(output, copy=True))
            else:
                def hook(m: nn.Module, args: Any, output: Any, store: list[Any] = store) -> None:
                    store.append(output.detach() if isinstance(output, Tensor)
                                 else _detach_all(output, copy=False))
            handles.append(module.register_forward_hook(hook))
        try:
            model(*example)
        finally:
            for handle in handles:
                handle.remove()
        return kept

    return Case(name, "plain hooks", run,
                lambda kept: (t for calls in kept.values() for c in calls for t in _all_tensors(c)),
                lambda kept: {p: [_first_tensor(c) for c in calls] for p, calls in kept.items()})


def hookscope_extract(model: nn.Module, example: Sequence[Any], layer: str, *, name: str,
                      **options: Any) -> Case:
    """``hookscope.extract`` of ``layer`` (mean-pooled) over the example batch into a temporary
    store, replaced on every run; keeps nothing (values are checked by the capture cases)."""
    import tempfile

    import hookscope

    folder = tempfile.mkdtemp(prefix="bench-extract-")
    data = torch.utils.data.TensorDataset(example[0])
    batch = int(example[0].shape[0])

    def run() -> None:
        hookscope.extract(model, data, layer, f"{folder}/store", reduce="mean", batch_size=batch,
                          overwrite=True, progress=False, **options)

    return Case(name, "hookscope", run, lambda kept: ())


def _detach_all(output: Any, *, copy: bool) -> Any:
    from hookscope.util.nested import map_tensors

    return map_tensors((lambda t: t.detach().clone()) if copy else (lambda t: t.detach()), output)


def hookscope_capture(model: nn.Module, example: Sequence[Any], patterns: Sequence[str], *,
                      name: str, first: bool = False, **options: Any) -> Case:
    """``hookscope.capture(model, *patterns, **options)`` around one forward pass.

    ``first=True`` names the row "first capture of the model": hookscope keeps no state per model
    or per process (in-place protection is copy-on-write per tensor), so every capture is a
    first capture and the row runs the same code; it stays to show that in the figures.
    """
    import hookscope

    del first  # nothing to forget: see above

    def run() -> Any:
        with hookscope.capture(model, *patterns, **options) as acts:
            model(*example)
        return acts

    def calls(acts: Any) -> Iterator[tuple[str, list[Any]]]:
        """Every call's output, ``None`` for one that hookscope refuses to return because it
        was overwritten in place (``clone=False``)."""
        for path in acts.paths:
            if path in acts:
                yield path, [_or_none(acts, path, k) for k in range(acts.counts[path])]

    return Case(name, "hookscope", run,
                lambda acts: (t for _, cs in calls(acts) for c in cs if c is not None
                              for t in _all_tensors(c)),
                lambda acts: {p: [None if c is None else _first_tensor(c) for c in cs]
                              for p, cs in calls(acts)},
                meta={"options": {k: str(v) for k, v in options.items()}})


def _or_none(acts: Any, path: str, call: int) -> Any:
    from hookscope import CaptureError

    try:
        return acts[path, call]
    except CaptureError:
        return None


def hookscope_attention(model: nn.Module, example: Sequence[Any], pattern: str, *,
                        name: str) -> Case:
    """``hookscope.attention(model, *example, layers=pattern)``: probabilities of each module."""
    import hookscope

    def run() -> dict[str, Tensor]:
        return hookscope.attention(model, *example, layers=pattern)

    return Case(name, "hookscope", run, lambda kept: kept.values(),
                note="recomputes (batch, heads, query, key) probabilities from the SDPA inputs")


def nnsight_trace(model: nn.Module, example: Sequence[Any], paths: Sequence[str], *,
                  name: str, note: str = "") -> Case:
    """``NNsight(model).trace(...)`` saving ``.output`` of each path, in execution order.

    ``NNsight(model)`` replaces the ``forward`` of every module with its own wrapper for good,
    which would slow every other case on the same model, so it wraps a deep copy. nnsight 0.8
    gives the first call of a module that runs several times in one forward pass; the others
    are not recorded.
    """
    try:
        from nnsight import NNsight
    except ImportError as err:
        raise PeerMissing(f"nnsight is not installed ({err})") from None
    wrapped = NNsight(copy.deepcopy(model))
    envoys = [wrapped.get(path) for path in paths]

    def run() -> list[Any]:
        saved: list[Any] = []
        with wrapped.trace(*example):
            for envoy in envoys:
                saved.append(envoy.output.save())
        return saved

    return Case(name, "nnsight", run,
                lambda saved: (t for s in saved for t in _all_tensors(s)),
                lambda saved: {p: [_first_tensor(s)] for p, s in zip(paths, saved)}, note=note)


def transformer_lens_cache(model: nn.Module, example: Sequence[Any],
                           names: Sequence[str] | None, *, name: str, floor: str) -> Case:
    """``HookedTransformer.run_with_cache``, on all hook points (``names=None``) or ``names``."""
    names_filter = None if names is None else list(names)

    def run() -> Any:
        _, cache = model.run_with_cache(*example, names_filter=names_filter)
        return cache

    return Case(name, "TransformerLens", run,
                lambda cache: (t for t in cache.cache_dict.values()), floor=floor,
                note="its own model; ratio to its own forward")


def torchlens_trace(model: nn.Module, example: Sequence[Any], layers: str | Sequence[str], *,
                    name: str, floor: str) -> Case:
    """``torchlens.trace`` saving ``layers`` (``"all"``: every tensor operation, or module paths).

    torchlens wraps torch functions on its first call and leaves them wrapped; run its cases in
    a process of their own.
    """
    try:
        import torchlens
        from torchlens.options import CaptureOptions
    except ImportError as err:
        raise PeerMissing(f"torchlens is not installed ({err})") from None
    options = CaptureOptions(layers_to_save=layers if isinstance(layers, str) else list(layers))

    def run() -> Any:
        return torchlens.trace(model, list(example), capture=options)

    def tensors(trace: Any) -> Iterator[Tensor]:
        for op in trace.layer_list:
            if getattr(op, "has_saved_activation", False) and isinstance(op.out, Tensor):
                yield op.out

    return Case(name, "torchlens", run, tensors, floor=floor,
                note="" if layers == "all" else "saves every op inside the selected modules")


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Return the bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
