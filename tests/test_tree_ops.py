"""tree(..., ops=True) and `hookscope tree --ops`: each module's own function calls, addressable."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hookscope.cli.main import main
from hookscope.diagnostics.module_tree import OpRow, format_tree, tree
from tests.functional_models import Block, FusedSelfAttention, SeedLeNet


def test_seed_lenet_ops_are_the_root_calls_with_shapes() -> None:
    rows = {row.path: row for row in tree(SeedLeNet(), torch.randn(2, 3, 32, 32), ops=True)}
    ops = {op.address: op for op in rows[""].ops}
    assert list(ops) == ["::relu", "::max_pool2d", "::view"]
    assert ops["::relu"] == OpRow("::relu", 4, ("2x6x28x28 float32", "2x16x10x10 float32",
                                                 "2x120 float32", "2x84 float32"))
    assert ops["::max_pool2d"].outputs == ("2x6x14x14 float32", "2x16x5x5 float32")
    assert [op.address for op in rows["conv1"].ops] == ["conv1::conv2d"]
    assert rows["relu"].calls == 0 and "address it as '::relu'" in rows["relu"].note
    assert tree(SeedLeNet(), torch.randn(2, 3, 32, 32))[0].ops == ()  # only when asked


def test_children_calls_stay_with_the_children() -> None:
    rows = {row.path: row for row in tree(Block(FusedSelfAttention()), torch.randn(2, 5, 16),
                                          ops=True)}
    assert [op.address for op in rows[""].ops] == ["::add", "::gelu"]
    assert "attn::scaled_dot_product_attention" in [op.address for op in rows["attn"].ops]
    text = format_tree(list(rows.values()))
    assert "    attn::scaled_dot_product_attention  x1  2x4x5x4 float32\n" in text


def lenet() -> nn.Module:
    return SeedLeNet()


def test_cli_tree_ops(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tree", "tests.test_tree_ops:lenet", "--input", "randn:2,3,32,32", "--ops",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["ops"][1] == {"address": "::max_pool2d", "calls": 2,
                                 "outputs": ["2x6x14x14 float32", "2x16x5x5 float32"]}
    assert main(["tree", "tests.test_tree_ops:lenet", "--ops"]) == 2
    assert "give one with --input" in capsys.readouterr().err
