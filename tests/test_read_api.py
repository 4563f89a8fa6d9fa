"""One read API (issue 19): a capture is the ``Records`` it fills, record keys are built once,
and the root has one internal spelling (path ``""``, written ``(root)``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from hookscope.record.entries import Entry
from hookscope.record.records import RecordKey, Records
from tests.models import TupleOutput


def test_a_capture_is_its_records() -> None:
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    with hookscope.capture(model, "(root)") as acts:
        out = model(x)
    assert isinstance(acts, Records)
    assert [str(k) for k, _ in acts.items()] == ["(root)"] and list(acts) == ["(root)"]
    torch.testing.assert_close(acts["(root)"], out.detach())
    torch.testing.assert_close(acts.records["(root)"], out.detach())


def test_the_root_is_path_empty_written_root() -> None:
    assert RecordKey.parse("(root)") == RecordKey("")
    assert RecordKey.parse("(root):1[0]") == RecordKey("", 1, (0,))
    assert str(RecordKey("", 1, (0,))) == "(root):1[0]" and RecordKey("").name == "(root)"
    assert str(RecordKey("", None, (), "relu")) == "::relu"


def test_items_keep_the_entry_key_without_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = TupleOutput(), torch.randn(2, 5, 4)
    with hookscope.capture(model, "lstm[0]") as acts:
        model(x)

    def refuse(text: str) -> RecordKey:
        raise AssertionError(f"parsed {text!r}")

    monkeypatch.setattr(RecordKey, "parse", staticmethod(refuse))
    keys = [k for k, _ in acts.items()]
    assert keys == [RecordKey("lstm", None, (0,))]
    assert isinstance(acts.entry("lstm[0]"), Entry) and acts.entry("lstm[0]").key == keys[0]


def test_a_sparse_row_index_is_an_index_error_naming_the_fix(tmp_path: Any) -> None:
    """Issue 35: a sparse tensor as a row index raised torch's TypeError from numpy."""
    store = hookscope.extract(nn.Sequential(nn.Linear(4, 3)), [torch.randn(2, 4)], "0",
                              tmp_path / "s", progress=False)
    assert torch.equal(store["0"][torch.tensor([1, 0])], store["0"][[1, 0]])
    with pytest.raises(IndexError, match=r"to_dense\(\)"):
        store["0"][torch.tensor([0, 1]).to_sparse()]
