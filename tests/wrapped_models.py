"""Generated nested models, glob patterns over their names, and every kind of wrapper a framework
puts around a model (tests/test_wrapped_selection.py, issue 46 "selection on wrapped models").

A model is a tree of ``Chain`` s (named children called in order) and ``nn.Sequential`` s over
leaves (``Linear(D, D)``, ``ReLU``, ``Tanh``), every module mapping ``(batch, D)`` to
``(batch, D)``, so any selection can be steered by one ``(D,)`` vector. Child names come from a
small alphabet that repeats across levels (``fc``, ``0``, ``a``), so globs match at several depths,
and never a wrapper's conventional attribute (``module``, ``model``, ``_orig_mod``), which the
wrappers add.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

D = 4
NAMES = ("a", "b", "fc", "act", "0", "1", "net", "h")


class Chain(nn.Module):
    """Named children called one after the other (a user's block)."""

    def __init__(self, children: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, child in children:
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self._modules.values():
            assert child is not None
            x = child(x)
        return x


def _leaf(kind: str) -> nn.Module:
    return {"linear": lambda: nn.Linear(D, D), "relu": nn.ReLU, "tanh": nn.Tanh}[kind]()


def _spec(depth: int) -> st.SearchStrategy[Any]:
    leaf = st.sampled_from(["linear", "linear", "relu", "tanh"])
    if depth == 0:
        return leaf
    inner = _spec(depth - 1)
    chain = st.lists(st.tuples(st.sampled_from(NAMES), inner), min_size=1, max_size=3,
                     unique_by=lambda item: item[0]).map(lambda items: ("chain", items))
    sequential = st.lists(inner, min_size=1, max_size=3).map(lambda items: ("seq", items))
    return st.one_of(leaf, chain, sequential)


def build(spec: Any) -> nn.Module:
    """The module a spec (from ``specs()``) describes, with a Linear first so it has weights."""
    if isinstance(spec, str):
        return _leaf(spec)
    kind, items = spec
    if kind == "seq":
        return nn.Sequential(*(build(item) for item in items))
    return Chain([(name, build(item)) for name, item in items])


def specs() -> st.SearchStrategy[Any]:
    """A root ``Chain`` (an input Linear first: every model has a weight) of nested children."""
    body = st.lists(st.tuples(st.sampled_from(NAMES), _spec(2)), min_size=1, max_size=3,
                    unique_by=lambda item: item[0])
    return body.map(lambda items: ("chain", [("inp", "linear"), *items]))


@st.composite
def patterns(draw: st.DrawFn, names: list[str]) -> str:
    """A glob or regex: a real path with some segments made wild (``*``, ``**``, ``?``), a
    segment pattern from the alphabet at any depth, a ``type:`` or an ``re:`` pattern."""
    kind = draw(st.sampled_from(["wild", "wild", "deep", "type", "regex", "partial"]))
    if kind == "type":
        return "type:" + draw(st.sampled_from(["Linear", "ReLU", "Tanh", "Sequential", "Chain"]))
    if kind == "deep":
        return "**." + draw(st.sampled_from(NAMES)) + draw(st.sampled_from(["", ".*", ".**"]))
    path = draw(st.sampled_from(names))
    segments = path.split(".")
    if kind == "regex":
        return "re:" + r"\.".join(s if draw(st.booleans()) else r"[^.]+" for s in segments)
    if kind == "partial":
        return ".".join(s[:-1] + "?" if len(s) > 1 and draw(st.booleans()) else s for s in segments)
    return ".".join(draw(st.sampled_from(["*", "*", "**", s])) for s in segments)


# ---------------------------------------------------------------------------------- wrappers
def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


def _dataparallel(model: nn.Module) -> nn.Module:
    return nn.DataParallel(model)  # on the CPU: calls the module


def _ddp(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model)


def _fsdp(model: nn.Module) -> nn.Module:
    """FSDP v1 around the root and every ``Chain`` below it (``_fsdp_wrapped_module`` at depth)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Chain}),
                                        device_id=torch.device("cpu"))


def _checkpointed(model: nn.Module) -> nn.Module:
    """``checkpoint_wrapper`` around every ``Chain`` below the root, then ``DataParallel`` around
    it: wrappers at two depths, of two kinds."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, Chain):
                parent._modules[name] = checkpoint_wrapper(child)
    return nn.DataParallel(model)


def _opacus(model: nn.Module) -> nn.Module:
    from opacus import GradSampleModule
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GradSampleModule(model)


def _peft(model: nn.Module) -> nn.Module:
    """peft's ``PeftModel`` -> ``LoraModel`` -> the model, LoRA injected into the Linear layers
    whose name ends in ``fc``; peft then has nothing to wrap the model in when there is none."""
    from peft import LoraConfig, get_peft_model
    targets = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, LoraConfig(r=2, target_modules=targets[:1]))  # type: ignore[no-any-return]


def _nested(model: nn.Module) -> nn.Module:
    return nn.DataParallel(_compiled(model))


# kind -> (wrap, needs a process group)
WRAPPERS: dict[str, tuple[Callable[[nn.Module], nn.Module], bool]] = {
    "compile": (_compiled, False), "dataparallel": (_dataparallel, False),
    "ddp": (_ddp, True), "fsdp": (_fsdp, True), "checkpoint+dataparallel": (_checkpointed, False),
    "opacus": (_opacus, False), "peft": (_peft, False), "dataparallel(compile)": (_nested, False),
}


def unwrapped_reference(kind: str, wrapped: nn.Module) -> nn.Module | None:
    """The model to compare with after wrapping when the wrapper changed it in place: peft's
    injected model (``get_base_model()``); None when the model before wrapping is the reference."""
    if kind == "peft":
        return wrapped.get_base_model()  # type: ignore[operator,no-any-return]
    return None


def visible_names(model: nn.Module) -> list[str]:
    """Paths of a model that holds no wrapper: ``named_modules()`` without the root."""
    return [name for name, _ in model.named_modules() if name]


def is_wrapper_segment(segment: str) -> bool:
    return re.fullmatch(r"module|model|base_model|_orig_mod|_\w+_module", segment) is not None
