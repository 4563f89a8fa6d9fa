"""User files are never deleted by guessing from their names (issue 26): ``overwrite`` and
``resume`` delete only what the store's manifest lists with name, size and digest agreeing, and
the files its writer can prove it made (the run id in the manifest, in each shard's metadata and
in each temporary name); anything else makes them refuse, naming it, with nothing touched."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.errors import StoreExistsError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store

ROWS = torch.arange(24, dtype=torch.float32).reshape(12, 2)
OTHER_RUN = "0123456789abcdef" * 2


def _store(out: Path, **options: object) -> None:
    extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
            progress=False, **{"shard_bytes": 32, **options})


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _run(store: Path) -> str:
    return str(json.loads((store / "manifest.json").read_text())["run"])


@pytest.fixture
def store(tmp_path: Path) -> Path:
    out = tmp_path / "store"
    _store(out)
    return out


def _notes(store: Path, name: str) -> None:
    (store / name).write_text("notes")


def _shard_copying_the_format_key(store: Path, name: str) -> None:
    save_file({"x": torch.zeros(2)}, str(store / name), metadata={"format": "hookscope.store"})


def _other_stores_shard(store: Path, name: str) -> None:
    other = store.parent / "other"
    _store(other)
    (store / name).write_bytes((other / "shard-00000.safetensors").read_bytes())


def _other_stores_manifest(store: Path, name: str) -> None:
    other = store.parent / "other"
    _store(other)
    (store / name).write_bytes((other / "manifest.json").read_bytes())


def _same_size_other_bytes(store: Path, name: str) -> None:
    data = bytearray((store / name).read_bytes())
    data[-1] ^= 0xFF  # the user's own edit of a listed file: size agrees, digest does not
    (store / name).write_bytes(bytes(data))


PLANTED: dict[str, tuple[str, Callable[[Path, str], None]]] = {
    "a temporary-like name without a run id": (".manifest.json.tmp-1", _notes),
    "an old-style temporary name": (".shard-00000.safetensors.tmp-42-deadbeef", _notes),
    "another run's temporary name": (f".shard-00003.safetensors.tmp-{OTHER_RUN}-7-0a1b2c3d",
                                     _notes),
    "a shard name whose metadata copies the format key": ("shard-00093.safetensors",
                                                          _shard_copying_the_format_key),
    "another store's shard under an unlisted name": ("shard-00007.safetensors",
                                                     _other_stores_shard),
    "another store's manifest as a part": ("manifest-r0001.json", _other_stores_manifest),
}


@pytest.mark.parametrize("option", ["overwrite", "resume"])
@pytest.mark.parametrize("case", sorted(PLANTED))
def test_planted_user_files_are_refused_by_name_and_kept(store: Path, case: str,
                                                         option: str) -> None:
    name, plant = PLANTED[case]
    plant(store, name)
    before = _files(store)
    with pytest.raises(StoreExistsError, match=rf"refusing {option}=True .*{re.escape(name)}"):
        _store(store, **{option: True})
    assert _files(store) == before


def test_a_listed_shard_whose_digest_differs_is_refused_by_overwrite(store: Path) -> None:
    _same_size_other_bytes(store, "shard-00001.safetensors")
    before = _files(store)
    with pytest.raises(StoreExistsError, match=r"'shard-00001\.safetensors' is not part of the "
                                               r"hookscope store"):
        _store(store, overwrite=True)
    assert _files(store) == before


def test_files_the_writer_provably_made_are_removed(store: Path) -> None:
    run = _run(store)
    # a crash between a shard's rename and the manifest that lists it, and a half temporary file
    (store / "shard-00003.safetensors").write_bytes((store / "shard-00002.safetensors").read_bytes())
    (store / f".shard-00004.safetensors.tmp-{run}-9-0a1b2c3d").write_bytes(b"half")
    _store(store, overwrite=True, shard_bytes=1 << 20)
    assert sorted(os.listdir(store)) == ["manifest.json", "shard-00000.safetensors"]
    assert _run(store) != run  # a fresh store, a fresh run id
    assert torch.equal(open_store(store)["0"][:], ROWS)


def test_a_first_manifest_left_as_a_temporary_file_is_proven_by_its_content(tmp_path: Path) -> None:
    out = tmp_path / "store"
    _store(out)
    run, text = _run(out), (out / "manifest.json").read_bytes()
    for f in out.iterdir():
        f.unlink()
    (out / f".manifest.json.tmp-{run}-5-0a1b2c3d").write_bytes(text)  # killed before its rename
    _store(out, resume=True)
    assert torch.equal(open_store(out)["0"][:], ROWS)
    empty = f".manifest.json.tmp-{OTHER_RUN}-5-0a1b2c3d"
    for f in out.iterdir():
        f.unlink()
    (out / empty).write_bytes(b"")  # nothing proves it hookscope's: refused, not guessed at
    with pytest.raises(StoreExistsError, match=rf"holds '{empty}'"):
        _store(out, resume=True)
    assert os.listdir(out) == [empty]
