"""Every verb on a torch.compile'd model, hooks registered before the first compiled call (the
verb's own run compiles: eager values) and after it (the compiled code predates the hooks: the
verb says so with the fix, never a silent empty or wrong result). Cases 07 and 37."""

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
from hookscope.errors import EditError, HookNeverFiredWarning, HookscopeError
from tests.models import GeluMlp, MlpStack

Tensor = torch.Tensor
FIX = r"Call torch\._dynamo\.reset\(\) first"


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], list[str]]] = {
    "mlp": (MlpStack, lambda: torch.randn(3, 10), ["fc1", "fc2"]),
    "net": (GeluMlp, lambda: torch.randn(4, 8), ["l1", "act", "l3"]),
}
CASES = [("mlp", "eager"), ("net", "aot_eager")]


def _compiled(name: str, backend: str, warm: bool) -> tuple[nn.Module, nn.Module, Tensor, list[str]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    make, data, paths = MODELS[name]
    model, x = make().eval(), data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend=backend)
        if warm:  # compiles without hooks, with and without grad (the verbs use both), as
            # dynamo does with skip_nnmodule_hook_guards on (a user's own setting: code
            # compiled before hookscope's first block is recompiled, engine.compiled): that
            # code ignores hooks added later
            with hookscope.capture(model, paths[0], on_unfired="ignore"):  # dynamo set up first
                pass
            with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
                compiled(x)
                with torch.no_grad():
                    compiled(x)
    return model, compiled, x, paths


def _eager(model: nn.Module, x: Tensor, paths: list[str]) -> dict[str, Tensor]:
    modules = dict(model.named_modules())
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        model(x)  # plain reference: re-run each module on what feeds it
        hooks = [modules[p].register_forward_hook(
            lambda m, i, o, p=p: out.__setitem__(p, o.detach().clone())) for p in paths]
        model(x)
    for h in hooks:
        h.remove()
    return out


def _capture(compiled: nn.Module, x: Tensor, paths: list[str]) -> dict[str, Tensor]:
    with hookscope.capture(compiled, *paths) as acts:
        compiled(x)
    assert acts.counts == {p: 1 for p in paths}
    return {p: acts[p] for p in paths}


def _edit(compiled: nn.Module, x: Tensor, paths: list[str]) -> Tensor:
    with hookscope.edit(compiled, {paths[0]: lambda out: out * 0}), torch.no_grad():
        return compiled(x)


def _stats(compiled: nn.Module, x: Tensor, paths: list[str]) -> dict[str, float]:
    return {p: s.as_dict()["mean"] for p, s in stats(compiled, [x], layers=paths).items()}


def _tree(compiled: nn.Module, x: Tensor, paths: list[str]) -> dict[str, int]:
    return {row.path: row.calls for row in tree(compiled, x) if row.path in paths}


def _compare(compiled: nn.Module, x: Tensor, paths: list[str]) -> dict[str, float]:
    model = compiled._orig_mod  # type: ignore[union-attr]
    return {d.path: d.max_abs for d in compare(compiled, model, x, layers=paths).diffs}


VERBS: dict[str, Callable[[nn.Module, Tensor, list[str]], Any]] = {
    "capture": _capture, "edit": _edit, "stats": _stats, "tree": _tree, "compare": _compare}


def _expected(verb: str, model: nn.Module, x: Tensor, paths: list[str]) -> Any:
    eager = _eager(model, x, paths)
    if verb == "capture":
        return eager
    if verb == "edit":
        with hookscope.edit(model, {paths[0]: lambda out: out * 0}), torch.no_grad():
            return model(x)
    if verb == "stats":
        return {p: float(eager[p].double().mean()) for p in paths}
    return {p: 1 for p in paths} if verb == "tree" else {p: 0.0 for p in paths}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(("name", "backend"), CASES)
def test_hooks_before_the_first_compiled_call_give_eager_values(name: str, backend: str,
                                                               verb: str) -> None:
    model, compiled, x, paths = _compiled(name, backend, warm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's graph-break notices
        got = VERBS[verb](compiled, x, paths)
    expected = _expected(verb, model, x, paths)
    if isinstance(got, Tensor):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        assert set(got) >= set(paths)
        for p in paths:
            torch.testing.assert_close(torch.as_tensor(got[p]), torch.as_tensor(expected[p]),
                                       atol=1e-5, rtol=1e-5, check_dtype=False)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in compiled.modules())
    torch._dynamo.reset()


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(("name", "backend"), CASES)
def test_hooks_after_the_first_compiled_call_explain_with_the_fix(name: str, backend: str,
                                                                  verb: str) -> None:
    model, compiled, x, paths = _compiled(name, backend, warm=True)
    if verb in ("tree", "compare"):  # nothing to report but counts: refused
        with pytest.raises(HookscopeError, match=rf"torch\.compile'd model ran but none of its "
                                                 rf"modules' hooks fired.*{FIX}"):
            VERBS[verb](compiled, x, paths)
    elif verb == "edit":  # an edit that never applied: an error, never the unedited output
        with pytest.raises(EditError, match=rf"(?s)ran without its hooks.*{paths[0]} \(.*{FIX}"):
            VERBS[verb](compiled, x, paths)
    else:  # a warning naming each silent module and the fix; capture's counts stay honest
        with pytest.warns(HookNeverFiredWarning, match=FIX) as caught:
            try:
                VERBS[verb](compiled, x, paths)
            except AssertionError:
                assert verb == "capture"  # counts are 0, not invented
        message = str(caught[0].message)
        assert all(f"{p} (" in message for p in ([paths[0]] if verb == "edit" else paths))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in compiled.modules())
    torch._dynamo.reset()
    assert VERBS["capture"](compiled, x, paths).keys() == set(paths)  # the fix works
    torch._dynamo.reset()
