"""A damaged or hostile store is refused, never half-read: the manifest schema, shard headers,
file names confined to the store folder (checked with an audit hook on every open), and a
fuzz test that mutates manifests and shards: the rows read are the original ones, or
StoreCorruptError is raised."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hookscope.cli.main import main
from hookscope.errors import StoreCorruptError
from hookscope.store.folder import prepare_output
from hookscope.store.reader import open_store
from hookscope.store.shards import MANIFEST
from hookscope.store.writer import ShardData, StoreWriter

HEADER = {"model": {"spec": None, "class": "x.Y"}, "extract": {},
          "layers": {"a": {"shape": [3], "dtype": "float32", "ragged": False},
                     "b": {"shape": [None, 2], "dtype": "float16", "ragged": True}}}
FIXED = torch.arange(30, dtype=torch.float32).reshape(10, 3)
LENGTHS = torch.tensor([1, 3, 0, 2, 4, 1, 1, 2, 3, 1])
TOKENS = torch.arange(2 * int(LENGTHS.sum()), dtype=torch.float16).reshape(-1, 2)


def _write(folder: Path) -> None:
    prepare_output(folder, resume=False, overwrite=False)
    writer = StoreWriter(folder, HEADER)
    offsets = [0, *LENGTHS.cumsum(0).tolist()]
    for s, (lo, hi) in enumerate([(0, 4), (4, 7), (7, 10)]):
        shard = ShardData(batches=(s, s + 1))
        shard.append({"a": FIXED[lo:hi], "b": TOKENS[offsets[lo]:offsets[hi]]},
                     {"b": LENGTHS[lo:hi]}, hi - lo)
        writer.write(shard)
    writer.finish()


def _ragged_rows() -> list[torch.Tensor]:
    return list(torch.split(TOKENS, LENGTHS.tolist()))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "store"
    _write(out)
    return out


def _read_all(folder: Path) -> tuple[list[str], int, torch.Tensor, list[torch.Tensor]]:
    store = open_store(folder, allow_incomplete=True)
    fixed, ragged = store["a"][:], store["b"][:]
    return sorted(store.layers), len(store), fixed, ragged


def _is_original(read: tuple[list[str], int, torch.Tensor, list[torch.Tensor]]) -> bool:
    names, rows, fixed, ragged = read
    return (names == ["a", "b"] and rows == 10 and torch.equal(fixed, FIXED)
            and len(ragged) == 10 and all(torch.equal(x, y) for x, y in zip(ragged, _ragged_rows())))


def test_the_intact_store_reads_back_and_verifies(folder: Path) -> None:
    assert _is_original(_read_all(folder))
    open_store(folder).verify()
    assert main(["show", "--verify", str(folder)]) == 0


# ------------------------------------------------------------------ the 13 damages of the attack
def _edit(field: str, change: Callable[[dict[str, Any]], None]) -> tuple[str, Any]:
    return field, change


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        target = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _drop(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        target = m
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return change


DAMAGES = {
    "missing complete": (_drop(["complete"]), r"field complete is missing"),
    "missing shards": (_drop(["shards"]), r"field shards is missing"),
    "missing layers": (_drop(["layers"]), r"field layers is missing"),
    "missing digest": (_drop(["shards", 1, "xxh3_128"]), r"field shards\[1\]\.xxh3_128 is missing"),
    "rows as a string": (_set(["shards", 0, "rows"], "0,4"), r"field shards\[0\]\.rows must be"),
    "empty shard": (_set(["shards", 2, "rows"], [7, 7]), r"field shards\[2\]\.rows must be"),
    "short chunk_sum": (_set(["shards", 1, "chunk_sum"], []),
                        r"field shards\[1\]\.chunk_sum has 0 sums"),
    "wrong rows": (_set(["shards", 1, "rows"], [4, 8]), r"field shards\[2\]\.rows starts at 7"),
    "wrong total rows": (_set(["rows"], 11), r"field rows is 11 but the shards hold 10"),
    "wrong shape": (_set(["layers", "a", "shape"], [4]),
                    r"shard-00000\.safetensors: field header\['a'\]\.shape is \[4, 3\]"),
    "wrong dtype size": (_set(["layers", "a", "dtype"], "float64"),
                         r"shard-00000\.safetensors: field header\['a'\]\.dtype must be F64"),
    "chunk_bytes 0": (_set(["chunk_bytes"], 0), r"field chunk_bytes must be a positive"),
    "ragged offsets count": (_set(["shards", 0, "rows"], [0, 3]),
                             r"field shards\[1\]\.rows starts at 4"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_each_damage_is_store_corrupt_error_naming_file_and_field(folder: Path,
                                                                  damage: str) -> None:
    change, message = DAMAGES[damage]
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match=message):
        _read_all(folder)
    assert main(["show", "--verify", str(folder)]) == 1


@pytest.mark.parametrize("value", [[], {}, [["float32"]], {"float32": 1}])
@pytest.mark.parametrize("field", ["layers", "reduce", "batches", "dtype", "batch_size"])
def test_an_unhashable_extract_field_is_store_corrupt_error(folder: Path, field: str,
                                                            value: Any) -> None:
    """A list or object where ``extract`` keeps a name or a count (``extract.dtype: []`` was a
    raw ``TypeError: unhashable type: 'list'`` from the set of dtype names)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["extract"][field] = value
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match=rf"field extract\.{field} must be"):
        _read_all(folder)
    assert main(["show", "--verify", str(folder)]) == 1


def test_invalid_json_is_store_corrupt_error(folder: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    text = (folder / MANIFEST).read_text()
    (folder / MANIFEST).write_text(text[:len(text) // 2])
    with pytest.raises(StoreCorruptError, match=r"cannot read .*manifest\.json: .*damaged"):
        _read_all(folder)
    assert main(["show", "--verify", str(folder)]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_show_verify_fails_on_an_incomplete_store(folder: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["complete"] = False
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert main(["show", str(folder)]) == 0  # describing a half store is fine
    assert main(["show", "--verify", str(folder)]) == 1
    assert "is INCOMPLETE" in capsys.readouterr().err


def test_show_verify_checks_chunk_sums_and_the_digest(folder: Path) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["shards"][2]["xxh3_128"] = "0" * 32  # bytes intact, the manifest's digest wrong
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert _is_original(_read_all(folder))  # reading checks chunk sums, not the digest
    assert main(["show", "--verify", str(folder)]) == 1


# --------------------------------------------------------------- reading only the store's files
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only inside _opened()


class _opened:  # noqa: N801  (used as a context manager, like open)
    def __enter__(self) -> list[str]:
        global _OPENED
        _OPENED = []
        return _OPENED

    def __exit__(self, *exc: object) -> None:
        global _OPENED
        _OPENED = None


def _outside(opened: list[str], folder: Path) -> list[str]:
    root = os.path.realpath(folder)
    return [p for p in opened if os.path.dirname(p) != root and p != root]


@pytest.mark.parametrize("name", ["../victim.safetensors", "/tmp/victim.safetensors",
                                  "sub/shard.safetensors", "..", ".", "", "a\\b", ".hidden"])
def test_a_file_entry_that_is_not_a_plain_name_is_refused(folder: Path, name: str) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["shards"][1]["file"] = name
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with _opened() as opened, pytest.raises(
            StoreCorruptError, match=r"field shards\[1\]\.file must be a plain file name inside"):
        _read_all(folder)
    assert _outside(opened, folder) == []
    assert opened  # the audit hook sees opens (the manifest was read)


def test_a_link_leading_outside_the_store_is_never_opened(folder: Path) -> None:
    victim = folder.parent / "victim.safetensors"
    victim.write_bytes((folder / "shard-00001.safetensors").read_bytes())
    (folder / "shard-00001.safetensors").unlink()
    (folder / "shard-00001.safetensors").symlink_to(victim)
    with _opened() as opened, pytest.raises(StoreCorruptError,
                                            match=r"is a link that leads outside the store"):
        _read_all(folder)
    assert _outside(opened, folder) == []
    (folder / MANIFEST).rename(folder.parent / "elsewhere.json")
    (folder / MANIFEST).symlink_to(folder.parent / "elsewhere.json")
    with _opened() as opened, pytest.raises(StoreCorruptError, match=r"leads outside"):
        open_store(folder)
    assert _outside(opened, folder) == []


# --------------------------------------------------------------------------------- the fuzz test
def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield (*prefix, key)
        yield from _paths(item, (*prefix, key))


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats() |
                     st.text(max_size=8) | st.sampled_from(["shard-00001.safetensors",
                                                            "float64", "../x", [0, 4]]),
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_stores_read_the_original_rows_or_raise_store_corrupt(
        tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    folder = tmp_path_factory.mktemp("fuzz") / "store"
    _write(folder)
    kind = data.draw(st.sampled_from(["field", "delete", "manifest byte", "shard byte",
                                      "shard size"]))
    if kind in ("field", "delete"):
        manifest = json.loads((folder / MANIFEST).read_text())
        path = data.draw(st.sampled_from(list(_paths(manifest))))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if kind == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(_JSON)
        (folder / MANIFEST).write_text(json.dumps(manifest))
    else:
        file = folder / (MANIFEST if kind == "manifest byte" else
                         data.draw(st.sampled_from(["shard-00000.safetensors",
                                                    "shard-00001.safetensors"])))
        raw = bytearray(file.read_bytes())
        if kind == "shard size":
            raw = raw[:data.draw(st.integers(0, len(raw) - 1))] if data.draw(st.booleans()) \
                else raw + b"\0" * data.draw(st.integers(1, 9))
        else:
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        file.write_bytes(bytes(raw))
    with _opened() as opened:
        try:
            read = _read_all(folder)
        except StoreCorruptError:
            read = None
    assert read is None or _is_original(read), f"damaged store accepted: {kind}"
    assert _outside(opened, folder) == []
