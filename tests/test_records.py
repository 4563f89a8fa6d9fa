"""Saving captures to safetensors and loading them back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hookscope
from hookscope.errors import OutputExistsError
from tests.models import SharedLinear, TupleOutput


def test_save_and_load_structured_and_repeated_calls(tmp_path: Path) -> None:
    lstm, shared = TupleOutput(), SharedLinear()
    with hookscope.capture(lstm, "lstm") as a:
        lstm(torch.randn(2, 5, 4))
    file = tmp_path / "lstm.safetensors"
    a.save(str(file), metadata={"model": "TupleOutput"})
    loaded = hookscope.load(file)
    assert sorted(loaded) == ["lstm[0]", "lstm[1][0]", "lstm[1][1]"]
    assert torch.equal(loaded["lstm[1][0]"], a["lstm"][1][0])
    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["hookscope.calls"]) == {"lstm": 1} and meta["model"] == "TupleOutput"

    with hookscope.capture(shared, "lin") as b:
        shared(torch.randn(2, 6))
    b.save(str(tmp_path / "shared.safetensors"))
    assert sorted(hookscope.load(tmp_path / "shared.safetensors")) == ["lin:0", "lin:1"]


def test_save_refuses_to_overwrite_and_leaves_no_temp(tmp_path: Path) -> None:
    model = SharedLinear()
    with hookscope.capture(model, "lin") as acts:
        model(torch.randn(1, 6))
    file = tmp_path / "a.safetensors"
    file.write_bytes(b"keep me")
    with pytest.raises(hookscope.HookscopeError, match="overwrite=True"):
        acts.save(str(file), overwrite=False)
    assert file.read_bytes() == b"keep me" and os.listdir(tmp_path) == ["a.safetensors"]


def test_save_refuses_an_existing_file_by_default_and_a_folder(tmp_path: Path) -> None:
    # finding 02: save() replaced an existing file silently (the CLI's --save refuses it), and a
    # folder gave a bare IsADirectoryError
    model = SharedLinear()
    with hookscope.capture(model, "lin") as acts:
        model(torch.randn(1, 6))
    file = tmp_path / "precious.safetensors"
    file.write_bytes(b"my data")
    with pytest.raises(OutputExistsError, match=r"pass overwrite=True to replace it \(the CLI's "
                                                r"--overwrite\), or pick another name"):
        acts.save(file)
    assert file.read_bytes() == b"my data"
    with pytest.raises(OutputExistsError, match="is a folder.*give a file name inside it"):
        acts.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["precious.safetensors"]
    acts.save(file, overwrite=True)
    assert torch.equal(hookscope.load(file)["lin", 1], acts["lin", 1])


def test_load_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(hookscope.HookscopeError, match="no such file"):
        hookscope.load(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 20)
    with pytest.raises(hookscope.HookscopeError, match="not a readable safetensors file"):
        hookscope.load(bad)
