"""Issue 26's store attack as generated tests, on a store with a ragged layer and id and label
columns: each damaged store either raises a hookscope error (clean) or reads back exactly the
pristine rows (the damage changed nothing read); each planted user file survives overwrite and
resume. ``_damage_outcome`` / ``_planted_outcome`` classify one attack: "clean", "intact",
"raw ..." (another exception), "silent" (wrong rows) or "lost" (a user file gone or changed)."""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from hookscope.errors import HookscopeError, StoreCorruptError, StoreExistsError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from hookscope.store.shards import chunk_sums

OK = {"clean", "intact"}
# (attack, outcome) -> count, over this process: a driver reruns the module with more examples
# (HOOKSCOPE_ATTACK_EXAMPLES) and reads the figures from here
OUTCOMES: Counter[tuple[str, str]] = Counter()
SETTINGS = settings(max_examples=int(os.environ.get("HOOKSCOPE_ATTACK_EXAMPLES", "25")),
                    deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


class _Tokens(Dataset[tuple[dict[str, torch.Tensor], str]]):
    """12 token rows of 1..4 real tokens (both layers ragged), each labelled with a str."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], str]:
        mask = (torch.arange(4) < 1 + i % 4).long()
        return {"ids": torch.arange(4) + i, "attention_mask": mask}, f"label-{i % 3}"


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 3), nn.Linear(3, 2)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def _extract(out: Path, **options: Any) -> None:
    torch.manual_seed(0)
    extract(_Encoder(), _Tokens(), ["embed", "head"], out, batch_size=4, progress=False,
            **{"shard_bytes": 200, **options})


def _contents(store: Path) -> Any:
    s = open_store(store)
    s.verify()
    ids = s.ids
    return ([r.tolist() for r in s["embed"][:]], [r.tolist() for r in s["head"][:]],
            ids.tolist() if isinstance(ids, torch.Tensor) else ids, s.labels)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("figures") / "store"
    _extract(out)
    return out, _contents(out)


def _copy(source: Path, to: Path) -> Path:
    to.mkdir()
    for f in source.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def _damage_outcome(store: Path, pristine: Any, attack: str) -> str:
    try:
        got = _contents(store)
        outcome = "intact" if got == pristine else "silent"
    except HookscopeError:
        outcome = "clean"
    except Exception as err:  # noqa: BLE001  (what the attack counts)
        outcome = f"raw {type(err).__name__}: {err}"
    OUTCOMES[attack, outcome.split(":")[0]] += 1
    return outcome


def _reseal(store: Path, k: int, raw: bytes) -> None:
    """Write shard ``k`` as ``raw`` and give the manifest its size, digest and chunk sums."""
    manifest = json.loads((store / "manifest.json").read_text())
    entry = manifest["shards"][k]
    (store / entry["file"]).write_bytes(raw)
    entry.update(bytes=len(raw), xxh3_128=xxhash.xxh3_128(raw).hexdigest(),
                 chunk_sum=chunk_sums(raw, len(raw), manifest["chunk_bytes"]))
    (store / "manifest.json").write_text(json.dumps(manifest))


@SETTINGS
@given(data=st.data())
def test_overlapping_headers_with_checksums_recomputed(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory,
        data: st.DataObject) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("overlap") / "s")
    k = data.draw(st.integers(0, 2), label="shard")
    shard = store / f"shard-{k:05d}.safetensors"
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    names = sorted(n for n in header if n != "__metadata__")
    name = data.draw(st.sampled_from(names), label="tensor")  # layers, @id, @label, offsets
    begin, end = header[name]["data_offsets"]
    size = len(raw) - 8 - length
    start = data.draw(st.integers(0, size - (end - begin)).filter(lambda b: b != begin))
    header[name]["data_offsets"] = [start, start + end - begin]
    text = json.dumps(header).encode()
    _reseal(store, k, struct.pack("<Q", len(text) + -len(text) % 8) + text +
            b" " * (-len(text) % 8) + raw[8 + length:])
    assert _damage_outcome(store, pristine[1], "overlapping headers") == "clean"


_BAD_NUMBERS = [-1, 2**53 + 1, 2**63, 2**64, -(2**63), 10**30, 1.5, True, None, "7", [], 0]


def _number_paths(manifest: dict[str, Any]) -> list[tuple[Any, ...]]:
    paths: list[tuple[Any, ...]] = [("rows",), ("world_size",), ("chunk_bytes",)]
    for k in range(len(manifest["shards"])):
        paths += [("shards", k, "bytes"), *(("shards", k, f, i) for f in ("rows", "batches")
                                            for i in (0, 1))]
    for group in ("layers", "columns"):
        for name, spec in manifest[group].items():
            paths += [(group, name, "shape", i) for i in range(len(spec["shape"]))]
    return paths


@SETTINGS
@given(data=st.data())
def test_every_manifest_number_out_of_range(pristine: tuple[Path, Any],
                                            tmp_path_factory: pytest.TempPathFactory,
                                            data: st.DataObject) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("numbers") / "s")
    manifest = json.loads((store / "manifest.json").read_text())
    *where, last = data.draw(st.sampled_from(_number_paths(manifest)), label="field")
    target = manifest
    for key in where:
        target = target[key]
    target[last] = data.draw(st.sampled_from(_BAD_NUMBERS), label="value")
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert _damage_outcome(store, pristine[1], "numbers out of range") in OK


@SETTINGS
@given(data=st.data())
def test_truncated_files_with_and_without_a_resealed_manifest(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory,
        data: st.DataObject) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("truncated") / "s")
    name = data.draw(st.sampled_from(sorted(p.name for p in store.iterdir())), label="file")
    raw = (store / name).read_bytes()
    cut = raw[:data.draw(st.integers(0, len(raw) - 1), label="length")]
    if name.startswith("shard-") and data.draw(st.booleans(), label="reseal"):
        _reseal(store, int(name[6:11]), cut)
    else:
        (store / name).write_bytes(cut)
    assert _damage_outcome(store, pristine[1], "truncation") == "clean"


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [path] + [p for k, v in value.items() for p in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [path] + [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))]
    return [path]


@SETTINGS
@given(data=st.data())
def test_manifest_edits_anywhere(pristine: tuple[Path, Any],
                                 tmp_path_factory: pytest.TempPathFactory,
                                 data: st.DataObject) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("edits") / "s")
    manifest = json.loads((store / "manifest.json").read_text())
    *where, last = data.draw(st.sampled_from([p for p in _leaves(manifest) if p]), label="at")
    target = manifest
    for key in where:
        target = target[key]
    if data.draw(st.booleans(), label="delete") and isinstance(target, dict):
        del target[last]
    else:
        target[last] = data.draw(_JSON, label="value")
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert _damage_outcome(store, pristine[1], "manifest edits") in OK


# ----------------------------------------------------------------- planted user files
def _plant_text(store: Path, name: str, body: bytes) -> None:
    (store / name).write_bytes(body)


def _plant_shard_like(store: Path, name: str, body: bytes) -> None:
    run = json.loads((store / "manifest.json").read_text())["run"]
    other = body.hex()[:32].ljust(32, "0")
    save_file({"embed": torch.zeros(2)}, str(store / name),
              metadata={"format": "hookscope.store", "version": "1",
                        "run": other if other != run else "f" * 32})


_NAMES = st.one_of(
    st.builds(lambda s: f".manifest.json.tmp-{s}", st.text("0123456789abcdef-", max_size=50)),
    st.builds(lambda n, r, p, x: f".shard-{n:05d}.safetensors.tmp-{r}-{p}-{x}",
              st.integers(0, 99), st.text("0123456789abcdef", min_size=32, max_size=32),
              st.integers(1, 99999), st.text("0123456789abcdef", min_size=8, max_size=8)),
    st.builds(lambda n: f"shard-{n:05d}.safetensors", st.integers(3, 99999)),
    st.builds(lambda n: f"shard-r{n:04d}-00000.safetensors", st.integers(0, 9)),
    st.builds(lambda n: f"manifest-r{n:04d}.json", st.integers(0, 9)),
    st.sampled_from(["notes.txt", ".DS_Store", "manifest.json.bak", "README"]),
)


def _planted_outcome(store: Path, name: str, body: bytes, plant: Callable[..., None],
                     option: str) -> str:
    plant(store, name, body)
    before = (store / name).read_bytes()
    try:
        _extract(store, **{option: True})
        error = None
    except HookscopeError as err:
        error = err
    except Exception as err:  # noqa: BLE001  (what the attack counts)
        OUTCOMES[f"planted files, {option}", "raw"] += 1
        return f"raw {type(err).__name__}: {err}"
    if not (store / name).is_file() or (store / name).read_bytes() != before:
        outcome = "lost"
    else:
        outcome = "clean" if error is not None else "kept"
    OUTCOMES[f"planted files, {option}", outcome] += 1
    return outcome


@SETTINGS
@given(name=_NAMES, body=st.binary(max_size=64), shard_like=st.booleans(),
       option=st.sampled_from(["overwrite", "resume"]))
def test_planted_user_files_survive_overwrite_and_resume(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory, name: str,
        body: bytes, shard_like: bool, option: str) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("planted") / "s")
    plant = _plant_shard_like if shard_like and name.endswith(".safetensors") else _plant_text
    assert _planted_outcome(store, name, body, plant, option) == "clean"


# ----------------------------------------------- every manifest field against the schema
_BAD_FIELDS: dict[tuple[str, str], list[Any]] = {
    ("extract", "batches"): [2**70, 2**53 + 1, -4, 1.5, "3", True, 0, 2, 4],
    ("extract", "batch_size"): [-3, 0, 2**70, True, "4", 1.0, 3, 5],
    ("extract", "layers"): [["nope"], [], "embed", [5], ["embed", "embed"], ["embed"],
                            ["embed", "head", "x"], None],
    ("extract", "reduce"): [{"evil": 1}, 5, "", ["x"], "x" * 5000],
    ("extract", "dtype"): ["half", 5, "complex64", ""],
    ("extract", "evil"): [1, None, "x"],
    ("model", "spec"): [5, ["x"], "", {}],
    ("model", "class"): [["x"], None, 5, ""],
    ("model", "evil"): [1, "x"],
}


def _field_pattern(group: str, key: str) -> str:
    """The error names the field: ``field extract.batches``, ``field model['evil']``, or, for a
    batch size that the shards' rows contradict, the shard and ``extract.batch_size``."""
    return rf"(field |of ){group}(\.{key}|\['{key}'\])"


@SETTINGS
@given(data=st.data())
def test_model_and_extract_fields_are_typed_ranged_and_members(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory,
        data: st.DataObject) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("fields") / "s")
    group, key = data.draw(st.sampled_from(sorted(_BAD_FIELDS)), label="field")
    value = data.draw(st.sampled_from(_BAD_FIELDS[group, key]), label="value")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest[group][key] = value
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match=_field_pattern(group, key)):
        open_store(store)
    assert _damage_outcome(store, pristine[1], "manifest fields") == "clean"


def test_resume_refuses_a_negative_batch_size_instead_of_advising_it(
        pristine: tuple[Path, Any], tmp_path: Path) -> None:
    store = _copy(pristine[0], tmp_path / "s")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["extract"]["batch_size"] = -3
    (store / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    with pytest.raises(StoreExistsError, match=r"field extract\.batch_size must be") as err:
        _extract(store, resume=True)
    assert "-3 (" not in str(err.value)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before


@SETTINGS
@given(data=st.data())
def test_shard_batch_ranges_tile_the_batches_with_their_rows(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory,
        data: st.DataObject) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("batches") / "s")
    manifest = json.loads((store / "manifest.json").read_text())
    assert [s["batches"] for s in manifest["shards"]] == [[0, 1], [1, 2], [2, 3]]
    assert manifest["extract"]["batches"] == 3  # 12 rows in batches of 4: the only tiling
    pair = st.tuples(st.integers(0, 6), st.integers(1, 4)).map(lambda p: [p[0], p[0] + p[1]])
    for entry in manifest["shards"]:
        entry["batches"] = data.draw(st.just(entry["batches"]) | pair, label="batches")
    total = data.draw(st.sampled_from([3, 3, 1, 2, 4, 7]), label="extract.batches")
    manifest["extract"]["batches"] = total
    (store / "manifest.json").write_text(json.dumps(manifest))
    tiled = total == 3 and [s["batches"] for s in manifest["shards"]] == [[0, 1], [1, 2], [2, 3]]
    assert _damage_outcome(store, pristine[1], "batch ranges") == ("intact" if tiled else "clean")


def test_the_attackers_batches_0_7_and_7_8_for_10_rows_of_3_are_refused(tmp_path: Path) -> None:
    extract(nn.Sequential(nn.Linear(4, 2)), TensorDataset(torch.randn(10, 4)), "0",
            tmp_path / "s", batch_size=3, shard_bytes=1, progress=False)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]] == [[0, 3], [3, 6], [6, 9], [9, 10]]
    manifest["extract"]["batches"] = 10
    for entry, batches in zip(manifest["shards"], [[0, 7], [7, 8], [8, 9], [9, 10]]):
        entry["batches"] = batches
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match=r"field shards\[0\]\.rows holds 3 rows, but "
                                                r"batches 0\.\.6 of extract\.batch_size 3 "
                                                r"rows give 21"):
        open_store(tmp_path / "s")


# ----------------------------------------------------------------- shard headers
def _header(store: Path, k: int) -> tuple[dict[str, Any], bytes]:
    raw = (store / f"shard-{k:05d}.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _with_header(text: bytes, data: bytes) -> bytes:
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@SETTINGS
@given(k=st.integers(0, 2), kind=st.sampled_from(["other run", "no metadata", "other format"]),
       other=st.text("0123456789abcdef", min_size=32, max_size=32))
def test_a_shard_of_another_run_or_without_metadata_is_refused(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory, k: int, kind: str,
        other: str) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("metadata") / "s")
    header, data = _header(store, k)
    run = header["__metadata__"]["run"]
    if kind == "no metadata":
        del header["__metadata__"]
    else:
        header["__metadata__"].update({"other run": {"run": other if other != run else "0" * 32},
                                       "other format": {"format": "x"}}[kind])
    _reseal(store, k, _with_header(json.dumps(header).encode(), data))
    with pytest.raises(StoreCorruptError, match=rf"shard-{k:05d}\.safetensors: field "
                                                rf"header\.__metadata__"):
        open_store(store).verify()
    assert _damage_outcome(store, pristine[1], "shard metadata") == "clean"


def test_a_store_from_before_run_ids_still_reads(pristine: tuple[Path, Any],
                                                 tmp_path: Path) -> None:
    store = _copy(pristine[0], tmp_path / "s")
    for k in range(3):
        header, data = _header(store, k)
        del header["__metadata__"]
        _reseal(store, k, _with_header(json.dumps(header).encode(), data))
    manifest = json.loads((store / "manifest.json").read_text())
    del manifest["run"]
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert _contents(store) == pristine[1]


@SETTINGS
@given(k=st.integers(0, 2), data=st.data())
def test_a_tensor_named_twice_in_a_header_is_refused(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory, k: int,
        data: st.DataObject) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("twice") / "s")
    header, body = _header(store, k)
    names = sorted(n for n in header if n != "__metadata__")
    name = data.draw(st.sampled_from(names), label="named twice")
    source = data.draw(st.sampled_from(names), label="pointing at")
    first = f"{json.dumps(name)}: {json.dumps(header[source])}, ".encode()
    _reseal(store, k, _with_header(b"{" + first + json.dumps(header).encode()[1:], body))
    with pytest.raises(StoreCorruptError, match=rf"key {name!r} appears twice"):
        open_store(store).verify()
    assert _damage_outcome(store, pristine[1], "duplicate keys") == "clean"


@SETTINGS
@given(row=st.integers(0, 11), text=st.binary(min_size=7, max_size=7))
def test_text_columns_are_strict_utf8_naming_column_and_row(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory, row: int,
        text: bytes) -> None:
    store = _copy(pristine[0], tmp_path_factory.mktemp("utf8") / "s")
    k, local = divmod(row, 4)  # one batch of 4 rows a shard
    header, body = _header(store, k)
    begin = header["@label"]["data_offsets"][0] + 7 * local  # each label is 7 bytes: label-N
    body = body[:begin] + text + body[begin + 7:]
    _reseal(store, k, _with_header(json.dumps(header).encode(), body))
    try:
        expected = text.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(StoreCorruptError, match=rf"column @label, row {row}: its bytes are "
                                                    rf"not UTF-8"):
            assert open_store(store).labels is None
        assert _damage_outcome(store, pristine[1], "text columns") == "clean"
        return
    labels = pristine[1][3]
    assert open_store(store).labels == [*labels[:row], expected, *labels[row + 1:]]


# ------------------------------------------------------- resume over edited listed shards
def _interrupted(pristine: Path, to: Path) -> Path:
    """The pristine store as a run killed after its second shard leaves it."""
    store = _copy(pristine, to)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / manifest["shards"][2]["file"]).unlink()
    manifest.update(complete=False, shards=manifest["shards"][:2],
                    rows=manifest["shards"][1]["rows"][1])
    (store / "manifest.json").write_text(json.dumps(manifest))
    return store


def test_resume_of_an_intact_interrupted_store_gives_the_pristine_rows(
        pristine: tuple[Path, Any], tmp_path: Path) -> None:
    store = _interrupted(pristine[0], tmp_path / "s")
    _extract(store, resume=True)
    assert _contents(store) == pristine[1]


@SETTINGS
@given(k=st.integers(0, 1), data=st.data())
def test_resume_over_a_listed_shard_edited_or_replaced_is_never_silent_and_loses_nothing(
        pristine: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory, k: int,
        data: st.DataObject) -> None:
    """A resume checks listed shards cheaply (size, run id in the header, the last shard's final
    chunk; issue 33), so it refuses the damage those see, changing nothing; other damage it
    appends beside, leaving the shard as found, and reading it is a clean error."""
    store = _interrupted(pristine[0], tmp_path_factory.mktemp("resume") / "s")
    shard = store / f"shard-{k:05d}.safetensors"
    raw = bytearray(shard.read_bytes())
    if data.draw(st.booleans(), label="replace"):
        raw = bytearray(data.draw(st.binary(min_size=len(raw), max_size=len(raw))
                                  .filter(lambda b: b != bytes(raw)), label="bytes"))
    else:
        raw[data.draw(st.integers(0, len(raw) - 1), label="at")] ^= data.draw(st.integers(1, 255))
    shard.write_bytes(bytes(raw))
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    try:
        _extract(store, resume=True)
    except StoreExistsError as err:
        assert f"'{shard.name}': listed by the manifest, but" in str(err)
        assert {p.name: p.read_bytes() for p in store.iterdir()} == before
        return
    assert k == 0  # the last listed shard is under one chunk: its final chunk is all of it
    assert shard.read_bytes() == bytes(raw)
    assert _damage_outcome(store, pristine[1], "resume over an edited shard") == "clean"

