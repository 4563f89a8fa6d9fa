"""Resume does not re-read the store (issue 33): listed shards are checked by size, the run id in
their header and the last shard's final chunk, so the bytes a resume reads are a small fraction
of the shards it appends to (counted by the kernel: ``rchar`` of ``/proc/self/io``, every byte
any read call of this process returned; and no shard is memory-mapped but the new ones). Damage
the cheap checks do not see is caught when the rows are read and by ``verify()``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.errors import StoreCorruptError, StoreExistsError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from hookscope.store.shards import CHUNK_BYTES

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(),
                                reason="counts bytes read with Linux's /proc/self/io")
ROWS = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))  # 1 MiB in 64 rows
SHARD = 2**18  # 16 rows, 4 shards


def _extract(out: Path, rows: torch.Tensor = ROWS, **options: Any) -> None:
    extract(nn.Sequential(nn.Identity()), TensorDataset(rows), "0", out, batch_size=8,
            shard_bytes=SHARD, progress=False, **options)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


_MAPS: list[int] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _MAPS is not None and event == "mmap.__new__":
        _MAPS.append(os.fstat(args[0]).st_size)  # the size of the file mapped


sys.addaudithook(_audit)  # cannot be removed: it records only while _MAPS is a list


def _interrupted(out: Path) -> tuple[int, int]:
    """A store of ``ROWS`` cut back to its first 3 shards (a run killed after them); return
    the bytes of the listed shards and of the largest one."""
    _extract(out)
    manifest = json.loads((out / "manifest.json").read_text())
    kept = manifest["shards"][:3]
    for entry in manifest["shards"][3:]:
        (out / entry["file"]).unlink()
    manifest.update(complete=False, shards=kept, rows=kept[-1]["rows"][1])
    (out / "manifest.json").write_text(json.dumps(manifest))
    return sum(e["bytes"] for e in kept), max(e["bytes"] for e in kept)


def test_resume_reads_a_few_kib_of_the_listed_shards_not_their_bytes(tmp_path: Path) -> None:
    global _MAPS
    listed, largest = _interrupted(tmp_path / "s")
    assert listed > 3 * 2**18 and largest < CHUNK_BYTES  # 3 shards of 256 KiB, one chunk each
    _MAPS = []
    try:
        before = _rchar()
        _extract(tmp_path / "s", resume=True)
        read = _rchar() - before
    finally:
        maps, _MAPS = _MAPS, None
    # the last listed shard's final chunk (here the whole shard: it is under a chunk), the other
    # shards' headers and the manifest; the digest of every listed shard read 3x more before
    assert largest <= read < largest + 64 * 1024, (read, listed)
    assert maps == []  # none: a new shard's chunk sums are taken from memory as it is written
    print(f"\nresume read {read} bytes of {listed} listed")
    assert torch.equal(open_store(tmp_path / "s")["0"][:], ROWS)


def test_damage_in_an_earlier_shard_is_caught_on_read_and_by_verify(tmp_path: Path) -> None:
    _interrupted(tmp_path / "s")
    shard = tmp_path / "s" / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the rows: the cheap resume checks do not read it
    shard.write_bytes(bytes(raw))
    _extract(tmp_path / "s", resume=True)
    assert shard.read_bytes() == bytes(raw)  # left as it was found
    store = open_store(tmp_path / "s")
    assert torch.equal(store["0"][16:], ROWS[16:])
    with pytest.raises(StoreCorruptError, match=r"shard shard-00000\.safetensors .* fail their "
                                                r"checksum"):
        store["0"][:16]
    with pytest.raises(StoreCorruptError, match=r"shard shard-00000\.safetensors .* xxh3_128"):
        open_store(tmp_path / "s", verify_reads=False).verify()


@pytest.mark.parametrize("where", ["last shard's rows", "header run id"])
def test_resume_refuses_damage_its_checks_see_and_changes_nothing(tmp_path: Path,
                                                                  where: str) -> None:
    _interrupted(tmp_path / "s")
    run = json.loads((tmp_path / "s" / "manifest.json").read_text())["run"]
    name = "shard-00002.safetensors" if where.startswith("last") else "shard-00000.safetensors"
    raw = (tmp_path / "s" / name).read_bytes()
    if where.startswith("last"):
        raw = raw[:-1] + bytes([raw[-1] ^ 1])
    else:
        raw = raw.replace(run.encode(), ("0" * 32).encode(), 1)
    (tmp_path / "s" / name).write_bytes(raw)
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    with pytest.raises(StoreExistsError, match=rf"'{name}': listed by the manifest, but .*run id "
                                               rf"or final chunk differ"):
        _extract(tmp_path / "s", resume=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before
