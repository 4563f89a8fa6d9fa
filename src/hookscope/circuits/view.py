"""A model's frozen view: the forward an attribution graph differentiates, on a model left as it is.

An attribution graph needs the model in eval mode, without gradients for its weights, and with
eager attention (the pattern is a tensor it can detach: ``replacement``). Switching the user's
model there and back for the call (``model.eval()``, ``requires_grad_(False)``,
``config._attn_implementation = "eager"``) changed it for every other thread using it meanwhile:
a thread serving requests ran them with eager attention and without weight gradients while a
graph was built (issue 47). ``frozen_view(model)`` gives the graph its own module tree instead:

- each module is a new object of the same class whose ``__dict__`` is a copy of the
  original's: children are their views, parameter and buffer tensors are shared (no weight is
  copied: a parameter becomes a ``requires_grad=False`` alias of the same storage), ``training``
  is False;
- each Hugging Face config a module holds is a copy (one per original config, sub-configs
  copied with it), with eager attention where it had another implementation;
- each hook table is a copy holding the hooks others registered (a user's, ``weight_norm``'s),
  without hookscope's: hooks registered on the view (the graph's own ``edit`` blocks) go into
  its tables only; a bound method of the original module kept in its ``__dict__`` (accelerate's
  ``forward`` and ``_old_forward``) is bound to the view.

A forward of the view computes what the model computes in eval mode with eager attention;
nothing another thread reads of the model (its config, flags, parameters' ``requires_grad``,
hook tables) changes.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

from torch import nn

from hookscope.engine import others_tables

__all__ = ["frozen_view"]


def frozen_view(model: nn.Module) -> nn.Module:
    """The frozen view of ``model`` (module docstring): same classes, paths and tensors, eval mode,
    weights without gradients, eager attention, the model's own hooks but not hookscope's."""
    return _Viewer().view(model)


class _Viewer:
    """Makes each module's view once (a module reached by two paths has one view)."""

    def __init__(self) -> None:
        self.views: dict[int, nn.Module] = {}
        self.parameters: dict[int, nn.Parameter] = {}
        self.configs: dict[int, Any] = {}
        self.memo: dict[int, Any] = {}  # one deepcopy memo: configs sharing a sub-config still do

    def view(self, module: nn.Module) -> nn.Module:
        found = self.views.get(id(module))
        if found is not None:
            return found
        twin: nn.Module = object.__new__(type(module))
        self.views[id(module)] = twin
        state = dict(module.__dict__)
        state["_modules"] = {name: None if child is None else self.view(child)
                             for name, child in module._modules.items()}
        state["_parameters"] = {name: self._parameter(p) for name, p in module._parameters.items()}
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        state.update(others_tables(module))  # the door's: its own hook tables, without ours
        state["training"] = False
        config = state.get("config")
        if config is not None and hasattr(config, "_attn_implementation"):
            state["config"] = self._config(config)
        for name, value in state.items():  # methods bound to the original (accelerate's forward)
            state[name] = _rebound(value, module, twin)
        twin.__dict__.update(state)
        return twin

    def _parameter(self, parameter: nn.Parameter | None) -> nn.Parameter | None:
        if parameter is None or type(parameter) is not nn.Parameter:  # a subclass (quantized) as is
            return parameter
        alias = self.parameters.get(id(parameter))
        if alias is None:  # tied weights stay one tensor
            alias = self.parameters[id(parameter)] = nn.Parameter(parameter.detach(), requires_grad=False)
        return alias

    def _config(self, config: Any) -> Any:
        twin = self.configs.get(id(config))
        if twin is None:
            twin = self.configs[id(config)] = copy.deepcopy(config, self.memo)
            if twin._attn_implementation not in (None, "eager"):
                twin._attn_implementation = "eager"  # its sub-configs too (transformers' setter)
        return twin


def _rebound(value: Any, module: nn.Module, twin: nn.Module) -> Any:
    """``value`` bound to ``twin`` where it is bound to ``module`` (a method, or a
    ``functools.partial`` whose first argument it is), else ``value``."""
    if isinstance(value, types.MethodType) and value.__self__ is module:
        return types.MethodType(value.__func__, twin)
    if isinstance(value, functools.partial) and value.args and value.args[0] is module:
        return functools.partial(value.func, twin, *value.args[1:], **value.keywords)
    return value
