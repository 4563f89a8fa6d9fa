"""Selection language: paths, state_dict keys, globs, regex, types, wrappers, containers."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from hookscope import SelectorError
from hookscope.engine.naming.selection import resolve
from tests.models import LeNet, MlpStack, ModuleListBlocks, TupleOutput


def test_exact_path_and_state_dict_key_resolve_to_the_same_conv() -> None:
    model = ModuleListBlocks()
    by_path = hookscope.select(model, "pos_block.3.proj.0")
    by_key = hookscope.select(model, "pos_block.3.proj.0.weight")
    assert list(by_path) == list(by_key) == ["pos_block.3.proj.0"]
    assert by_path["pos_block.3.proj.0"] is model.pos_block[3].proj[0]


def test_buffer_key_resolves_to_its_module() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert list(hookscope.select(model, "1.running_mean")) == ["1"]


def test_glob_one_segment_matches_each_block() -> None:
    model = ModuleListBlocks()
    assert list(hookscope.select(model, "pos_block.*.proj.0")) == [f"pos_block.{i}.proj.0" for i in range(4)]
    assert list(hookscope.select(model, "pos_block.*")) == [f"pos_block.{i}" for i in range(4)]


def test_double_star_matches_any_depth_and_skips_containers() -> None:
    model = ModuleListBlocks()
    every = hookscope.select(model, "**")
    names = [n for n, _ in model.named_modules() if n and n != "pos_block"]
    assert list(every) == names
    assert list(hookscope.select(model, "**.proj.0")) == [f"pos_block.{i}.proj.0" for i in range(4)]
    assert list(hookscope.select(model, "**.0"))[:2] == ["pos_block.0", "pos_block.0.proj.0"]
    assert "pos_block" not in every


def test_regex_and_type_patterns() -> None:
    model = LeNet()
    assert list(hookscope.select(model, r"re:conv\d")) == ["conv1", "conv2"]
    assert list(hookscope.select(model, "type:Conv2d")) == ["conv1", "conv2"]
    assert list(hookscope.select(model, "type:torch.nn.modules.linear.Linear")) == ["fc1", "fc2"]
    # subclasses count: a Conv2d subclass matches type:Conv2d
    class MyConv(nn.Conv2d):
        pass
    seq = nn.Sequential(MyConv(1, 1, 1), nn.ReLU())
    assert list(hookscope.select(seq, "type:Conv2d")) == ["0"]


def test_results_follow_named_modules_order_without_duplicates() -> None:
    model = LeNet()
    assert list(hookscope.select(model, "fc2", "conv1", "fc2", "conv*")) == ["conv1", "conv2", "fc2"]


def test_modulelist_named_exactly_raises_with_children_pattern() -> None:
    model = ModuleListBlocks()
    fix = r"select 'pos_block\.\*' \(matches 4 modules: pos_block\.0 … pos_block\.3, PosBlock\)"
    with pytest.raises(SelectorError, match=fix) as err:
        hookscope.select(model, "pos_block")
    assert "torch.nn.modules.container.ModuleList" in str(err.value)
    assert isinstance(err.value, LookupError)


def test_moduledict_named_exactly_raises() -> None:
    model = nn.Module()
    model.heads = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    with pytest.raises(SelectorError, match=r"select 'heads\.\*' \(matches 2 modules"):
        hookscope.select(model, "heads")


def test_unknown_name_suggests_close_names() -> None:
    with pytest.raises(SelectorError, match=r"did you mean 'conv2'"):
        hookscope.select(LeNet(), "conv3")
    with pytest.raises(SelectorError, match=r"did you mean 'pos_block\.3\.proj\.0'"):
        hookscope.select(ModuleListBlocks(), "model.pos_block.3.proj.0")


def test_glob_matching_nothing_says_so() -> None:
    with pytest.raises(SelectorError, match=r"pattern 'blocks\.\*' matched no module"):
        hookscope.select(LeNet(), "blocks.*")


def test_bad_regex_is_a_selector_error() -> None:
    with pytest.raises(SelectorError, match="not a valid regular expression"):
        hookscope.select(LeNet(), "re:conv(")


def test_dataparallel_prefix_is_transparent() -> None:
    net = MlpStack()
    dp = nn.DataParallel(net)
    assert hookscope.select(dp, "fc1") == {"fc1": net.fc1}
    assert hookscope.select(dp, "module.fc1") == {"fc1": net.fc1}
    assert hookscope.select(dp, "module.fc1.weight") == {"fc1": net.fc1}


def test_compiled_prefix_is_transparent() -> None:
    net = MlpStack()
    compiled = torch.compile(net, backend="eager")
    assert hookscope.select(compiled, "_orig_mod.fc2") == {"fc2": net.fc2}
    assert hookscope.select(compiled, "fc2") == {"fc2": net.fc2}


def test_output_parts_in_brackets() -> None:
    model = TupleOutput()
    (target,) = resolve(model, ["lstm[1][0]"])
    assert (target.path, target.parts, target.key) == ("lstm", (1, 0), "lstm[1][0]")


def test_bracket_index_naming_a_child_selects_the_child() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    (target,) = resolve(model, ["0[1]"])
    assert (target.path, target.parts) == ("0.1", ())


def test_no_pattern_is_an_error() -> None:
    with pytest.raises(SelectorError, match=r"layers selects nothing .* give at least one, e\.g\. 'conv2'"):
        hookscope.select(LeNet())


def test_type_pattern_matching_nothing_lists_the_classes() -> None:
    with pytest.raises(SelectorError, match=r"did you mean 'type:Conv2d'\? the classes in this model are "
                                            r"Conv2d, Linear, MaxPool2d"):
        hookscope.select(LeNet(), "type:Conv3d")


def test_glob_hint_is_only_given_for_a_bare_name() -> None:
    with pytest.raises(SelectorError, match=r"'\*\*\.nomatch\*' searches every depth"):
        hookscope.select(LeNet(), "nomatch*")
    with pytest.raises(SelectorError) as err:
        hookscope.select(ModuleListBlocks(), "blocks.99.*")
    assert "searches every depth" not in str(err.value) and "'pos_block.3'" in str(err.value)


def test_suggestions_never_offer_a_container() -> None:
    with pytest.raises(SelectorError) as err:
        hookscope.select(ModuleListBlocks(), "pos_blok")
    assert "'pos_block'" not in str(err.value)


def _verbs() -> dict[str, Any]:
    """Each verb that takes module names, run on ``model`` with the names ``names`` (a list or a
    tuple, or a list among separate names), returning the names it selected."""
    x = torch.randn(3, 4)

    def captured(model: nn.Module, *names: Any) -> list[str]:
        with hookscope.capture(model, *names) as acts:
            model(x)
        return sorted(acts.paths)

    def ablated(model: nn.Module, names: Any) -> list[str]:
        with hookscope.ablate(model, names) as edits:
            model(x)
        return sorted(p for p, n in edits.counts.items() if n)

    def stored(model: nn.Module, names: Any) -> list[str]:
        with tempfile.TemporaryDirectory() as folder:
            store = hookscope.extract(model, [x], names, Path(folder) / "s", progress=False)
            found = sorted(store.layers)
            store.close()
            return found

    return {
        "select": lambda model, names: sorted(hookscope.select(model, names)),
        "select-mixed": lambda model, names: sorted(hookscope.select(model, names[:1], *names[1:])),
        "capture": captured,
        "capture-mixed": lambda model, names: captured(model, list(names[:1]), *names[1:]),
        "ablate": ablated,
        "stats": lambda model, names: sorted(hookscope.stats(model, [x], names)),
        "extract": stored,
    }


@pytest.mark.parametrize("verb", list(_verbs()))
@pytest.mark.parametrize("kind", [list, tuple])
def test_every_verb_takes_a_list_or_tuple_of_names(verb: str, kind: type) -> None:
    # finding 04: capture(model, ["a", "b"]) was refused, "patterns are strings; got list"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert _verbs()[verb](model, kind(["0", "2"])) == ["0", "2"]


def test_a_name_that_is_no_string_says_how_to_pass_several() -> None:
    with pytest.raises(SelectorError, match=r"pass strings, e\.g\. capture\(model, 'fc1', "
                                            r"'blocks\.\*'\) or a list of them"):
        hookscope.select(nn.Sequential(nn.Linear(2, 2)), 0)  # type: ignore[arg-type]
