"""Selection on wrapped models is selection on the model (issue 46 item 1): on
``torch.compile``'s ``_orig_mod``, ``DataParallel``/DDP ``module``, FSDP's
``_fsdp_wrapped_module`` (at every depth), checkpoint wrappers, Opacus' ``_module`` and peft's
``base_model.model``, a pattern selects exactly the modules (names and objects) it selects on the
unwrapped model, and a steer changes the output exactly as on the eager model. Generated: nested
models x glob/regex/type patterns x every wrapper kind (``tests/wrapped_models.py``)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import SelectorError
from tests.wrapped_models import (
    WRAPPERS,
    D,
    build,
    patterns,
    specs,
    unwrapped_reference,
    visible_names,
)

_SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                     max_examples=30)


@pytest.fixture(scope="module", autouse=True)
def _group(process_group: None) -> None:
    """tests/conftest.py's gloo group of one process, for DDP and FSDP in every test here."""


def _selected(model: nn.Module, pattern: str) -> dict[str, nn.Module] | str:
    """``select``'s ``{path: module}``, or ``"SelectorError"`` when it refuses."""
    try:
        return hookscope.select(model, pattern)
    except SelectorError:
        return "SelectorError"


def _same(got: dict[str, nn.Module] | str, expected: dict[str, nn.Module] | str) -> None:
    if isinstance(expected, str) or isinstance(got, str):
        assert got == expected
        return
    assert list(got) == list(expected)  # the same names, in the same order
    assert all(got[path] is expected[path] for path in expected)  # the same module objects


def _needs(kind: str) -> None:
    if kind == "opacus":
        pytest.importorskip("opacus")
    if kind == "peft":
        pytest.importorskip("peft")


@pytest.mark.parametrize("kind", list(WRAPPERS))
@_SETTINGS
@given(data=st.data())
def test_a_pattern_selects_on_a_wrapped_model_what_it_selects_on_the_model(kind: str, data: Any) -> None:
    _needs(kind)
    model = build(data.draw(specs(), label="model"))
    chosen = data.draw(st.lists(patterns(visible_names(model)), min_size=1, max_size=4), label="patterns")
    wrap, _ = WRAPPERS[kind]
    expected = {p: _selected(model, p) for p in chosen}  # before: FSDP, checkpointing wrap in place
    wrapped = wrap(model)
    reference = unwrapped_reference(kind, wrapped)
    if reference is not None:  # peft injected its layers: compare with the model it holds now
        expected = {p: _selected(reference, p) for p in chosen}
    for pattern in chosen:
        _same(_selected(wrapped, pattern), expected[pattern])
    # every module once, and each module object under its unwrapped name
    _same(_selected(wrapped, "**"), _selected(reference if reference is not None else model, "**"))


def test_the_issues_example_compiled_and_dataparallel() -> None:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(2, 2)) for _ in range(3)))
    assert list(hookscope.select(model, "*.0")) == ["0.0", "1.0", "2.0"]
    for wrapped in (torch.compile(model, backend="eager"), nn.DataParallel(model)):
        assert list(hookscope.select(wrapped, "*.0")) == ["0.0", "1.0", "2.0"]  # not also '0'


def test_names_written_with_wrapper_segments_still_select() -> None:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2)))
    parallel = nn.DataParallel(model)
    assert list(hookscope.select(parallel, "module.*.0")) == ["0.0", "1.0"]
    assert list(hookscope.select(parallel, "re:module\\.\\d\\.1")) == ["0.1", "1.1"]
    assert list(hookscope.select(parallel, "module.1.0")) == ["1.0"]
    # a wildcard never stands for the wrapper's segment: '*.*.0' names nothing in the model
    with pytest.raises(SelectorError):
        hookscope.select(parallel, "*.*.0")
    with pytest.raises(SelectorError):
        hookscope.select(model, "*.*.0")


def test_the_models_own_child_named_like_a_wrapper_segment_keeps_its_name() -> None:
    class Holder(nn.Module):  # its child is called 'module', but its output is its own
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.out = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.module(x))

    model = Holder()
    parallel = nn.DataParallel(model)
    for pattern in ("module", "module.weight", "*", "re:mod.*"):
        _same(_selected(parallel, pattern), _selected(model, pattern))
    assert hookscope.select(parallel, "module") == {"module": model.module}


@pytest.mark.parametrize("kind", list(WRAPPERS))
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, max_examples=8)
@given(data=st.data())
def test_a_steer_on_a_wrapped_model_equals_the_steer_on_the_eager_model(kind: str, data: Any) -> None:
    _needs(kind)
    torch.manual_seed(0)
    model = build(data.draw(specs(), label="model")).eval()
    pattern = data.draw(patterns(visible_names(model)), label="pattern")
    eager = copy.deepcopy(model)
    if "compile" in kind:
        torch._dynamo.reset()  # each model compiled afresh, not past dynamo's recompile limit
    wrap, _ = WRAPPERS[kind]
    wrapped = wrap(model)
    reference = unwrapped_reference(kind, wrapped)
    if reference is not None:  # peft: LoRA B starts at zero, yet its layers are new modules
        eager = copy.deepcopy(reference)
    selected = _selected(eager, pattern)
    if isinstance(selected, str) or any(".lora_" in path for path in selected):
        return  # a pattern that selects nothing (both refuse: the test above); LoRA's rank-2 inner
        # layers, which a (D,) vector does not fit
    x = torch.randn(3, D)
    vector = torch.linspace(-0.5, 0.5, D)
    with torch.no_grad():
        plain = eager(x)
        expected = _plain_steer(eager, list(selected), vector, x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP's and opacus' own notes
            with hookscope.steer(wrapped, {pattern: vector}, on_unfired="error"):
                got = wrapped(x)
            after = wrapped(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after, plain, rtol=1e-5, atol=1e-6)  # the steer is gone


def _plain_steer(model: nn.Module, paths: list[str], vector: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The steer by hand: plain forward hooks adding ``vector`` to each selected output."""
    modules = dict(model.named_modules())
    handles = [modules[p].register_forward_hook(lambda m, a, out: out + vector) for p in paths]
    try:
        return model(x)  # type: ignore[no-any-return]
    finally:
        for handle in handles:
            handle.remove()


# ------------------------------------------------------------------ every verb, one pattern
def _issue_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(3)))


@pytest.mark.parametrize("kind", ["compile", "dataparallel", "ddp", "fsdp", "opacus", "peft"])
def test_every_verb_on_a_wrapped_model_acts_on_what_the_pattern_selects_unwrapped(
        kind: str, tmp_path: Any) -> None:
    """'*.0' (the issue's glob, which also matched the wrapper's own segment) in capture, edit,
    steer, ablate, patch, stats, monitor and extract: the same records, outputs and statistics
    as on the eager model."""
    _needs(kind)
    model = _issue_model()
    wrap, _ = WRAPPERS[kind]
    eager = copy.deepcopy(model)
    wrapped = wrap(model)
    reference = unwrapped_reference(kind, wrapped)
    if reference is not None:
        eager = copy.deepcopy(reference)
    x, source = torch.randn(5, D), torch.randn(5, D)
    pattern, expected = "*.0", ["0.0", "1.0", "2.0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's, opacus' and peft's own notes
        outputs = {name: [_verb(m, name, pattern, x, source, tmp_path / f"{name}-{i}")
                          for i, m in enumerate((wrapped, eager))]
                   for name in ("capture", "edit", "steer", "ablate", "patch", "stats", "extract")}
        assert list(hookscope.select(wrapped, pattern)) == expected
        for name, (got, want) in outputs.items():
            assert type(got) is type(want), name
            if isinstance(want, dict):
                assert list(got) == list(want) == expected, name
                for path in want:
                    torch.testing.assert_close(got[path], want[path], rtol=1e-5, atol=1e-6)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        watched = _monitored(wrapped, pattern, x)
    assert list(watched) == expected


def _verb(model: nn.Module, verb: str, pattern: str, x: torch.Tensor, source: torch.Tensor,
          out: Any) -> Any:
    """What one verb gives on ``model`` with ``pattern``: records, an output or statistics."""
    with torch.no_grad():
        if verb == "capture":
            with hookscope.capture(model, pattern) as acts:
                model(x)
            return {p: acts[p] for p in acts.paths}
        if verb == "stats":
            found = hookscope.stats(model, [x, source], pattern)
            return {p: s.mean for p, s in found.items()}
        if verb == "extract":
            store = hookscope.extract(model, [(x,)], pattern, out, progress=False)
            return {layer: store[layer][:] for layer in store.layers}  # type: ignore[attr-defined]
        if verb == "patch":
            with hookscope.capture(model, pattern) as acts:
                model(source)
            context = hookscope.patch(model, source=acts, layers=pattern)
        else:
            context = {"edit": lambda: hookscope.edit(model, {pattern: lambda out: out * 2}),
                       "steer": lambda: hookscope.steer(model, {pattern: torch.linspace(-1, 1, D)}),
                       "ablate": lambda: hookscope.ablate(model, pattern)}[verb]()
        with context:
            return model(x)


def _monitored(model: nn.Module, pattern: str, x: torch.Tensor) -> dict[str, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with hookscope.monitor(model, pattern, every=1, optimizer=optimizer) as mon:
        model(x).pow(2).sum().backward()
        optimizer.step()
    return mon.latest
