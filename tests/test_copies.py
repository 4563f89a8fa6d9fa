"""Copies and checkpoints made inside a block carry nothing of hookscope (issue 19 "copies and
checkpoints"): a deepcopy, pickle or torch.save of the model holds no hookscope entry in any hook
table, loads where hookscope cannot be imported, computes what the plain model computes, and
keeps the user's own hooks."""

from __future__ import annotations

import copy
import copyreg
import io
import pickle
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from tests.copies_models import double_head, note_kwargs
from tests.models import ReluBlocks, ReluMlp

TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
          "_backward_pre_hooks")


def _net() -> ReluBlocks:
    """``(..., 6)`` -> ``(..., 3)``: two residual ``ReluMlp`` blocks and a head."""
    return ReluBlocks(6, 2, embed=False, out=3)


def _blocks(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """``{kind: a context manager factory}`` for each block kind (all open around the copy)."""
    return {
        "capture": lambda: hookscope.capture(model, "blocks.*", "head", inputs=True),
        "capture ::relu": lambda: hookscope.capture(model, "blocks.*::relu"),
        "capture early_stop": lambda: hookscope.capture(model, "blocks.0", early_stop=True),
        "edit ::relu": lambda: hookscope.edit(model, {"blocks.*::relu": lambda o: o * 3}),
        "steer": lambda: hookscope.steer(model, {"blocks.0": torch.ones(6)}, positions=-1),
        "stats": lambda: _observing(model),
    }


@contextmanager
def _observing(model: nn.Module) -> Iterator[None]:
    """An Observer-based block (what stats, compare, tree use), open while copies are made."""
    from hookscope.engine.naming.selection import resolve
    from hookscope.engine.session import Observer
    seen: list[torch.Tensor] = []
    with Observer(model, resolve(model, ["blocks.*", "blocks.*::relu"]),
                  forward=lambda target: lambda module, args, output: seen.append(output)):
        yield


def _hookscope_entries(model: nn.Module) -> list[str]:
    """Entries of any hook table of ``model`` whose key or value is not the user's."""
    found = []
    for path, module in model.named_modules():
        for table in TABLES:
            for key, value in getattr(module, table).items():
                if "hookscope" in type(value).__module__ or "hookscope" in getattr(
                        value, "__module__", "") or "hookscope" in repr(value):
                    found.append(f"{path}.{table}[{key}]")
    return found


def _copies(model: nn.Module, tmp_path: Path) -> dict[str, nn.Module]:
    """The model copied each way, and the file each checkpoint was written to."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    torch.save(model, tmp_path / "model.pt")
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
    ema = copy.deepcopy(model)  # an EMA copy, saved the way EMA checkpoints are
    torch.save(ema, tmp_path / "ema.pt")
    buffer.seek(0)
    return {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model)),
            "torch.save": torch.load(buffer, weights_only=False), "ema": ema}


def _plain(model: nn.Module) -> nn.Module:
    """A copy of ``model`` made without hookscope: its weights and the user's hook."""
    plain = _net()
    plain.load_state_dict(model.state_dict())
    plain.head.register_forward_hook(double_head)
    return plain


@pytest.mark.parametrize("kind", ["capture", "capture ::relu", "capture early_stop",
                                  "edit ::relu", "steer", "stats"])
def test_copies_made_inside_a_block_carry_nothing_of_hookscope(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _net()
    model.head.register_forward_hook(double_head)  # the user's own hooks: kept in every copy
    user = model.blocks[0].register_forward_hook(note_kwargs, with_kwargs=True, always_call=True)
    x = torch.randn(2, 4, 6)
    plain = _plain(model)
    expected = plain(x)
    plain.head._forward_hooks.clear()
    with _blocks(model, x)[kind]():
        copies = _copies(model, tmp_path)
        model(x)  # the block's own call (an early stop ends the block here)
    for how, copied in copies.items():
        assert _hookscope_entries(copied) == [], how
        assert list(copied.head._forward_hooks.values()) == [double_head], how
        block = copied.blocks[0]
        assert (dict(block._forward_hooks), dict(block._forward_hooks_with_kwargs),
                dict(block._forward_hooks_always_called)) == (
                    {user.id: note_kwargs}, {user.id: True}, {user.id: True}), how
        assert torch.equal(copied(x), expected), how
    assert OrderedDict not in copyreg.dispatch_table
    _load_without_hookscope(tmp_path, x, expected)
    for copied in (model, *copies.values()):  # the user's hooks are the test's to remove
        copied.head._forward_hooks.clear()
        copied.blocks[0]._forward_hooks.clear()


def _load_without_hookscope(folder: Path, x: torch.Tensor, expected: torch.Tensor) -> None:
    """Load each checkpoint in a Python where ``import hookscope`` fails; run it on ``x``."""
    torch.save({"x": x, "expected": expected}, folder / "data.pt")
    script = f"""
import pickle, sys
sys.modules["hookscope"] = None
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
import torch
import tests.models, tests.copies_models  # what a checkpoint names: the model classes and the user's hook
data = torch.load({str(folder / 'data.pt')!r})
for name in ("model.pt", "ema.pt"):
    model = torch.load({str(folder)!r} + "/" + name, weights_only=False)
    assert torch.equal(model(data["x"]), data["expected"]), name
with open({str(folder / 'model.pkl')!r}, "rb") as f:
    model = pickle.load(f)
assert torch.equal(model(data["x"]), data["expected"])
print("loaded")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"


def test_unrelated_ordered_dicts_pickle_and_copy_unchanged_inside_a_block() -> None:
    model = _net()
    state = OrderedDict([(1, "a"), (2, [1, 2]), (3, torch.ones(2))])
    with hookscope.capture(model, "blocks.*::relu"):
        model(torch.randn(2, 6))
        handle_ids = list(model.blocks[0]._forward_pre_hooks)
        same_keys = OrderedDict((key, "user value") for key in handle_ids)  # ids as keys
        for table in (state, same_keys, model.state_dict()):
            for copied in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table)):
                assert type(copied) is OrderedDict
                assert list(copied) == list(table)
                for a, b in zip(copied.values(), table.values()):
                    assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_copyreg_entry_exists_only_while_a_block_is_open_and_chains_to_the_users() -> None:
    model = _net()
    x = torch.randn(2, 6)
    assert OrderedDict not in copyreg.dispatch_table
    with pytest.raises(ValueError, match="inside"):
        with hookscope.capture(model, "head"):
            assert OrderedDict in copyreg.dispatch_table
            with hookscope.edit(model, {"blocks.0": lambda o: o}):  # nested: still one entry
                model(x)
            assert OrderedDict in copyreg.dispatch_table
            raise ValueError("inside")
    assert OrderedDict not in copyreg.dispatch_table
    reduced: list[OrderedDict[Any, Any]] = []

    def users(table: OrderedDict[Any, Any]) -> Any:
        reduced.append(table)
        return table.__reduce__()

    copyreg.pickle(OrderedDict, users)
    try:
        with hookscope.capture(model, "head"):
            pickle.dumps(OrderedDict(a=1))
            torch.save(model, io.BytesIO())
            model(x)
        assert copyreg.dispatch_table[OrderedDict] is users
        assert [dict(t) for t in reduced[:1]] == [{"a": 1}]  # unrelated: the user's reducer
        assert all(not any(isinstance(v, type(model.head.forward)) for v in t.values())
                   for t in reduced)
    finally:
        del copyreg.dispatch_table[OrderedDict]


def test_a_shallow_copy_sharing_the_tables_does_not_remove_the_blocks_hooks() -> None:
    model = _net()
    x = torch.randn(2, 6)
    with hookscope.capture(model, "head") as acts:
        twin = copy.copy(model.head)  # another module object sharing head's hook tables
        twin(torch.randn(2, 6))
        model(x)
        assert len(model.head._forward_hooks) == 1
    assert acts.counts == {"head": 1}  # the twin's call is not the block's
    assert torch.equal(acts["head"], model(x).detach())
    assert not model.head._forward_hooks


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(["linear", "relu_fn", "tanh", "nested"]), min_size=1, max_size=4),
       st.data())
def test_generated_trees_copied_inside_a_capture_compute_the_plain_output(
        layers: list[str], data: st.DataObject) -> None:
    def build(kind: str) -> nn.Module:
        if kind == "linear":
            return nn.Linear(6, 6)
        if kind == "relu_fn":
            return ReluMlp(6)
        if kind == "tanh":
            return nn.Tanh()
        return nn.Sequential(nn.Linear(6, 6), ReluMlp(6))
    torch.manual_seed(0)
    model = nn.Sequential(*(build(kind) for kind in layers))
    paths = [path for path, _ in model.named_modules() if path]
    chosen = data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique=True))
    with_fn = [f"{p}::relu" for p in paths if isinstance(model.get_submodule(p), ReluMlp)]
    x = torch.randn(3, 6)
    expected = model(x)
    with hookscope.capture(model, *chosen, *with_fn[:1]):
        copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=False))
        model(x)
    for copied in copies:
        assert _hookscope_entries(copied) == []
        assert all(not getattr(m, t) for m in copied.modules() for t in TABLES)
        assert torch.equal(copied(x), expected)
