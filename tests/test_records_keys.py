"""Record keys (one format, one parse) and the Records type shared by live captures and files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hookscope
from hookscope.record.records import RecordKey
from tests.models import ReusedRelu, SharedLinear, TupleOutput

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,6}(\.[a-z0-9_]{1,6}){0,3}", fullmatch=True)
PARTS = st.lists(st.one_of(st.integers(0, 12), st.from_regex(r"[a-z_][a-z_0-9]{0,8}", fullmatch=True)),
                 max_size=3).map(tuple)


@given(path=NAMES | st.just(""), call=st.none() | st.integers(0, 99), parts=PARTS,
       op=st.none() | st.from_regex(r"[a-z_][a-z_0-9]{0,8}", fullmatch=True))
def test_format_then_parse_is_identity(path: str, call: int | None, parts: tuple[int | str, ...],
                                       op: str | None) -> None:
    if not path and op is None:
        path = "root"
    key = RecordKey(path, call, parts, op)
    assert RecordKey.parse(str(key)) == key


@pytest.mark.parametrize(("text", "key"), [
    ("fc1", RecordKey("fc1")),
    ("relu:2", RecordKey("relu", 2)),
    ("lstm[1][0]", RecordKey("lstm", None, (1, 0))),
    ("lstm:1[0]", RecordKey("lstm", 1, (0,))),
    ("lstm[0]:1", RecordKey("lstm", 1, (0,))),  # the older order: a selected part, then the call
    ("bert[last_hidden_state]", RecordKey("bert", None, ("last_hidden_state",))),
    ("::relu:1", RecordKey("", 1, (), "relu")),
    ("h.0.attn::softmax", RecordKey("h.0.attn", None, (), "softmax")),
    ("h.0.attn::softmax:3[0]", RecordKey("h.0.attn", 3, (0,), "softmax")),
])
def test_parse_examples(text: str, key: RecordKey) -> None:
    assert RecordKey.parse(text) == key


def test_format_and_name() -> None:
    assert str(RecordKey("", 1, (), "relu")) == "::relu:1"
    assert RecordKey("h.0.attn", 3, (0,), "softmax").name == "h.0.attn::softmax[0]"
    assert str(RecordKey("lstm", 1, (1, "h"))) == "lstm:1[1][h]"


@pytest.mark.parametrize("bad", ["", "a:b", "x[1", "a:1:2", ":::"])
def test_parse_refuses_what_is_not_a_key(bad: str) -> None:
    with pytest.raises(hookscope.HookscopeError, match="is not a record key"):
        RecordKey.parse(bad)


def test_load_returns_records_with_counts_and_metadata(tmp_path: Path) -> None:
    net = ReusedRelu()
    with hookscope.capture(net, "relu", "fc1") as acts:
        a, b, c = net(torch.randn(2, 6))
    acts.save(tmp_path / "r.safetensors", metadata={"run": "7"})
    loaded = hookscope.load(tmp_path / "r.safetensors")
    assert isinstance(loaded, hookscope.Records) and isinstance(acts.records, hookscope.Records)
    assert loaded.counts == {"relu": 3, "fc1": 1} and loaded.metadata["run"] == "7"
    assert [torch.equal(x, y.detach()) for x, y in zip(loaded.calls("relu"), (a, b, c))] == [True] * 3
    assert torch.equal(loaded["relu", -1], c.detach()) and torch.equal(acts["relu:2"], c.detach())
    assert list(loaded) == list(acts) == ["fc1", "relu:0", "relu:1", "relu:2"]
    with pytest.raises(hookscope.CaptureError, match="ran 3 times"):
        loaded["relu"]
    for records in (acts, loaded):  # a record that ran several times is there; a call past it not
        assert "relu" in records and "relu:2" in records and "relu:3" not in records
        assert "fc1" in records and "fc2" not in records and 3 not in records


def test_loaded_structure_is_rebuilt_and_parts_address_it(tmp_path: Path) -> None:
    model = TupleOutput()
    with hookscope.capture(model, "lstm") as acts:
        model(torch.randn(2, 5, 4))
    acts.save(tmp_path / "t.safetensors")
    loaded = hookscope.load(tmp_path / "t.safetensors")
    live = acts["lstm"]
    assert isinstance(loaded["lstm"], tuple) and len(loaded["lstm"]) == 2
    assert torch.equal(loaded["lstm"][1][1], live[1][1])
    assert torch.equal(loaded["lstm[1][0]"], live[1][0]) and torch.equal(acts["lstm[1][0]"], live[1][0])
    assert "lstm[1][0]" in loaded and "lstm[2]" not in loaded and "gru" not in loaded


def test_selected_part_with_several_calls_round_trips(tmp_path: Path) -> None:
    model = TupleOutput()
    with hookscope.capture(model, "lstm[1][0]") as acts:
        model(torch.randn(2, 5, 4))
        model(torch.randn(2, 5, 4))
    acts.save(tmp_path / "p.safetensors")
    loaded = hookscope.load(tmp_path / "p.safetensors")
    assert list(loaded) == ["lstm:0[1][0]", "lstm:1[1][0]"]
    assert loaded.counts == {"lstm[1][0]": 2}
    assert torch.equal(loaded["lstm[1][0]", 1], acts["lstm[1][0]", 1])


def test_clear_keeps_hooks_and_drops_records() -> None:
    model = SharedLinear()
    x1, x2 = torch.randn(1, 6), torch.randn(3, 6)
    with hookscope.capture(model, "lin") as acts:
        model(x1)
        assert acts.counts == {"lin": 2}
        acts.clear()
        assert acts.counts == {"lin": 0} and "lin" not in acts
        model(x2)
        assert acts.counts == {"lin": 2} and acts["lin", 0].shape == (3, 6)
    assert torch.equal(acts["lin", 0], model.lin(x2).detach())


def test_repr_is_short_and_names_paths_calls_and_shapes() -> None:
    model = SharedLinear()
    with hookscope.capture(model, "lin") as acts:
        model(torch.randn(4, 6))
    assert repr(acts.records) == "<hookscope.Records lin: 2 calls, first 4x6>"
    assert repr(acts) == "<hookscope.Capture lin: 2 calls, first 4x6>"
