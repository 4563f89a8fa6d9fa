"""`hookscope show STORE`: the table, JSON, incomplete stores, and errors with exit code 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hookscope.cli.main import main
from hookscope.store.extraction import extract
from tests.models import LeNet


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    images = [torch.randn(4, 3, 32, 32) for _ in range(3)]
    extract(LeNet(), images, ["conv2", "fc1"], tmp_path / "s", dtype=torch.float16,
            shard_bytes=5000, progress=False, model_spec="tests.models:LeNet")
    return tmp_path / "s"


def test_table_lists_layers_then_a_summary(store_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(store_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["layer  row shape  dtype    ragged",
                         "conv2  16x10x10   float16  no",
                         "fc1    120        float16  no"]
    assert lines[3].startswith("12 rows in 3 shards, ")
    assert lines[3].endswith("complete; model tests.models:LeNet, reduce None")
    assert lines[4:] == ["ids: 0, 1, 2, ..."]


def test_json_has_stable_keys(store_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(store_path), "--json", "--verify"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(data) == ["bytes", "complete", "ids", "labels", "layers", "model", "path",
                            "reduce", "rows", "shards", "verified"]
    assert data["ids"] == [0, 1, 2] and data["labels"] is None  # a list of tensors: row numbers
    assert data["rows"] == 12 and data["shards"] == 3 and data["verified"] is True
    assert data["layers"][0] == {"layer": "conv2", "path": "conv2", "shape": [16, 10, 10],
                                 "dtype": "float16", "ragged": False}  # path: the module (issue 45)


def test_incomplete_store_is_shown_as_such(store_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((store_path / "manifest.json").read_text())
    manifest["complete"] = False
    (store_path / "manifest.json").write_text(json.dumps(manifest))
    assert main(["show", str(store_path)]) == 0
    assert "INCOMPLETE (resume the extraction)" in capsys.readouterr().out


def test_not_a_store_exits_2_and_a_corrupt_shard_exits_1(
        store_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path)]) == 2  # usage: the path given is not a store
    assert "is not a hookscope store (no manifest.json)" in capsys.readouterr().err
    shard = store_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["show", str(store_path), "--verify"]) == 1
    assert "error: shard shard-00001.safetensors" in capsys.readouterr().err
