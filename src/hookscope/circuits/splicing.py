"""Splicing dictionaries into a model: ``splice(model, {path: sae_or_transcoder})`` replaces what
each module returns with the dictionary's reconstruction, through ``edit`` (an SAE reads the
module's output, a transcoder its input), and keeps the feature activations of every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookscope.circuits.dictionary import Dictionary
from hookscope.editing import edit
from hookscope.engine import check_model
from hookscope.errors import CircuitError

__all__ = ["Splice", "module_input", "splice"]

Tensor = torch.Tensor


def module_input(args: tuple[Any, ...], kwargs: dict[str, Any], path: str) -> Tensor:
    """The one tensor a module (an MLP) was called with: its first positional argument, or its
    only tensor keyword argument.

    Raises:
        CircuitError: the call gave no tensor, or several keyword tensors and no positional one.
    """
    if args and isinstance(args[0], Tensor):
        return args[0]
    tensors = [v for v in kwargs.values() if isinstance(v, Tensor)]
    if len(tensors) != 1:
        raise CircuitError(f"{path!r} was called with {len(args)} positional arguments and keyword "
                           f"tensors {sorted(k for k, v in kwargs.items() if isinstance(v, Tensor))}: "
                           f"a transcoder reads one input tensor; splice it on a module called "
                           f"with one (the MLP)")
    return tensors[0]


class Splice:
    """The active splice that ``splice`` returns; a context manager.

    Attributes:
        features: ``{path: [activations of each call]}``, each ``(..., d_features)``, detached
            (the feature activations the dictionary computed, in call order).
    """

    def __init__(self, model: nn.Module, dictionaries: Mapping[str, Dictionary], keep_error: bool):
        self.features: dict[str, list[Tensor]] = {path: [] for path in dictionaries}
        self._stack = contextlib.ExitStack()
        self._model, self._dictionaries, self._keep_error = model, dict(dictionaries), keep_error
        self._inputs: dict[str, list[Tensor]] = {path: [] for path in dictionaries}

    def __enter__(self) -> Splice:
        readers = {p: d for p, d in self._dictionaries.items() if getattr(d, "reads", "output") == "input"}
        with self._stack as stack:
            if readers:
                stack.enter_context(edit(self._model, {p: self._stash(p) for p in readers}, inputs=True))
            stack.enter_context(edit(self._model, {p: self._replace(p) for p in self._dictionaries}))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool | None:
        return self._stack.__exit__(kind, error, traceback)

    def _stash(self, path: str) -> Any:
        def stash(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._inputs[path].append(module_input(args, kwargs, path))
        return stash

    def _replace(self, path: str) -> Any:
        dictionary = self._dictionaries[path]

        def replace(output: Any) -> Tensor:
            if not isinstance(output, Tensor):
                raise CircuitError(f"{path!r} returned {type(output).__name__}, not a tensor: splice "
                                   f"a dictionary on a module that returns one (the MLP, a block's "
                                   f"residual output given as 'path[0]')")
            source = self._inputs[path].pop() if getattr(dictionary, "reads", "output") == "input" \
                else output
            features = dictionary.encode(source)
            self.features[path].append(features.detach())
            reconstruction = dictionary.decode(features).to(output.dtype)
            if reconstruction.shape != output.shape:
                raise CircuitError(f"{type(dictionary).__name__} on {path!r} reconstructs "
                                   f"{tuple(reconstruction.shape)}, but the module returned "
                                   f"{tuple(output.shape)}: its d_out is {dictionary.d_out}")
            if self._keep_error:  # the exact output; gradients reach the features, not the error
                return output.detach() + (reconstruction - reconstruction.detach())
            return reconstruction
        return replace


def splice(model: nn.Module, dictionaries: Mapping[str, Dictionary], *,
           keep_error: bool = False) -> Splice:
    """Replace what modules return with their dictionary's reconstruction while the block runs.

    ```python
    with hookscope.splice(model, {"transformer.h.0.mlp": transcoder}) as spliced:
        logits = model(ids).logits
    spliced.features["transformer.h.0.mlp"][0]     # (batch, seq, d_features) activations
    ```

    An ``SAE`` reads the module's output and writes its reconstruction; a ``Transcoder``
    reads the module's input (a pre-hook keeps it) and writes its reconstruction in place of the
    output. Both go through ``hookscope.edit``; hooks are removed on exit.

    Args:
        model: the root module.
        dictionaries: ``{module path or pattern: SAE | Transcoder}``.
        keep_error: return the module's own output exactly (``output.detach() +
            (reconstruction - reconstruction.detach())``: the reconstruction error is kept as a
            constant, so the model computes what it computed without the splice, and gradients
            flow through the features only, as SAELens's ``use_error_term``).

    Returns:
        A ``Splice`` context manager (``.features``).

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Module``.
        CircuitError: a value that is not a ``Dictionary``; during the forward, a module that
            returns no tensor or a reconstruction of another shape.
        SelectorError: a path that matches no module.
    """
    check_model(model)
    if not isinstance(dictionaries, Mapping):
        raise CircuitError(f"dictionaries must be {{path: SAE or Transcoder}}, not "
                           f"{type(dictionaries).__name__}")
    for path, dictionary in dictionaries.items():
        if not isinstance(dictionary, Dictionary):
            raise CircuitError(f"dictionaries takes {{path: SAE or Transcoder}}, but {path!r} maps to "
                               f"{type(dictionary).__name__}: build one with hookscope.Transcoder"
                               f"(W_enc=..., ...) or hookscope.load_sae(folder)")
    return Splice(model, dictionaries, keep_error)
