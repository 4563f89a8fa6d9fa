"""One hook life cycle: the observe-only session behind compare, tree and find_nonfinite; edits
resolve each pattern once and say which form of callback they call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hookscope
from hookscope.diagnostics.module_tree import tree
from hookscope.engine.naming.names import ModuleIndex
from hookscope.engine.naming.selection import Target, as_patterns, resolve
from hookscope.engine.session import Observer
from tests.models import MlpStack, SharedLinear, UnusedBranch


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_compare_reports_modules_that_ran_in_neither_run() -> None:
    model = UnusedBranch()
    result = hookscope.compare(model, copy.deepcopy(model), torch.randn(2, 4))
    assert set(result.unfired) == {"relu", "aux_head"}
    assert "registered but never called" in result.unfired["relu"]
    assert [d.path for d in result.diffs] == ["backbone", "head", ""]


def test_compare_and_tree_errors_name_the_module_and_leave_no_hook() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Boom())
    with pytest.raises(ValueError, match="boom") as caught:
        hookscope.compare(model, copy.deepcopy(model), torch.randn(1, 3))
    assert any("raised inside '1' (Boom)" in note for note in caught.value.__notes__)
    with pytest.raises(ValueError, match="boom") as caught:
        tree(model, torch.randn(1, 3))
    assert any("raised inside '1' (Boom)" in note for note in caught.value.__notes__)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_observer_hooks_run_in_order_and_are_removed() -> None:
    model = MlpStack()
    seen: list[tuple[str, tuple[int, ...]]] = []
    targets = resolve(model, ["fc1", "fc2", "relu"])

    def forward(target: Target):  # type: ignore[no-untyped-def]
        return lambda module, args, output: seen.append((target.path, tuple(output.shape)))

    with Observer(model, targets, forward=forward, on_unfired="error") as session:
        model(torch.randn(4, 10))
    assert seen == [("fc1", (4, 20)), ("relu", (4, 20)), ("fc2", (4, 5))]
    assert session.unfired == {}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_observer_reports_a_silent_module_like_capture() -> None:
    model = UnusedBranch()
    with pytest.raises(hookscope.HookNeverFiredError, match="aux_head"):
        with Observer(model, resolve(model, ["aux_head", "head"]),
                      forward=lambda t: lambda *a: None, on_unfired="error"):
            model(torch.randn(2, 4))


def test_edit_resolves_each_pattern_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    real = resolve

    def counting(model: nn.Module, patterns: list[str], *, names: ModuleIndex) -> list[Target]:
        calls.append(list(patterns))
        return real(model, patterns, names=names)

    monkeypatch.setattr("hookscope.engine.session.resolve", counting)
    model = MlpStack()
    with hookscope.edit(model, {"fc1": lambda o: o * 0, "fc2": lambda o: o + 1}) as edits:
        out = model(torch.randn(2, 10))
    assert calls == [["fc1"], ["fc2"]] and edits.counts == {"fc1": 1, "fc2": 1}
    assert torch.equal(out, model.fc2.bias.detach().expand(2, 5) + 1)


def test_edit_context_form_is_explicit() -> None:
    model, x = SharedLinear(), torch.randn(2, 6)
    seen: list[tuple[str, int]] = []

    def fn(*args: object) -> None:  # takes any arity: only context=True gives it (path, call)
        seen.append(args[1:])  # type: ignore[arg-type]

    with hookscope.edit(model, {"lin": fn}):
        model(x)
    with hookscope.edit(model, {"lin": fn}, context=True):
        model(x)
    assert seen == [(), (), ("lin", 0), ("lin", 1)]


def test_edit_guessing_the_context_form_is_deprecated() -> None:
    model, x = SharedLinear(), torch.randn(2, 6)
    with pytest.warns(DeprecationWarning, match="context=True"):
        edit = hookscope.edit(model, {"lin": lambda output, path, call: None})
    with edit as edits:
        model(x)
    assert edits.counts == {"lin": 2}


@pytest.mark.parametrize(("given", "expected"), [("fc1", ["fc1"]), (["a", "b"], ["a", "b"]),
                                                  (("x",), ["x"])])
def test_as_patterns(given: str | list[str] | tuple[str, ...], expected: list[str]) -> None:
    assert as_patterns(given) == expected


def test_as_patterns_refuses_an_empty_list_naming_the_parameter() -> None:
    with pytest.raises(hookscope.EmptySelectionError, match=r"^patterns selects nothing \(got \[\]\)"):
        as_patterns([], "patterns")


def test_errors_users_meet_are_exported() -> None:
    from hookscope.errors import MissingExtraError, SpecError
    assert hookscope.SpecError is SpecError and hookscope.MissingExtraError is MissingExtraError


_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
           "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def _tables(model: nn.Module) -> dict[tuple[str, str], list[tuple[int, object]]]:
    return {(path, name): list(getattr(m, name).items()) for path, m in model.named_modules()
            for name in _TABLES}


def test_bulk_registered_hooks_run_after_the_users_and_leave_every_table_as_found() -> None:
    # hooks.ModuleHooks writes a session's entries into the tables directly, without a handle
    # each: the user's hooks run first, the calls are recorded, and exit leaves the tables
    # (ids, values, order, with_kwargs flags) exactly as before the block
    torch.manual_seed(0)
    model = MlpStack()
    order: list[str] = []
    users = [model.fc1.register_forward_hook(lambda m, a, o: order.append("user")),
             model.fc1.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)]
    before = _tables(model)
    x = torch.randn(3, 10)
    with hookscope.capture(model, "fc1", "fc2", inputs=True) as acts:
        assert _tables(model) != before  # the capture's entries, with_kwargs flags included
        model(x)
        assert order == ["user"]
    assert torch.equal(acts["fc1"], model.fc1(x))
    assert torch.equal(acts["fc2"], model(x))
    assert _tables(model) == before
    for handle in users:
        handle.remove()


def test_a_hook_the_user_adds_inside_a_bulk_registered_block_keeps_its_own_id_and_survives() -> None:
    # ModuleHooks.add_forward takes the ids of a whole capture at once: a hook registered
    # inside the block gets a later id, runs after the capture's, and stays after exit
    torch.manual_seed(0)
    model = MlpStack()
    seen: list[torch.Tensor] = []
    x = torch.randn(3, 10)
    with hookscope.capture(model, "**") as acts:
        taken = {key for m in model.modules() for key in m._forward_hooks}
        handle = model.fc2.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
        assert handle.id not in taken and handle.id > max(taken)
        model(x)
    assert list(model.fc2._forward_hooks) == [handle.id]
    model(x)
    assert len(seen) == 2 and torch.equal(seen[0], acts["fc2"]) and torch.equal(seen[1], seen[0])
    handle.remove()
