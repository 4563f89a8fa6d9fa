"""Stores of format version 1 (sha256 digests, written before XXH3-128: ``manifest.DIGESTS``)
keep working: they read and verify by sha256, a resume appends version-1 shards to them,
``overwrite`` proves their shards by sha256 before deleting, and a version this hookscope does
not know is refused naming the ones it reads."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.errors import StoreCorruptError, StoreExistsError
from hookscope.store import extract, open_store
from hookscope.store.writer import StoreWriter, join_parts

ROWS = torch.arange(48, dtype=torch.float32).reshape(24, 2)


def _extract(out: Path, **options: object) -> None:
    extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
            progress=False, **{"shard_bytes": 64, **options})


def _manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def _as_version_1(store: Path, *, drop_last: bool = False) -> None:
    """Make the store a version-1 one: sha256 digests in place of XXH3-128 (``drop_last``: as
    a run stopped before its last shard, whose file is gone)."""
    manifest = _manifest(store)
    if drop_last:
        last = manifest["shards"].pop()
        (store / last["file"]).unlink()
        manifest.update(complete=False, rows=last["rows"][0])
    for entry in manifest["shards"]:
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((store / entry["file"]).read_bytes()).hexdigest()
    manifest["version"] = 1
    (store / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    out = tmp_path / "store"
    _extract(out)
    _as_version_1(out)
    return out


def test_a_version_1_store_reads_and_verifies_by_sha256(store: Path) -> None:
    opened = open_store(store)
    assert len(opened.shards) == 6 and torch.equal(opened["0"][:], ROWS)
    opened.verify()
    opened.close()
    data = bytearray((store / "shard-00001.safetensors").read_bytes())
    data[-1] ^= 0x01
    (store / "shard-00001.safetensors").write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match=r"shard-00001\.safetensors .* its sha256 differs"):
        open_store(store).verify()


def test_a_resumed_version_1_store_stays_version_1(tmp_path: Path) -> None:
    out = tmp_path / "store"
    _extract(out)
    _as_version_1(out, drop_last=True)
    _extract(out, resume=True)
    manifest = _manifest(out)
    assert manifest["version"] == 1 and manifest["complete"] and manifest["rows"] == 24
    for entry in manifest["shards"]:  # the appended shard too
        assert entry["sha256"] == hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest()
        assert "xxh3_128" not in entry
    opened = open_store(out)
    opened.verify()
    assert torch.equal(opened["0"][:], ROWS)


def test_overwrite_proves_a_version_1_stores_shards_by_sha256(store: Path, tmp_path: Path) -> None:
    data = bytearray((store / "shard-00002.safetensors").read_bytes())
    data[-1] ^= 0x01  # the user's edit: size agrees, sha256 does not
    (store / "shard-00002.safetensors").write_bytes(bytes(data))
    with pytest.raises(StoreExistsError, match=r"'shard-00002\.safetensors' is not part of"):
        _extract(store, overwrite=True)
    assert (store / "shard-00002.safetensors").read_bytes() == bytes(data)
    clean = tmp_path / "clean"
    _extract(clean)
    _as_version_1(clean)
    _extract(clean, overwrite=True)  # its own shards, proven by sha256: replaced
    assert _manifest(clean)["version"] == 2


@pytest.mark.parametrize("version", [0, 3, "2", True, None, [2], {"v": 2}])
def test_a_version_this_hookscope_does_not_read_is_refused(store: Path, version: object) -> None:
    manifest = _manifest(store)
    manifest["version"] = version
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match=rf"format version {re.escape(repr(version))}; this hookscope "
                                                rf"reads versions 1, 2\. Upgrade hookscope"):
        open_store(store)


def test_a_shard_entry_holding_another_versions_digest_too_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "store"
    _extract(out)
    manifest = _manifest(out)
    manifest["shards"][1]["sha256"] = "0" * 64  # found by an attack: it opened and verified
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match=r"field shards\[1\]\['sha256'\] is not a field of "
                                                r"a version-2 shard"):
        open_store(out)


def test_torchrun_parts_of_two_versions_are_not_joined(tmp_path: Path) -> None:
    header = {"model": {"spec": None, "class": "x"}, "extract": {},
              "layers": {"a": {"shape": [1], "dtype": "float32", "ragged": False}}, "run": "5e" * 16}
    parts = [StoreWriter(tmp_path, header, rank=r, world_size=2) for r in range(2)]
    parts[0].manifest["version"] = 1
    for part in parts:
        part.finish()
    with pytest.raises(StoreCorruptError, match=r"store versions \[1, 2\]: the ranks ran different"):
        join_parts(tmp_path, 2)
    assert not (tmp_path / "manifest.json").exists()
