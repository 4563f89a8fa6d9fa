"""Hostile store folders (issue 35, "Stores"): sizes are bounded by the files' real sizes before
anything is allocated, a manifest's size before it is read, and ``--overwrite`` recognises the
store's own files with ASCII digits only, so a user's backup named with other digits survives."""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.errors import StoreCorruptError, StoreExistsError
from hookscope.store.extraction import extract
from hookscope.store.manifest import FREE_ROWS, MAX_MANIFEST_BYTES
from hookscope.store.reader import open_store

ROWS = torch.arange(24, dtype=torch.float32).reshape(12, 2)


def _zero_width(out: Path) -> dict[str, object]:
    extract(nn.Sequential(nn.Identity()), [torch.zeros(4, 0)] * 3, "0", out, progress=False)
    return json.loads((out / "manifest.json").read_text())  # type: ignore[no-any-return]


def test_zero_width_store_reads_its_row_numbers(tmp_path: Path) -> None:
    _zero_width(tmp_path / "s")
    store = open_store(tmp_path / "s")
    assert torch.equal(store.ids, torch.arange(12))  # type: ignore[arg-type]
    assert store["0"][:].shape == (12, 0)


@pytest.mark.parametrize("rows", [FREE_ROWS + 169, 2**36, 2**45, 2**53])
def test_zero_width_layer_claiming_huge_rows_is_refused_before_allocation(
        tmp_path: Path, rows: int) -> None:
    out = tmp_path / "s"
    manifest = _zero_width(out)
    manifest["rows"] = rows
    manifest["shards"][0]["rows"] = [0, rows]  # type: ignore[index]
    (out / "manifest.json").write_text(json.dumps(manifest))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(StoreCorruptError, match=rf"field rows is {rows}, but the shards' 168 bytes"):
        open_store(out)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 * 2**10  # KiB: < 100 MiB


def test_sparse_huge_manifest_is_refused_before_reading(tmp_path: Path) -> None:
    out = tmp_path / "s"
    extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
            progress=False)
    with open(out / "manifest.json", "r+b") as f:
        f.truncate(2 * 2**30)  # sparse: 2 GB that take no disk
    began = time.perf_counter()
    with pytest.raises(StoreCorruptError, match=rf"2147483648 bytes, more than the {MAX_MANIFEST_BYTES}"):
        open_store(out)
    with pytest.raises(StoreExistsError, match="not a valid hookscope manifest"):
        extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
                progress=False, overwrite=True)
    assert time.perf_counter() - began < 2.0  # reading it whole took 14 s (issue 35)
    assert os.path.getsize(out / "manifest.json") == 2 * 2**30


# Arabic-Indic, full-width, Devanagari and Bengali digits: \d matches each, [0-9] none
_DIGITS = ["\u0660\u0661\u0662\u0663\u0664", "\uff10\uff11\uff12\uff13\uff14",
           "\u0966\u0967\u0968\u0969\u096a", "\u09e6\u09e7\u09e8\u09e9\u09ea"]


@pytest.mark.parametrize("digits", _DIGITS)
@pytest.mark.parametrize("kind", ["shard", "manifest part", "temporary"])
def test_overwrite_keeps_backups_named_with_non_ascii_digits(tmp_path: Path, digits: str,
                                                             kind: str) -> None:
    out = tmp_path / "s"
    extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
            progress=False, shard_bytes=32)
    run = json.loads((out / "manifest.json").read_text())["run"]
    name, source = {
        "shard": (f"shard-{digits}.safetensors", "shard-00000.safetensors"),
        "manifest part": (f"manifest-r{digits[:4]}.json", "manifest.json"),
        "temporary": (f".shard-00000.safetensors.tmp-{run}-{digits}-0a0b0c0d",
                      "shard-00000.safetensors"),
    }[kind]
    shutil.copyfile(out / source, out / name)  # the user's backup: a copy of a store file
    backup = (out / name).read_bytes()
    with pytest.raises(StoreExistsError, match="is not part of the hookscope store"):
        extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
                progress=False, shard_bytes=32, overwrite=True)
    assert (out / name).read_bytes() == backup
    assert len(open_store(out)) == 12  # the store itself is untouched too
