"""Damaged stores: a corrupted or truncated shard is found by verify() and by reading, by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hookscope.errors import StoreCorruptError
from hookscope.store.folder import prepare_output
from hookscope.store.reader import open_store
from hookscope.store.shards import CHUNK_BYTES, MANIFEST
from hookscope.store.writer import ShardData, StoreWriter

HEADER = {"model": {"spec": None, "class": "x.Y"}, "extract": {},
          "layers": {"a": {"shape": [256], "dtype": "float32", "ragged": False}}}
ROWS = 4096  # 4 MiB of rows per shard: two checksum chunks per shard file


def _store(folder: Path, shards: int, seed: int) -> tuple[Path, torch.Tensor]:
    """A store of ``3 * ROWS`` random rows in ``shards`` equal shards."""
    prepare_output(folder, resume=False, overwrite=False)
    writer = StoreWriter(folder, HEADER)
    rows = torch.randn(3 * ROWS, 256, generator=torch.Generator().manual_seed(seed))
    for s, block in enumerate(rows.chunk(shards)):
        shard = ShardData(batches=(s, s + 1))
        shard.append({"a": block}, {}, len(block))
        writer.write(shard)
    writer.finish()
    return folder, rows


@pytest.fixture
def store_folder(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    return _store(tmp_path / "store", 3, seed=0)


def _flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x40
    file.write_bytes(bytes(data))


def test_flipped_byte_found_by_verify_and_by_reading(store_folder: tuple[Path, torch.Tensor]) -> None:
    folder, rows = store_folder
    shard = folder / "shard-00001.safetensors"
    _flip_byte(shard, shard.stat().st_size - 1000)  # a byte of the last rows of shard 1
    store = open_store(folder)  # sizes are right: opening succeeds
    with pytest.raises(StoreCorruptError, match=r"shard shard-00001\.safetensors .* xxh3_128"):
        store.verify()
    with pytest.raises(StoreCorruptError, match=r"shard-00001\.safetensors .* fail their checksum"):
        store["a"][2 * ROWS - 2]
    with pytest.raises(StoreCorruptError, match=r"shard-00001\.safetensors"):
        store.dataset("a")[2 * ROWS - 1]
    # rows elsewhere are intact and still readable
    assert torch.equal(store["a"][:ROWS], rows[:ROWS])
    assert torch.equal(store["a"][2 * ROWS:], rows[2 * ROWS:])


def test_flipped_header_byte_found_when_the_shard_is_opened(
        store_folder: tuple[Path, torch.Tensor]) -> None:
    folder, _ = store_folder
    _flip_byte(folder / "shard-00002.safetensors", 20)
    store = open_store(folder)
    with pytest.raises(StoreCorruptError, match=r"shard-00002\.safetensors"):
        store["a"][-1]


def test_truncated_shard_found_at_open_and_by_verify(store_folder: tuple[Path, torch.Tensor]) -> None:
    folder, _ = store_folder
    shard = folder / "shard-00000.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 4096)
    with pytest.raises(StoreCorruptError,
                       match=rf"shard-00000\.safetensors .* has {size - 4096} bytes, the "
                             rf"manifest says {size}: it is truncated"):
        open_store(folder)


def test_missing_shard_found_at_open(store_folder: tuple[Path, torch.Tensor]) -> None:
    folder, _ = store_folder
    (folder / "shard-00002.safetensors").unlink()
    with pytest.raises(StoreCorruptError, match=r"shard-00002\.safetensors .* is missing"):
        open_store(folder)


def test_shard_replaced_after_open_found_by_verify(store_folder: tuple[Path, torch.Tensor]) -> None:
    folder, _ = store_folder
    store = open_store(folder)
    with open(folder / "shard-00001.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(StoreCorruptError, match=r"shard-00001\.safetensors .* truncated"):
        store.verify()
    with pytest.raises(StoreCorruptError, match=r"shard-00001\.safetensors .* truncated"):
        store["a"][ROWS]


def test_damaged_manifest_is_named(store_folder: tuple[Path, torch.Tensor]) -> None:
    folder, _ = store_folder
    text = (folder / MANIFEST).read_text()
    (folder / MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(StoreCorruptError, match=r"cannot read .*manifest\.json"):
        open_store(folder)



@pytest.fixture
def one_shard(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A store of one 12 MiB shard: checksum chunk 1 lies wholly inside the rows."""
    return _store(tmp_path / "store", 1, seed=1)


ROW_BYTES = 256 * 4


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(0, 3 * ROWS * ROW_BYTES - 1),
       span=st.tuples(st.integers(0, 3 * ROWS), st.integers(0, 3 * ROWS)))
@example(at=CHUNK_BYTES, span=(0, 3 * ROWS))  # chunk 1 read whole: checked on the copy
@example(at=CHUNK_BYTES, span=(ROWS + 100, ROWS + 200))  # chunk 1 read in part
def test_any_read_over_a_damaged_byte_fails_and_others_return_the_rows(
        one_shard: tuple[Path, torch.Tensor], at: int, span: tuple[int, int]) -> None:
    """A flipped byte anywhere in the rows: a read of rows that holds a byte of its checksum
    chunk fails, whether it covers that chunk whole (checked on the copy it returns) or in part
    (checked on the mapping); any other read returns the rows."""
    folder, rows = one_shard
    shard = folder / "shard-00000.safetensors"
    pristine = shard.read_bytes()
    data_start = len(pristine) - len(rows) * ROW_BYTES
    try:
        _flip_byte(shard, data_start + at)
        lo, hi = sorted(span)
        begin, end = data_start + lo * ROW_BYTES, data_start + hi * ROW_BYTES
        chunk = (data_start + at) // CHUNK_BYTES
        store = open_store(folder)
        if begin < end and begin // CHUNK_BYTES <= chunk <= (end - 1) // CHUNK_BYTES:
            with pytest.raises(StoreCorruptError, match=r"shard-00000\.safetensors .* fail their checksum"):
                store["a"][lo:hi]
        else:
            assert torch.equal(store["a"][lo:hi], rows[lo:hi])
        store.close()
    finally:
        shard.write_bytes(pristine)
