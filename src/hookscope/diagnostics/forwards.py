"""The watched forwards of a comparison: each model run once, its hooks handing outputs to a sink.

``compare`` runs model A, keeping its selected outputs, then model B, comparing its outputs as
they come (``comparison.py``); with ``pair=`` each run is one ``_run`` that records its calls
and inputs, and B's module can be run again on A's inputs (``_local``). The inputs are cast to
each model's dtype and device (``_cast_inputs``), and each run leaves its model as it was found
(``engine.run.untouched``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hookscope.diagnostics.differences import Key
from hookscope.diagnostics.pairing import (
    Call,
    Transform,
    fingerprint,
    kind,
    transform_for,
    transformed,
    weights,
)
from hookscope.engine import (
    MaskWatcher,
    ModuleIndex,
    Observer,
    Target,
    comparable,
    explain_no_hooks,
    input_device,
    resolve_checked,
    untouched,
    unwrap,
)
from hookscope.errors import HookscopeError
from hookscope.record import CallInputs, capture
from hookscope.util import get_part, iter_tensors, map_tensors

__all__ = ["OUTPUT"]

Tensor = torch.Tensor
OUTPUT = ""  # the path under which the models' own return values are compared


def _run(model: nn.Module, patterns: list[str], args: tuple[Any, ...], kwargs: dict[str, Any],
         transforms: Mapping[str, Transform]
         ) -> tuple[list[Call], dict[Key, Tensor | None], Any, dict[str, nn.Module]]:
    """One run of ``model``: its calls in completion order (shape and sample of each first
    output tensor after its transform, if any), the first output tensor of each (cloned, as
    returned), the capture holding each call's inputs, and ``{path: module}``."""
    targets, names = resolve_checked(model, patterns)
    targets = [t for t in targets if t.op is None and not t.parts and t.path]
    calls: list[Call] = []
    outputs: dict[Key, Tensor | None] = {}

    def keep(key: Key, output: Any) -> None:
        first = next(iter(iter_tensors(output)), None)
        outputs[key] = None if first is None else first.detach().clone()
        if first is None:
            calls.append(Call(key[0], key[1], kind(modules[key[0]]), (), None, signatures[key[0]]))
            return
        seen = transformed(transform_for(transforms, key[0]), comparable(first, key[0]))
        for piece, tensor in seen:  # a piece of a split has no weights of its own
            calls.append(Call(key[0], key[1], kind(modules[key[0]]), tuple(tensor.shape),
                              fingerprint(tensor), signatures[key[0]] if piece is None else None,
                              piece))

    modules = {t.key: t.module for t in targets}
    signatures = weights(modules)
    with untouched(model), torch.no_grad(), \
            capture(model, *modules, inputs=True, clone=True, on_unfired="ignore") as acts, \
            _watching(model, names, targets, keep):
        model(*_cast_inputs(model, args), **_cast_inputs(model, kwargs))
    _require_hooks_fired(model, bool(calls))
    return calls, outputs, acts, modules


def _local(model_b: nn.Module, module: nn.Module, inputs: CallInputs) -> tuple[Tensor | None, str]:
    """``module`` of model B run on model A's recorded inputs: its first output tensor, or
    ``(None, why)`` when it cannot take them."""
    parameters = inspect.signature(module.forward).parameters
    first = next(iter(parameters), None)
    named = {k: v for k, v in inputs.named.items() if k in parameters and k != first}
    try:
        output = module(*_cast_inputs(model_b, ([inputs[0]] if inputs.named else []) if first
                                     else []), **_cast_inputs(model_b, named))
    except (TypeError, RuntimeError, ValueError, IndexError, AttributeError) as err:
        return None, f"{type(err).__name__}: {err}"
    found = next(iter(iter_tensors(output)), None)
    return (None, "it returned no tensor") if found is None else (found.detach(), "")


def _require_hooks_fired(model: nn.Module, fired: bool) -> None:
    why = explain_no_hooks(model)
    if not fired and why is not None:
        raise HookscopeError(f"cannot compare: {why}")


def _targets(model: nn.Module, patterns: list[str]) -> tuple[dict[str, Target], ModuleIndex]:
    """``({record name: target}, the index they were resolved on)``."""
    targets, names = resolve_checked(model, patterns)
    return {t.key: t for t in targets}, names


def _watched_forward(session: Observer, tokens: Observer, model: nn.Module,
                     sink: Callable[[Key, Any], None], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Observer:
    """Run ``model`` once on the inputs (cast to its dtype) in ``session`` and ``tokens`` (its
    ``_token_watch``), without gradients, leaving the model as it was (``untouched``);
    ``sink`` gets its output; return ``session``."""
    with untouched(model), torch.no_grad(), tokens, session:
        sink((OUTPUT, 0), _call(model, args, kwargs))
    return session


def _token_watch(model: nn.Module, watcher: MaskWatcher) -> Observer:
    """A session keeping ``watcher.tokens`` those of the running forward: its pre-hooks on the
    root and an encoder-decoder's stacks (``engine.values.layout.MaskWatcher``)."""
    roots = [Target(path, module) for path, module in watcher.modules]
    return Observer(unwrap(model)[0], roots, pre=lambda t: watcher.hook, with_kwargs=True,
                    explain_unfired=False)


def _call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return model(*_cast_inputs(model, args), **_cast_inputs(model, kwargs))


def _watching(model: nn.Module, names: ModuleIndex, targets: list[Target],
              sink: Callable[[Key, Any], None]) -> Observer:
    """A session calling ``sink((key, k), output)`` as call ``k`` of each target's module returns."""
    counts = {t.key: 0 for t in targets}

    def hook_for(target: Target) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            counts[target.key] += 1
            part = get_part(output, target.parts) if target.parts else output
            sink((target.key, counts[target.key] - 1), part)
        return hook

    return Observer(model, targets, forward=hook_for, names=names)


def _cast_inputs(model: nn.Module, inputs: Any) -> Any:
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    if parameter is None:
        return inputs
    device = input_device(model)  # not the parameter's: it is on meta under accelerate's offload
    return map_tensors(lambda t: t.to(device, parameter.dtype)
                       if t.is_floating_point() else t.to(device), inputs)
