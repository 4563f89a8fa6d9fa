"""Attacks on the store folder (round 3): a manifest that names a user's file, odd file kinds
where a manifest or shard should be (FIFO, folder), and JSON nested past Python's recursion limit.
Each must end in a clean ``StoreExistsError`` / ``StoreCorruptError``, delete nothing of the
user's, and never hang."""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

import pytest
import torch
import xxhash
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.errors import StoreCorruptError, StoreExistsError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store

ROWS = torch.arange(24, dtype=torch.float32).reshape(12, 2)


def _store(out: Path, **options: object) -> None:
    extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
            progress=False, **{"shard_bytes": 32, **options})


def _edit_manifest(folder: Path, edit: object) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)  # type: ignore[operator]
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _deadline(fn: object, seconds: float = 10.0) -> BaseException | None:
    """Run ``fn`` on a thread; fail the test if it is still running after ``seconds``."""
    caught: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            caught[0] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung (a FIFO was opened for reading)"
    return caught[0]


@pytest.mark.parametrize("name", ["notes.txt", "shard-00007.safetensors"])
def test_overwrite_keeps_a_user_file_a_manifest_lists_as_a_shard(tmp_path: Path, name: str) -> None:
    out = tmp_path / "store"
    _store(out)
    (out / name).write_text("precious")
    _edit_manifest(out, lambda m: m["shards"][0].update(file=name))
    with pytest.raises(StoreExistsError, match=name.replace(".", r"\.")):
        _store(out, overwrite=True)
    assert (out / name).read_text() == "precious"
    assert (out / "shard-00000.safetensors").exists()  # nothing deleted before refusing


def test_a_manifest_listing_a_user_file_is_corrupt_for_readers(tmp_path: Path) -> None:
    out = tmp_path / "store"
    _store(out)
    (out / "notes.txt").write_text("x" * 100)
    _edit_manifest(out, lambda m: m["shards"][0].update(file="notes.txt"))
    with pytest.raises(StoreCorruptError, match=r"shards\[0\]\.file"):
        open_store(out)


@pytest.mark.parametrize("name", ["manifest.json", "manifest-r0001.json"])
@pytest.mark.parametrize("flag", ["resume", "overwrite"])
def test_a_fifo_named_like_a_manifest_is_refused_without_hanging(
        tmp_path: Path, name: str, flag: str) -> None:
    out = tmp_path / "store"
    _store(out)
    (out / name).unlink(missing_ok=True)
    os.mkfifo(out / name)
    before = sorted(os.listdir(out))
    err = _deadline(lambda: _store(out, **{flag: True}))
    assert isinstance(err, StoreExistsError) and name in str(err) and "regular file" in str(err)
    assert sorted(os.listdir(out)) == before


def test_a_fifo_manifest_is_refused_by_readers_without_hanging(tmp_path: Path) -> None:
    from hookscope.store.reader import read_manifest
    os.mkfifo(tmp_path / "manifest.json")
    err = _deadline(lambda: read_manifest(tmp_path / "manifest.json"))
    assert isinstance(err, StoreCorruptError) and "regular file" in str(err)


def test_a_folder_where_a_shard_should_be_is_corrupt(tmp_path: Path) -> None:
    out = tmp_path / "store"
    _store(out)
    (out / "shard-00000.safetensors").unlink()
    (out / "shard-00000.safetensors").mkdir()
    size = (out / "shard-00000.safetensors").stat().st_size

    def edit(m: dict) -> None:  # type: ignore[type-arg]
        m["shards"][0].update(bytes=size, chunk_sum=["0" * 16] * math.ceil(size / m["chunk_bytes"]))
    _edit_manifest(out, edit)
    with pytest.raises(StoreCorruptError, match="not a regular file"):
        open_store(out)
    assert (out / "shard-00000.safetensors").is_dir()


def _deep(n: int = 100_000) -> bytes:
    return b"[" * n + b"]" * n


def test_a_manifest_nested_past_the_recursion_limit_is_corrupt(tmp_path: Path) -> None:
    out = tmp_path / "store"
    _store(out)
    (out / "manifest.json").write_bytes(_deep())
    with pytest.raises(StoreCorruptError, match="manifest.json"):
        open_store(out)
    with pytest.raises(StoreExistsError, match="manifest.json there is not a valid"):
        _store(out, overwrite=True)
    assert (out / "shard-00000.safetensors").exists()


def test_a_shard_header_nested_past_the_recursion_limit_is_corrupt(tmp_path: Path) -> None:
    out = tmp_path / "store"
    _store(out)
    shard = out / "shard-00000.safetensors"
    header = _deep(50_000)
    shard.write_bytes(len(header).to_bytes(8, "little") + header)
    from hookscope.store.shards import chunk_sums
    data = shard.read_bytes()
    
    def edit(m: dict) -> None:  # type: ignore[type-arg]
        m["shards"][0].update(bytes=len(data), xxh3_128=xxhash.xxh3_128(data).hexdigest(),
                              chunk_sum=chunk_sums(data, len(data), m["chunk_bytes"]))
    _edit_manifest(out, edit)
    with pytest.raises(StoreCorruptError, match="shard-00000"):
        open_store(out)["0"][0]
    # a stray unlisted shard-named file with such a header is not the store's: overwrite refuses
    (out / "shard-00009.safetensors").write_bytes(data)
    with pytest.raises(StoreExistsError, match="shard-00009"):
        _store(out, overwrite=True)


def test_a_layer_cut_from_the_manifest_is_corrupt_not_missing(tmp_path: Path) -> None:
    out = tmp_path / "store"
    extract(nn.Sequential(nn.Identity(), nn.Identity()), TensorDataset(ROWS), ["0", "1"], out,
            batch_size=4, progress=False)
    _edit_manifest(out, lambda m: m["layers"].pop("0"))
    with pytest.raises(StoreCorruptError, match=r"field extract\.layers is \['0', '1'\], but the "
                                                r"store's layers are \['1'\]"):
        open_store(out)
    _edit_manifest(out, lambda m: m["extract"].pop("layers"))  # as a store without extract.layers
    with pytest.raises(StoreCorruptError, match=r"shard-00000.*header.*'0'"):
        open_store(out)["0"]


def test_a_second_extraction_into_a_folder_being_written_is_refused(tmp_path: Path) -> None:
    from hookscope.store.folder import writing
    out = tmp_path / "store"
    with writing(out):  # what a running extraction holds (another open of the folder)
        for options in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(StoreExistsError, match="another process is extracting into"):
                _store(out, **options)
        assert os.listdir(out) == []
    _store(out)  # released: a killed or finished run leaves no lock behind
    assert len(open_store(out)) == 12 and sorted(os.listdir(out))[0] == "manifest.json"



def _rows_view(tmp_path: Path) -> object:
    return extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS[:5]), "0", tmp_path / "s",
                   batch_size=2, shard_bytes=32, progress=False)["0"]


def test_a_bool_mask_selects_the_rows_where_it_is_true(tmp_path: Path) -> None:
    import numpy as np
    view = _rows_view(tmp_path)
    mask = [True, False, True, False, True]
    for index in (mask, np.array(mask), torch.tensor(mask)):
        assert torch.equal(view[index], ROWS[:5][torch.tensor(mask)])  # type: ignore[index]
    assert torch.equal(view[np.array([4, 0])], ROWS[[4, 0]])  # type: ignore[index]
    assert torch.equal(view[torch.tensor(3)], ROWS[3])  # type: ignore[index]


@pytest.mark.parametrize(("index", "message"), [
    (1.7, "not float"), ("1", "not str"), (True, "not bool"), ([0.9], "must be integers"),
    ([True, False], "needs 5 entries"), ([[0, 1]], "not 2-dim")])
def test_indices_that_are_not_rows_are_refused(tmp_path: Path, index: object, message: str) -> None:
    view = _rows_view(tmp_path)
    with pytest.raises(IndexError, match=message):
        view[index]  # type: ignore[index]
