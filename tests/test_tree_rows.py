"""hookscope.tree on the zoo: paths, classes, parameter counts, calls, outputs, marks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hookscope.diagnostics.module_tree import describe_output, filter_rows, format_count, format_tree, tree
from hookscope.errors import SelectorError
from tests.models import (
    ZOO,
    DictOutput,
    ModuleListBlocks,
    ReusedRelu,
    SharedLinear,
    TiedWeights,
    TupleOutput,
    UnusedBranch,
)


def _by_path(rows: list) -> dict:
    return {row.path: row for row in rows}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_rows_follow_named_modules_with_exact_parameter_counts(name: str) -> None:
    factory, example = ZOO[name]
    model = factory()
    rows = tree(model, *example())
    assert [row.path for row in rows] == [path for path, _ in model.named_modules()]
    for row, (_, module) in zip(rows, model.named_modules()):
        assert row.class_name == type(module).__name__
        assert row.params == sum(p.numel() for p in module.parameters())
        assert row.own_params == sum(p.numel() for p in module.parameters(recurse=False))
    assert rows[0].depth == 0 and rows[0].calls == 1


def test_container_is_marked_with_the_pattern_of_its_children() -> None:
    rows = _by_path(tree(ModuleListBlocks(), torch.randn(2, 8, 6, 6)))
    container = rows["pos_block"]
    assert container.container and container.calls is None and container.outputs == ()
    assert container.note == "container, no forward: select 'pos_block.*' (4 modules)"
    assert rows["pos_block.2.proj.0"].outputs == ("2x8x6x6 float32",)
    assert rows["pos_block.2.proj.0"].depth == 4
    assert tree(ModuleListBlocks())[1].note == container.note  # also without an example


def test_calls_count_every_use_of_a_reused_module() -> None:
    assert _by_path(tree(SharedLinear(), torch.randn(2, 6)))["lin"].calls == 2
    relu = _by_path(tree(ReusedRelu(), torch.randn(2, 6)))["relu"]
    assert (relu.calls, relu.outputs) == (3, ("2x6 float32",))


def test_modules_that_never_ran_are_marked() -> None:
    rows = _by_path(tree(UnusedBranch(), torch.randn(2, 4)))
    assert rows["aux_head"].calls == 0 and rows["relu"].calls == 0
    assert rows["aux_head"].note == ("never ran: the model's forward ran without calling it "
                                     "(F.linear: address it as '::linear', or a branch not taken)")
    assert rows["head"].note == "" and rows["head"].calls == 1


def test_without_example_there_are_no_calls() -> None:
    rows = tree(UnusedBranch())
    assert all(row.calls is None and row.outputs == () and row.note == "" for row in rows)


def test_structured_outputs_are_described() -> None:
    rows = _by_path(tree(TupleOutput(), torch.randn(2, 5, 4)))
    assert rows["lstm"].outputs == ("(2x5x6 float32, (1x2x6 float32, 1x2x6 float32))",)
    block = _by_path(tree(DictOutput(), torch.randn(3, 4)))["block"]
    assert block.outputs == ("{hidden: 3x4 float32, scale: 3 float32}",)
    assert describe_output((torch.zeros(()), None, "x")) == "(scalar float32, None, str)"
    assert describe_output([torch.zeros(2, dtype=torch.int64)]) == "[2 int64]"


def test_tied_weights_are_counted_once() -> None:
    rows = _by_path(tree(TiedWeights()))
    assert rows[""].params == 12 * 8
    assert rows["out"].own_params == 12 * 8


def test_wrappers_are_looked_through() -> None:
    model = UnusedBranch()
    wrapped = nn.DataParallel(model)
    assert [row.path for row in tree(wrapped)] == [row.path for row in tree(model)]


def test_hooks_are_removed_when_the_forward_raises() -> None:
    model = SharedLinear()
    with pytest.raises(RuntimeError):
        tree(model, torch.randn(2, 5))
    assert all(not m._forward_hooks for m in model.modules())


def test_filter_and_depth() -> None:
    model = ModuleListBlocks()
    rows = tree(model)
    assert [r.path for r in filter_rows(rows, model, "pos_block.*.proj")] == [
        f"pos_block.{i}.proj" for i in range(4)]
    assert [r.path for r in filter_rows(rows, model, "pos_block")] == ["pos_block"]
    assert [r.path for r in filter_rows(rows, model, depth=1)] == ["", "pos_block", "head"]
    with pytest.raises(SelectorError, match="matched no module"):
        filter_rows(rows, model, "pos_blok.*")


def test_format_tree_indents_relative_to_the_shallowest_row() -> None:
    model = ModuleListBlocks()
    text = format_tree(filter_rows(tree(model), model, "pos_block.*.proj.0"))
    assert text.splitlines()[1].startswith("pos_block.0.proj.0  Conv2d")


@pytest.mark.parametrize(("n", "text"), [(0, "0"), (999, "999"), (1000, "1K"), (12_345, "12.3K"),
                                         (999_999, "1M"), (4_652_008, "4.65M"),
                                         (22_713_216, "22.7M"), (1_100_000_000, "1.1B")])
def test_format_count(n: int, text: str) -> None:
    assert format_count(n) == text
