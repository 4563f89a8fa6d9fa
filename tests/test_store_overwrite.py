"""Nothing of the user's is deleted: overwrite removes only a store's own files, resume refuses
folders that are not stores, and a run killed before its first shard leaves a store."""

from __future__ import annotations

import json
import os
import string
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.errors import StoreError, StoreExistsError
from hookscope.store.extraction import extract
from hookscope.store.folder import owned_files
from hookscope.store.reader import open_store

ROWS = torch.arange(24, dtype=torch.float32).reshape(12, 2)


def _store(out: Path, **options: object) -> None:
    options = {"shard_bytes": 32, **options}
    extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
            progress=False, **options)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    out = tmp_path / "store"
    _store(out)
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-00000.safetensors",
                                       "shard-00001.safetensors", "shard-00002.safetensors"]
    return out


@pytest.mark.parametrize("name", ["shard-notes.txt", "manifest-old.txt", "shard-backup",
                                  "notes.txt", ".hidden", "shard-00009.safetensors"])
def test_overwrite_refuses_a_store_holding_a_user_file_naming_it(store: Path, name: str) -> None:
    target = store / name
    if name == "shard-backup":
        target.mkdir()
        (target / "keep.bin").write_bytes(b"mine")
    else:
        target.write_bytes(b"mine, not a hookscope shard")
    before = _files(store)
    with pytest.raises(StoreExistsError, match=rf"'{name}' is not part of the hookscope store"):
        _store(store, overwrite=True)
    assert _files(store) == before


def test_overwrite_refuses_a_manifest_that_is_not_a_hookscope_manifest(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_text("my own notes, not JSON")
    (out / "shard-00000.safetensors").write_bytes(b"x")
    before = _files(out)
    with pytest.raises(StoreExistsError, match=r"manifest\.json there is not a valid hookscope "
                                               r"manifest"):
        _store(out, overwrite=True)
    assert _files(out) == before


def test_overwrite_never_follows_a_manifest_entry_outside_the_folder(store: Path) -> None:
    victim = store.parent / "victim.txt"
    victim.write_text("precious")
    text = (store / "manifest.json").read_text()
    (store / "manifest.json").write_text(text.replace('"shard-00002.safetensors"',
                                                      '"../victim.txt"'))
    with pytest.raises(StoreExistsError, match=r"shards\[2\]\.file must be a plain file name"):
        _store(store, overwrite=True)
    assert victim.read_text() == "precious"


def test_overwrite_refuses_a_link_named_like_a_shard(store: Path) -> None:
    victim = store.parent / "victim.bin"
    victim.write_bytes(b"precious")
    (store / "shard-00001.safetensors").unlink()
    (store / "shard-00001.safetensors").symlink_to(victim)
    with pytest.raises(StoreExistsError, match=r"'shard-00001\.safetensors' is not part"):
        _store(store, overwrite=True)
    assert victim.read_bytes() == b"precious"


def test_overwrite_replaces_exactly_the_store_and_keeps_the_folder(store: Path) -> None:
    inode = store.stat().st_ino
    run = json.loads((store / "manifest.json").read_text())["run"]
    (store / f".shard-00003.safetensors.tmp-{run}-77-0a1b2c3d").write_bytes(b"half")  # a crash's
    _store(store, overwrite=True, shard_bytes=1 << 20)
    assert store.stat().st_ino == inode
    assert sorted(os.listdir(store)) == ["manifest.json", "shard-00000.safetensors"]
    assert torch.equal(open_store(store)["0"][:], ROWS)


_NAMES = st.text(string.ascii_letters + string.digits + "._-", min_size=1, max_size=24).filter(
    lambda n: ".tmp-" not in n and n not in (".", ".."))  # .NAME.tmp-PID: hookscope's own temp file


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(_NAMES, min_size=1, max_size=4, unique=True))
def test_generated_user_files_are_never_deleted(tmp_path: Path, names: list[str]) -> None:
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "store"
    _store(out)
    mine = [n for n in names if n not in os.listdir(out)]
    assume(mine)  # names of the store's own files are not the user's
    for name in mine:
        (out / name).write_bytes(b"user data " + name.encode())
    assert not owned_files(out, "") & set(mine)  # none passes for hookscope's own
    with pytest.raises(StoreExistsError, match="(is|are) not part of the hookscope store") as caught:
        _store(out, overwrite=True)
    assert repr(sorted(mine)[0]) in str(caught.value)
    for name in mine:
        assert (out / name).read_bytes() == b"user data " + name.encode()


def test_resume_refuses_a_folder_that_is_not_a_store(tmp_path: Path) -> None:
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"jpeg")
    with pytest.raises(StoreExistsError, match=r"resume=True \(--resume\) on .*photos: it is not "
                                               r"a hookscope store \(no manifest\.json; it holds "
                                               r"'cat\.jpg'\)"):
        _store(out, resume=True)
    assert os.listdir(out) == ["cat.jpg"]


def test_resume_of_a_missing_folder_says_it_starts_afresh(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"is empty or does not exist, so there is nothing to resume; "
                                         r"starting afresh"):
        _store(tmp_path / "new", resume=True)
    assert torch.equal(open_store(tmp_path / "new")["0"][:], ROWS)


class _Stop(Exception):
    pass


class _FailsAt(nn.Module):
    """Identity that raises on its ``fail_at``-th call (a run killed mid-way)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise _Stop
        return x


def test_run_stopped_before_its_first_shard_is_an_interrupted_store(tmp_path: Path) -> None:
    out = tmp_path / "s"
    with pytest.raises(_Stop):
        extract(nn.Sequential(_FailsAt(2)), TensorDataset(ROWS), "0", out, batch_size=4, progress=False)
    with pytest.raises(StoreError, match=r"is incomplete: its extraction stopped after 0 rows"):
        open_store(out)
    store = open_store(out, allow_incomplete=True)
    assert (store.complete, len(store), store.shards) == (False, 0, [])
    resumed = extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
                      progress=False, resume=True)
    assert torch.equal(resumed["0"][:], ROWS)


def test_shard_seconds_bounds_the_loss_of_a_killed_run(tmp_path: Path) -> None:
    out = tmp_path / "s"
    with pytest.raises(_Stop):  # 1 s of 256 MiB shards: without the time bound, one shard
        extract(nn.Sequential(_FailsAt(3)), TensorDataset(ROWS), "0", out, batch_size=4, progress=False,
                shard_seconds=1e-9)
    store = open_store(out, allow_incomplete=True)
    assert [s.rows for s in store.shards] == [(0, 4), (4, 8)]
    assert torch.equal(store["0"][:], ROWS[:8])


def test_an_empty_folder_is_named_as_a_run_that_never_began(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    with pytest.raises(StoreError, match=r"s is not a hookscope store \(no manifest\.json\): it is "
                                         r"empty: an extraction stopped before it began"):
        open_store(tmp_path / "s")
