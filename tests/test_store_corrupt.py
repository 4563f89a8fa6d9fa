"""Damaged stores: a corrupted or truncated shard is found by verify() and by reading, by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookscope.errors import StoreCorruptError
from hookscope.store.folder import prepare_output
from hookscope.store.reader import MANIFEST, open_store
from hookscope.store.writer import ShardData, StoreWriter

HEADER = {"model": {"spec": None, "class": "x.Y"}, "extract": {},
          "layers": {"a": {"shape": [256], "dtype": "float32", "ragged": False}}}
ROWS = 4096  # 4 MiB of rows per shard: two checksum chunks per shard file


@pytest.fixture
def store_folder(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    folder = tmp_path / "store"
    prepare_output(folder, resume=False, overwrite=False)
    writer = StoreWriter(folder, HEADER)
    rows = torch.randn(3 * ROWS, 256, generator=torch.Generator().manual_seed(0))
    for s in range(3):
        shard = ShardData(batches=(s, s + 1))
        shard.append({"a": rows[s * ROWS:(s + 1) * ROWS]}, {}, ROWS)
        writer.write(shard)
    writer.finish()
    return folder, rows


def _flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x40
    file.write_bytes(bytes(data))


def test_flipped_byte_found_by_verify_and_by_reading(store_folder: tuple[Path, torch.Tensor]) -> None:
    folder, rows = store_folder
    shard = folder / "shard-00001.safetensors"
    _flip_byte(shard, shard.stat().st_size - 1000)  # a byte of the last rows of shard 1
    store = open_store(folder)  # sizes are right: opening succeeds
    with pytest.raises(StoreCorruptError, match=r"shard shard-00001\.safetensors .* sha256"):
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
