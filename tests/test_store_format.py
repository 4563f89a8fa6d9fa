"""Store format: rows written by StoreWriter read back exactly, readable by safetensors itself."""

from __future__ import annotations

import gc
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from hookscope.errors import StoreCorruptError, StoreError, StoreExistsError
from hookscope.store.folder import prepare_output
from hookscope.store.reader import open_store
from hookscope.store.shards import MANIFEST, ChunkSums, chunk_sums
from hookscope.store.writer import ShardData, StoreWriter, join_parts

HEADER = {"model": {"spec": "test", "class": "x.Y"}, "extract": {},
          "layers": {"a": {"shape": [3], "dtype": "float32", "ragged": False},
                     "t": {"shape": [None, 2], "dtype": "bfloat16", "ragged": True}},
          "run": "5e" * 16}  # the ranks of one torchrun share the run id


def _write(folder: Path, n_shards: int = 3, *, rank: int = 0, world_size: int = 1, seed: int = 0,
           finish: bool = True, first_batch: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Write ``n_shards`` shards of two batches of 4 rows; return layer a's rows, t's rows."""
    g = torch.Generator().manual_seed(seed)
    fixed, ragged = [], []
    writer = StoreWriter(folder, HEADER, rank=rank, world_size=world_size)
    for s in range(n_shards):
        shard = ShardData(batches=(first_batch + 2 * s, first_batch + 2 * s + 2))
        for _ in range(2):
            a = torch.randn(4, 3, generator=g)
            lengths = torch.tensor([0, 3, 1, 5])  # a row with no token at all
            t = torch.randn(int(lengths.sum()), 2, generator=g).bfloat16()
            shard.append({"a": a, "t": t}, {"t": lengths}, 4)
            fixed.append(a)
            ragged += list(torch.split(t, lengths.tolist()))
        writer.write(shard)
    if finish:
        writer.finish()
    return torch.cat(fixed), ragged


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "store"
    prepare_output(out, resume=False, overwrite=False)
    return out


def test_rows_read_back_exactly_across_shards(folder: Path) -> None:
    fixed, ragged = _write(folder)
    store = open_store(folder)
    assert len(store) == 24 and list(store.layers) == ["a", "t"]
    assert store.layers["a"].shape == (3,) and store.layers["a"].dtype == torch.float32
    assert store.layers["t"].ragged and store.layers["t"].shape == (None, 2)
    a = store["a"]
    assert torch.equal(a[:], fixed)
    assert torch.equal(a[5:19], fixed[5:19])  # spans three shards
    assert torch.equal(a[-1], fixed[-1]) and torch.equal(a[7], fixed[7])
    assert torch.equal(a[::5], fixed[::5])
    assert torch.equal(a[[17, 0, 9]], fixed[[17, 0, 9]])
    assert torch.equal(a[torch.tensor([3, 3])], fixed[[3, 3]])
    assert a[4:4].shape == (0, 3) and a[[]].shape == (0, 3)
    rows = store["t"][:]
    assert len(rows) == 24 and all(torch.equal(r, e) for r, e in zip(rows, ragged))
    assert store["t"][0].shape == (0, 2) and store["t"][3].shape == (5, 2)
    assert all(torch.equal(r, e) for r, e in zip(store["t"][6:10], ragged[6:10]))


def _mapped_kib(folder: Path) -> dict[str, int]:
    """Resident KiB of this process's mappings of each file in ``folder`` (/proc/self/smaps)."""
    found: dict[str, int] = {}
    name = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 6 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
            name = head[5] if head[5].startswith(str(folder)) else None
        elif head and head[0] == "Rss:" and name is not None:
            found[name] = found.get(name, 0) + int(head[1])
    return found


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc")
def test_close_unmaps_the_shards_and_the_store_is_a_context(folder: Path) -> None:
    """Rows read stay mapped (resident) until close(); the with block closes (issue 34)."""
    fixed, _ = _write(folder)
    with open_store(folder) as store:
        assert _mapped_kib(folder) == {}  # nothing mapped before a read
        assert torch.equal(store["a"][:], fixed)
        resident = _mapped_kib(folder)
        assert sorted(Path(p).name for p in resident) == [s.file for s in store.shards]
        assert all(kib >= 4 for kib in resident.values())  # at least the page read
    assert _mapped_kib(folder) == {}
    with pytest.raises(StoreError, match=r"is closed: open it again with "
                                         r"hookscope.open_store\("):
        store["a"][0]
    with pytest.raises(StoreError, match="is closed"):
        store.tokens("t")
    with pytest.raises(StoreError, match="is closed"):
        store.verify()
    store.close()  # twice is fine
    again = open_store(folder)
    assert torch.equal(again["a"][7], fixed[7])
    again._shards[0].open()
    view = np.frombuffer(again._shards[0]._mm, np.uint8, 8, 0)  # a read in progress
    again.close()  # mmap.close() refuses while a view exists: unmapped when the view goes
    with pytest.raises(StoreError, match="is closed"):
        again["a"][0]
    del view
    gc.collect()
    assert _mapped_kib(folder) == {}


def test_index_errors_name_the_problem(folder: Path) -> None:
    _write(folder, 1)
    store = open_store(folder)
    with pytest.raises(IndexError, match="row 8 out of range for layer 'a' of 8 rows"):
        store["a"][8]
    with pytest.raises(StoreError, match=r"has no layer 'b'; it has \['a', 't'\]"):
        store["b"]


def test_shards_are_plain_safetensors_files(folder: Path) -> None:
    fixed, ragged = _write(folder, 2)
    with safe_open(str(folder / "shard-00001.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["a", "t", "t:offsets"]
        run = json.loads((folder / MANIFEST).read_text())["run"]
        assert f.metadata() == {"format": "hookscope.store", "version": "2", "run": run}
        assert torch.equal(f.get_tensor("a"), fixed[8:16])
        offsets = f.get_tensor("t:offsets")
        assert offsets.tolist() == [0, 0, 3, 4, 9, 9, 12, 13, 18]
        assert torch.equal(f.get_tensor("t")[3:4], ragged[10])


def test_manifest_lists_shards_with_rows_bytes_and_checksums(folder: Path) -> None:
    _write(folder, 2)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["format"] == "hookscope.store" and manifest["version"] == 2
    assert manifest["complete"] is True and manifest["rows"] == 16
    assert manifest["model"] == {"spec": "test", "class": "x.Y"}
    first, second = manifest["shards"]
    assert first["file"] == "shard-00000.safetensors" and first["rows"] == [0, 8]
    assert second["rows"] == [8, 16] and second["batches"] == [2, 4]
    assert second["bytes"] == (folder / second["file"]).stat().st_size
    for entry in manifest["shards"]:  # XXH3-128 of the file (sha256 in a version-1 store)
        data = (folder / entry["file"]).read_bytes()
        assert "sha256" not in entry and entry["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()
    assert second["chunk_sum"] == chunk_sums((folder / second["file"]).read_bytes(), second["bytes"])
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "shard-00000.safetensors",
                                                       "shard-00001.safetensors"]


def test_incomplete_store_is_refused_unless_asked(folder: Path) -> None:
    fixed, _ = _write(folder, 2, finish=False)
    with pytest.raises(StoreError, match=r"stopped after 16 rows\. Resume it \(resume=True"):
        open_store(folder)
    store = open_store(folder, allow_incomplete=True)
    assert not store.complete and torch.equal(store["a"][:], fixed)


def test_parts_of_ranks_join_in_rank_order(folder: Path) -> None:
    rank0, _ = _write(folder, 2, rank=0, world_size=2, seed=1)
    rank1, _ = _write(folder, 1, rank=1, world_size=2, seed=2, first_batch=4)
    with pytest.raises(StoreError, match="interrupted run over 2"):
        open_store(folder)
    join_parts(folder, 2)
    store = open_store(folder)
    assert [s.file for s in store.shards] == ["shard-r0000-00000.safetensors",
                                             "shard-r0000-00001.safetensors",
                                             "shard-r0001-00000.safetensors"]
    assert [s.rows for s in store.shards] == [(0, 8), (8, 16), (16, 24)]
    assert torch.equal(store["a"][:], torch.cat([rank0, rank1]))
    assert not list(folder.glob("manifest-r*.json"))


def test_parts_that_do_not_follow_each_other_are_not_joined(folder: Path) -> None:
    _write(folder, 2, rank=0, world_size=2)  # batches 0..4
    _write(folder, 1, rank=1, world_size=2, first_batch=6)  # batches 6..8: 4 and 5 are missing
    with pytest.raises(StoreCorruptError, match="starts at batch 6, but the shard before it ends "
                                                "at batch 4"):
        join_parts(folder, 2)
    assert not (folder / MANIFEST).exists()


def test_existing_output_is_never_replaced_without_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "store"
    prepare_output(out, resume=False, overwrite=False)
    _write(out, 1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(StoreExistsError, match=r"pass overwrite=True \(--overwrite\)"):
        prepare_output(out, resume=False, overwrite=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    prepare_output(out, resume=False, overwrite=True)
    assert list(out.iterdir()) == []


def test_overwrite_refuses_a_folder_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreExistsError,
                       match=r"not a hookscope store \(no manifest\.json; it holds .notes\.txt.\)"):
        prepare_output(tmp_path, resume=False, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_leftover_temporary_files_of_this_run_are_removed_on_resume(folder: Path) -> None:
    _write(folder, 1, finish=False)
    run = json.loads((folder / MANIFEST).read_text())["run"]
    (folder / f".shard-00001.safetensors.tmp-{run}-123-0a1b2c3d").write_bytes(b"half a shard")
    prepare_output(folder, resume=True, overwrite=False)
    assert not list(folder.glob(".*"))


def test_dataset_works_in_dataloader_workers(folder: Path) -> None:
    fixed, _ = _write(folder, 3)
    store = open_store(folder)
    store["a"][0]  # open a shard in the parent: workers must not inherit a broken state
    loader = torch.utils.data.DataLoader(store.dataset("a"), batch_size=5, num_workers=2)
    assert torch.equal(torch.cat(list(loader)), fixed)
    copy = pickle.loads(pickle.dumps(store.dataset("a")))  # what spawn'ed workers receive
    assert len(copy) == 24 and torch.equal(copy[13], fixed[13])


def test_chunk_sum_is_the_documented_weighted_word_sum() -> None:
    data = bytes(range(256)) * 40 + b"\x07\x01\x02"  # 10243 bytes: 2 pages and a padded third
    padded = data.ljust(3 * 4096, b"\0")
    page_sums = [sum(int.from_bytes(padded[i:i + 8], "little") for i in range(p, p + 4096, 8))
                 for p in range(0, 3 * 4096, 4096)]
    expected = sum((2 * p + 1) * s for p, s in enumerate(page_sums)) % 2**64
    assert chunk_sums(data, len(data), chunk_bytes=2**20) == [f"{expected:016x}"]
    halves = chunk_sums(data, len(data), chunk_bytes=8192)
    assert len(halves) == 2 and halves[1] == chunk_sums(data[8192:], 2051, chunk_bytes=8192)[0]


@given(size=st.integers(0, 5 * 8192 + 100), cuts=st.lists(st.integers(0, 5 * 8192 + 100), max_size=8),
       chunk_bytes=st.sampled_from([1024, 4096, 6000, 8192, 12288]), seed=st.integers(0, 2**16))
def test_chunk_sums_of_pieces_as_written_equal_those_of_the_whole(
        size: int, cuts: list[int], chunk_bytes: int, seed: int) -> None:
    """The writer sums each shard's pieces as it writes them (``ChunkSums``), cut anywhere:
    inside a page, on a page or chunk boundary, into empty pieces, chunks of whole pages or not
    (a test's 1 KiB); the sums are those of the file's bytes read whole (``chunk_sums``, what
    readers check)."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    bounds = sorted({0, size, *(c for c in cuts if c <= size)})
    summed = ChunkSums(chunk_bytes)
    for begin, end in zip(bounds, bounds[1:]):
        summed.update(memoryview(data)[begin:end])
    assert summed.finish() == chunk_sums(data, size, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("position", [0, 8, 4095, 4096 + 7, 10242])
def test_chunk_sum_catches_a_flipped_top_bit_anywhere(position: int) -> None:
    data = bytearray(bytes(range(256)) * 40 + b"\x07\x01\x02")
    before = chunk_sums(bytes(data), len(data))
    data[position] ^= 0x80  # the top bit of a byte, and of a word for 4095 and 4096 + 7
    assert chunk_sums(bytes(data), len(data)) != before


def test_chunk_sum_catches_pages_that_trade_places() -> None:
    data = torch.randint(0, 256, (8192,), dtype=torch.uint8).numpy().tobytes()  # two pages
    swapped = data[4096:] + data[:4096]
    assert chunk_sums(swapped, 8192) != chunk_sums(data, 8192)
