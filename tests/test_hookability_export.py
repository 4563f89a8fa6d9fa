"""torch.export: the flattened ``ep.module()`` is refused by every verb before anything runs
(its submodules are never called); ``torch.export.unflatten(ep)`` keeps the tree and every verb
gives the eager model's values; a block open while ``torch.export.export`` traces refuses."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from hookscope.diagnostics.comparison import compare
from hookscope.diagnostics.module_tree import tree
from hookscope.diagnostics.statistics import stats
from hookscope.errors import HookscopeError
from tests.models import MlpStack, Residual

Tensor = torch.Tensor


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.fc(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], list[str]]] = {
    "mlp": (MlpStack, lambda: torch.randn(3, 10), ["fc1", "relu", "fc2"]),
    "nested": (Nested, lambda: torch.randn(2, 6), ["blocks.0.fc", "blocks.1.act", "head"]),
    "residual": (lambda: nn.Sequential(Residual(nn.Sequential(nn.Linear(5, 5), nn.Tanh())),
                                       nn.Linear(5, 2)),
                 lambda: torch.randn(4, 5), ["0", "0.inner.0", "1"]),
}


def _exported(name: str) -> tuple[nn.Module, Tensor, list[str], torch.export.ExportedProgram]:
    torch.manual_seed(0)
    make, data, paths = MODELS[name]
    model, x = make().eval(), data()
    return model, x, paths, torch.export.export(model, (x,))


def _eager_outputs(model: nn.Module, x: Tensor, paths: list[str]) -> dict[str, Tensor]:
    with hookscope.capture(model, *paths) as acts, torch.no_grad():
        model(x)
    return {p: acts[p] for p in paths}


def _hooks(model: nn.Module) -> list[tuple[int, int]]:
    """Forward and pre-hook counts of every module (ep.module() has torch's own pre-hooks)."""
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def _no_hooks_left(model: nn.Module) -> bool:
    return all(counts == (0, 0) for counts in _hooks(model))


def _capture(model: nn.Module, x: Tensor, paths: list[str]) -> Any:
    with hookscope.capture(model, *paths) as acts:
        model(x)
    return acts


def _edit(model: nn.Module, x: Tensor, paths: list[str]) -> Any:
    with hookscope.edit(model, {paths[0]: lambda out: out * 0}):
        return model(x)


VERBS: dict[str, Callable[[nn.Module, Tensor, list[str]], Any]] = {
    "capture": _capture,
    "edit": _edit,
    "stats": lambda model, x, paths: stats(model, [x], layers=paths),
    "tree": lambda model, x, paths: tree(model, x),
    "compare": lambda model, x, paths: compare(model, model, x, layers=paths),
}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("name", list(MODELS))
def test_the_flattened_module_is_refused_before_anything_runs(name: str, verb: str) -> None:
    _, x, paths, ep = _exported(name)
    flat = ep.module()
    before = _hooks(flat)
    with pytest.raises(HookscopeError, match=r"exported program's flattened module.*their hooks "
                                             r"never fire.*torch\.export\.unflatten\(ep\)"):
        VERBS[verb](flat, x, paths)
    assert _hooks(flat) == before


@pytest.mark.parametrize("name", list(MODELS))
def test_every_verb_on_the_unflattened_tree_gives_the_eager_values(name: str) -> None:
    model, x, paths, ep = _exported(name)
    tree_module = torch.export.unflatten(ep)
    expected = _eager_outputs(model, x, paths)

    acts = VERBS["capture"](tree_module, x, paths)
    for path in paths:
        assert acts.counts[path] == 1
        torch.testing.assert_close(acts[path], expected[path], atol=1e-5, rtol=1e-5)

    with hookscope.edit(model, {paths[0]: lambda out: out * 0}), torch.no_grad():
        edited = model(x)
    torch.testing.assert_close(VERBS["edit"](tree_module, x, paths), edited, atol=1e-5, rtol=1e-5)

    got = VERBS["stats"](tree_module, x, paths)
    for path in paths:
        assert got[path].as_dict()["mean"] == pytest.approx(float(expected[path].double().mean()),
                                                            abs=1e-5)

    rows = {row.path: row for row in VERBS["tree"](tree_module, x, paths)}
    assert all(rows[p].calls == 1 for p in paths)

    diff = compare(tree_module, model, x, layers=paths)
    assert {d.path for d in diff.diffs} == {"", *paths} and all(d.max_abs <= 1e-5 for d in diff.diffs)
    assert _no_hooks_left(tree_module) and _no_hooks_left(model)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("verb", ["capture", "edit"])
def test_a_block_open_while_export_traces_refuses_instead_of_recording_fakes(verb: str,
                                                                              strict: bool) -> None:
    model, x, paths, _ = _exported("nested")
    block = (hookscope.capture(model, *paths) if verb == "capture"
             else hookscope.edit(model, {paths[0]: lambda out: out * 0}))
    # non-strict export runs the hook (HookscopeError); strict export traces it with dynamo,
    # which reports the hook's error (its type wrapped) with hookscope's message
    with pytest.raises(Exception, match=r"hooks see FakeTensors.*Export outside the with block") as raised:
        with warnings.catch_warnings(), block:
            warnings.simplefilter("ignore")
            torch.export.export(model, (x,), strict=strict)
    assert strict or isinstance(raised.value, HookscopeError)
    assert _no_hooks_left(model)
    acts = _capture(model, x, paths)  # the model is left as it was: the next capture is real
    torch.testing.assert_close(acts[paths[0]], model.blocks[0].fc(x).detach())
