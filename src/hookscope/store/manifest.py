"""Private: the store manifest's schema, and the shard headers checked against it.

Nothing of a manifest is used before ``check_manifest`` has checked it: field types, required
fields, every number within ``0..MAX_COUNT`` (2**53, the largest integer every JSON reader keeps
exact, RFC 7493), row ranges (contiguous from 0, none empty), byte sizes, checksum counts, layer
specs, the run id, and that every shard ``file`` is a plain file name inside the store folder.
``check_header`` then checks a shard's safetensors header against the manifest: the tensors it
holds, their dtypes, shapes (rows x row shape) and byte ranges, which must be what safetensors'
own parser demands (sorted by offset they start at 0, each where the one before ends, and end
where the file ends: no overlap, no gap). Every failure is ``StoreCorruptError`` naming the file
and the field, so a damaged or hostile manifest can neither crash a reader with ``KeyError`` /
``IndexError`` nor make it read outside the folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from hookscope.errors import StoreCorruptError
from hookscope.store.fs import RemotePath, StorePath
from hookscope.store.fs import read_regular as read_regular  # the store readers' import

__all__ = ["COLUMN_PREFIX", "DIGESTS", "Digest", "FORMAT", "MAX_MANIFEST_BYTES", "SHARD_NAME", "VERSION",
           "check_file_name",
           "check_header", "check_manifest", "check_metadata", "corrupt", "inside", "parse_json",
           "read_regular", "tensor_specs"]

FORMAT = "hookscope.store"
VERSION = 2  # a new store's; a store keeps the version it was written with (resume included)


@dataclass(frozen=True)
class Digest:
    """A store version's whole-shard digest: the shard entry's field ``name``, holding ``hex``
    lowercase hex digits of ``new()`` (a hashlib-like object) over the shard file's bytes."""

    name: str
    new: Callable[[], Any]
    hex: int


#: store format version -> its shard digest; the versions this hookscope reads. Version 2 hashes
#: with XXH3-128 (``xxhash``, 28 GB/s here) where version 1 took sha256 (1.9 GB/s): on a
#: 2-core machine, in-process, extract of 256 MiB took x1.25 of the forward plus the raw write
#: with sha256 on a thread of its own, x0.86 with XXH3 (both with single-thread staging copies).
#: A digest finds damage, not an attacker: a store is no signed artifact. The chunk sums are
#: the same in both.
DIGESTS = {1: Digest("sha256", hashlib.sha256, 64), 2: Digest("xxh3_128", xxhash.xxh3_128, 32)}
# torch dtype name (as the manifest writes it) -> (safetensors dtype name, bytes per element)
DTYPES = {"float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2),
          "bfloat16": ("BF16", 2), "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2),
          "int8": ("I8", 1), "uint8": ("U8", 1), "bool": ("BOOL", 1)}
COLUMNS = ("id", "label", "token")  # per-row columns besides the layers (README, "Store format")
COLUMN_PREFIX = "@"  # a column's tensor in a shard is "@id", "@label"; no layer name starts so
# ASCII digits only ([0-9]): ``\d`` matches any Unicode digit, so a user's file named with
# Arabic-Indic or full-width digits would pass for hookscope's (and ``--overwrite`` delete it)
SHARD_NAME = re.compile(r"shard-(r[0-9]{4}-)?[0-9]{5}\.safetensors")
_CHUNK_SUM = re.compile(r"[0-9a-f]{16}")
RUN_ID = re.compile(r"[0-9a-f]{32}")
MAX_COUNT = 2**53  # every count and size of a manifest: exact in any JSON reader (RFC 7493)
# the largest manifest read: one 16-hex-digit checksum (19 bytes in JSON) per 4 MiB chunk lets
# 64 MiB describe ~14 TB of shards; a larger file is refused before any byte of it is read
MAX_MANIFEST_BYTES = 64 * 2**20
# rows a store may hold beyond one per byte of its shards: a zero-width layer's rows take no
# bytes, and a reader allocates per row (``store.ids``' row numbers: 8 bytes each), so rows are
# bounded by the files' sizes (checked against the disk when the store opens) plus this many
FREE_ROWS = 2**20
_FIX = ("the manifest is damaged or was not written by hookscope; restore it from a copy or "
        "extract the store again (overwrite=True / --overwrite)")


def corrupt(file: StorePath | str, field: str, problem: str) -> StoreCorruptError:
    """Return the error for a bad ``field`` of ``file`` (``problem`` says what is wrong)."""
    return StoreCorruptError(f"{file}: field {field} {problem}; {_FIX}.")


def _is_int(value: Any) -> bool:
    """True for a count or size: an int (JSON true/false are bool) in ``0..MAX_COUNT``."""
    return type(value) is int and 0 <= value <= MAX_COUNT


def _want(file: StorePath, data: dict[str, Any], field: str, check: Callable[[Any], bool],
          what: str, prefix: str = "") -> Any:
    """Return ``data[field]`` once ``check`` holds for it (``prefix`` places it, for the error)."""
    if field not in data:
        raise corrupt(file, prefix + field, "is missing")
    if not check(data[field]):
        raise corrupt(file, prefix + field, f"must be {what}, not {data[field]!r:.80}")
    return data[field]


def _pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value) \
        and 0 <= value[0] < value[1]


def check_manifest(data: Any, file: StorePath) -> None:
    """Check a parsed manifest against the schema of its version (1 or 2: ``DIGESTS``; README,
    "Store format").

    Raises:
        StoreCorruptError: naming ``file`` and the first field that is missing or wrong.
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StoreCorruptError(f"{file} is not a hookscope store manifest (no \"format\": "
                                f"\"{FORMAT}\").")
    if type(data.get("version")) is not int or data["version"] not in DIGESTS:
        raise StoreCorruptError(f"{file} has store format version {data.get('version')!r}; this "
                                f"hookscope reads versions {', '.join(map(str, DIGESTS))}. Upgrade "
                                f"hookscope.")
    for field in ("model", "extract"):
        _want(file, data, field, lambda v: isinstance(v, dict), "an object")
    _check_model(file, data["model"])
    _want(file, data, "complete", lambda v: isinstance(v, bool), "true or false")
    if "run" in data:  # stores written before the run id was recorded have none
        _want(file, data, "run", lambda v: isinstance(v, str) and RUN_ID.fullmatch(v) is not None,
              "32 hex digits")
    _want(file, data, "world_size", lambda v: _is_int(v) and v >= 1,
          f"a positive integer up to {MAX_COUNT}")
    chunk = _want(file, data, "chunk_bytes", lambda v: _is_int(v) and v > 0 and v % 8 == 0,
                  f"a positive multiple of 8 up to {MAX_COUNT}")
    layers = _want(file, data, "layers", lambda v: isinstance(v, dict), "an object")
    _check_layers(file, layers)
    _check_extract(file, data["extract"], layers)
    if "rank" in data:  # a part manifest of a torchrun run
        _want(file, data, "rank", lambda v: _is_int(v) and v < data["world_size"],
              f"this process's rank, below world_size {data['world_size']}")
    if "standard_names" in data:  # {standard name: layer}; stores before it have none
        _want(file, data, "standard_names", lambda v: isinstance(v, dict) and all(
            isinstance(k, str) and (n in layers or not layers) for k, n in v.items()),
              "an object {standard name: one of the layers}")
    if "columns" in data:  # stores written before row identity was recorded have none
        _check_columns(file, _want(file, data, "columns", lambda v: isinstance(v, dict),
                                   "an object"))
    shards = _want(file, data, "shards", lambda v: isinstance(v, list), "a list")
    rows = _want(file, data, "rows", _is_int, f"a row count (0..{MAX_COUNT})")
    stop, batch, names = 0, None, set()
    for k, entry in enumerate(shards):
        stop, batch = _check_shard(file, k, entry, stop, batch, chunk, data["version"])
        if entry["file"] in names:
            raise corrupt(file, f"shards[{k}].file", f"repeats {entry['file']!r}")
        names.add(entry["file"])
    if rows != stop:
        raise corrupt(file, "rows", f"is {rows} but the shards hold {stop} rows")
    nbytes = sum(entry["bytes"] for entry in shards)
    if rows > nbytes + FREE_ROWS:
        raise corrupt(file, "rows", f"is {rows}, but the shards' {nbytes} bytes hold at most "
                                    f"{nbytes + FREE_ROWS} rows (one per byte, and {FREE_ROWS} "
                                    f"rows of zero-width layers)")
    _check_batches(file, data, shards)


def _check_model(file: StorePath, model: dict[str, Any]) -> None:
    """``model``: ``spec`` (the CLI's MODEL argument, null from Python), ``class``."""
    for key in sorted(model.keys() - {"spec", "class"})[:1]:
        raise corrupt(file, f"model[{key!r}]", "is not a field hookscope writes (spec, class)")
    _want(file, model, "spec", lambda v: v is None or _is_text(v), "null or a model spec",
          "model.")
    _want(file, model, "class", _is_text, "the model's class name", "model.")


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _MAX_TEXT


_MAX_TEXT = 4096  # longest spec, class, layer address or reduction name a manifest may give
# manifest ``extract`` field -> (its check, what it must be); a field an older store did not
# record is absent
_EXTRACT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "layers": (lambda v: isinstance(v, list) and bool(v) and all(_is_text(n) for n in v)
               and len(set(v)) == len(v), "a list of distinct layer addresses"),
    "reduce": (lambda v: v is None or _is_text(v), "null or a reduction's name"),
    "batches": (lambda v: v is None or _is_int(v), f"null or a batch count (0..{MAX_COUNT})"),
    "dtype": (lambda v: v is None or (isinstance(v, str) and v in DTYPES),
              f"null or one of {sorted(DTYPES)}"),
    "batch_size": (lambda v: v is None or (_is_int(v) and v > 0),
                   f"null or a positive batch size (1..{MAX_COUNT})"),
}


def _check_extract(file: StorePath, extract: dict[str, Any], layers: dict[str, Any]) -> None:
    """``extract``: the arguments a resume repeats, each of its type and range; its ``layers``
    are the manifest's (once the first batch described them)."""
    for key in sorted(extract.keys() - _EXTRACT.keys())[:1]:
        raise corrupt(file, f"extract[{key!r}]", f"is not a field hookscope writes "
                                                 f"({', '.join(_EXTRACT)})")
    for key in extract.keys() & _EXTRACT.keys():
        check, what = _EXTRACT[key]
        _want(file, extract, key, check, what, "extract.")
    if layers and "layers" in extract and set(extract["layers"]) != set(layers):
        raise corrupt(file, "extract.layers", f"is {extract['layers']!r:.200}, but the store's "
                                              f"layers are {sorted(layers)!r:.200}")


def _check_batches(file: StorePath, data: dict[str, Any], shards: list[dict[str, Any]]) -> None:
    """The shards' batch ranges against ``extract``: they follow each other (``_check_shard``)
    from batch 0 (a torchrun part: from its first), end by ``extract.batches`` and reach it once
    the store is complete. With an ``id`` column (the DataLoader's batch sampler gave each
    batch's data-set indices, and extraction checked one row per index) each shard holds
    ``batch_size`` rows per batch, but the data's last batch may be short; without one a
    ``collate_fn`` may make any number of rows of a batch."""
    total = data["extract"].get("batches")
    size = data["extract"].get("batch_size") if "id" in data.get("columns", {}) else None
    part = "rank" in data
    if shards and not part and shards[0]["batches"][0] != 0:
        raise corrupt(file, "shards[0].batches", f"starts at batch {shards[0]['batches'][0]}, "
                                                 f"not 0")
    end = shards[-1]["batches"][1] if shards else 0
    if total is not None and (end > total or (data["complete"] and not part and end != total)):
        raise corrupt(file, "extract.batches", f"is {total}, but the shards hold batches 0 to "
                                               f"{end}")
    for k, entry in enumerate(shards if size is not None else ()):
        (first, last), (start, stop) = entry["batches"], entry["rows"]
        short = last == total if total is not None else k == len(shards) - 1  # the data's last
        low = (last - first - 1) * size + 1 if short else (last - first) * size
        if not low <= stop - start <= (last - first) * size:
            raise corrupt(file, f"shards[{k}].rows", f"holds {stop - start} rows, but batches "
                                                     f"{first}..{last - 1} of extract.batch_size "
                                                     f"{size} rows give "
                                                     f"{low}" + (f" to {(last - first) * size}"
                                                                 if short else ""))


def _check_layers(file: StorePath, layers: dict[str, Any], what: str = "layers") -> None:
    for name, spec in layers.items():
        field = f"{what}[{name!r}]"
        if not name or name.endswith(":offsets") or name.startswith(COLUMN_PREFIX) or \
                not isinstance(spec, dict):
            raise corrupt(file, field, "must be a layer path with {shape, dtype, ragged}")
        shape = _want(file, spec, "shape", lambda v: isinstance(v, list), "a list", f"{field}.")
        ragged = bool(shape) and shape[0] is None
        sizes = shape[ragged:]
        if not all(_is_int(n) for n in sizes) or math.prod(n for n in sizes if n) > MAX_COUNT:
            raise corrupt(file, f"{field}.shape", f"must hold sizes (null first when ragged) of "
                                                  f"at most {MAX_COUNT} elements, not "
                                                  f"{shape!r:.80}")
        _want(file, spec, "dtype", lambda v: isinstance(v, str) and v in DTYPES,
              f"one of {sorted(DTYPES)}", f"{field}.")
        _want(file, spec, "ragged", lambda v, r=ragged: v is r,  # type: ignore[misc]
              f"{str(ragged).lower()} for this shape", f"{field}.")


def _check_columns(file: StorePath, columns: dict[str, Any]) -> None:
    """``columns``: ``id``/``label``/``token`` specs as layers have them; a ragged ``id`` or
    ``label`` holds UTF-8 text, ``token`` the int64 token ids of each row's real tokens."""
    for name in columns:
        if name not in COLUMNS:
            raise corrupt(file, f"columns[{name!r}]", f"is not a column hookscope writes "
                                                      f"({', '.join(COLUMNS)})")
    _check_layers(file, columns, "columns")
    for name, spec in columns.items():
        if name == "token" and (len(spec["shape"]) != 1 or spec["dtype"] != "int64"):
            raise corrupt(file, "columns['token']", "holds token ids: shape [null] (per real "
                                                    "token) or [seq] (packed windows), dtype "
                                                    "int64")
        if name != "token" and spec["ragged"] and (spec["shape"] != [None] or
                                                   spec["dtype"] != "uint8"):
            raise corrupt(file, f"columns[{name!r}]", "is ragged, so it must be text: shape "
                                                      "[null], dtype uint8")


def tensor_specs(manifest: dict[str, Any]) -> dict[str, Any]:
    """Every tensor a shard holds besides offsets, by its name in the shard: the layers, then
    the columns (``@id``, ``@label``)."""
    return {**manifest["layers"],
            **{COLUMN_PREFIX + k: v for k, v in manifest.get("columns", {}).items()}}


def _check_shard(file: StorePath, k: int, entry: Any, start: int, batch: int | None,
                 chunk: int, version: int) -> tuple[int, int]:
    """Check ``shards[k]`` of a store of ``version``; return the row and batch where the next
    shard must start."""
    digest = DIGESTS[version]
    field = f"shards[{k}]"
    if not isinstance(entry, dict):
        raise corrupt(file, field, "must be an object")

    def want(name: str, check: Callable[[Any], bool], what: str) -> Any:
        return _want(file, entry, name, check, what, prefix=f"{field}.")

    fields = {"file", "rows", "batches", "bytes", digest.name, "chunk_sum"}
    for key in sorted(entry.keys() - fields)[:1]:  # another version's digest, say
        raise corrupt(file, f"{field}[{key!r}]", f"is not a field of a version-{version} shard "
                                                 f"({', '.join(sorted(fields))})")

    check_file_name(want("file", lambda v: isinstance(v, str), "a file name"), file, field)
    rows = want("rows", _pair, f"[start, stop) with start < stop <= {MAX_COUNT}")
    if rows[0] != start:
        raise corrupt(file, f"{field}.rows", f"starts at {rows[0]}, but the shard before it ends "
                                             f"at row {start}")
    batches = want("batches", _pair, f"[start, stop) with start < stop <= {MAX_COUNT}")
    if batch is not None and batches[0] != batch:
        raise corrupt(file, f"{field}.batches", f"starts at {batches[0]}, but the shard before "
                                                f"it ends at batch {batch}")
    size = want("bytes", lambda v: _is_int(v) and v > 8, f"a file size in bytes (9..{MAX_COUNT})")
    want(digest.name, lambda v: isinstance(v, str) and re.fullmatch(f"[0-9a-f]{{{digest.hex}}}", v)
         is not None, f"{digest.hex} hex digits")
    sums = want("chunk_sum", lambda v: isinstance(v, list) and all(
        isinstance(s, str) and _CHUNK_SUM.fullmatch(s) for s in v), "a list of 16-hex-digit sums")
    if len(sums) != math.ceil(size / chunk):
        raise corrupt(file, f"{field}.chunk_sum", f"has {len(sums)} sums, but {size} bytes in "
                                                  f"chunks of {chunk} make {math.ceil(size / chunk)}")
    return rows[1], batches[1]


def check_file_name(name: str, file: StorePath, field: str) -> None:
    """Raise unless ``name`` is a shard file name as hookscope writes them
    (``shard-NNNNN.safetensors``, ``shard-rNNNN-NNNNN.safetensors``): no folder, ``..``, absolute
    path, dot file, nor a user's file that happens to sit in the folder."""
    if not SHARD_NAME.fullmatch(name):
        raise corrupt(file, f"{field}.file", f"must be a plain file name inside the store folder, "
                                             f"a shard's (shard-NNNNN.safetensors), not {name!r:.80}")


def parse_json(data: bytes) -> Any:
    """``json.loads`` whose every failure is ``ValueError``: JSON nested deeper than Python's
    recursion limit raises ``RecursionError`` from the standard parser, and an object that
    repeats a key (which ``json.loads`` would silently take the last of, so two tensors could
    claim one name) is refused."""
    try:
        return json.loads(data, object_pairs_hook=_unique)
    except RecursionError as err:
        raise ValueError("JSON nested too deeply to be a hookscope file") from err


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"key {key!r:.80} appears twice in one object")
        found[key] = value
    return found


def check_metadata(metadata: Any, run: str | None, name: str) -> None:
    """Check a shard's safetensors ``__metadata__``: hookscope's format and the manifest's run
    id ``run``, which is what ties the shard to its store (``hookscope.store.folder`` deletes
    by it). A store written before run ids (``run`` None) has shards without it: not checked.

    Raises:
        StoreCorruptError: the metadata is missing, or names another format or run.
    """
    if run is None:
        return
    if not isinstance(metadata, dict):
        raise corrupt(name, "header.__metadata__", f"is missing; a shard of run {run} carries "
                                                   f"{{format, version, run}}")
    for key, want in (("format", FORMAT), ("run", run)):
        if metadata.get(key) != want:
            raise corrupt(name, f"header.__metadata__.{key}",
                          f"is {metadata.get(key)!r:.80}, the manifest's is {want!r}: the shard "
                          f"belongs to another store")


def inside(folder: StorePath, name: str, file: StorePath, field: str) -> StorePath:
    """Return ``folder / name`` after checking that it does not resolve outside ``folder``
    (a symbolic link to elsewhere is refused before anything opens it; an object store has
    no links)."""
    path = folder / name
    if isinstance(path, RemotePath) or isinstance(folder, RemotePath):
        return path
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        raise corrupt(file, field, f"{name!r} is a link that leads outside the store folder "
                                    f"{folder}; hookscope reads only the store's own files")
    return path


def check_header(header: Any, *, layers: dict[str, Any], rows: int, size: int, data_start: int,
                 name: str) -> None:
    """Check one shard's safetensors header against the manifest's layers and the shard's rows.

    Args:
        header: the parsed header (``__metadata__`` removed).
        layers: the manifest's ``layers``; rows: rows the manifest gives the shard;
        size: the shard's byte size; data_start: where its tensor data begins; name: its file.

    Raises:
        StoreCorruptError: a tensor is missing, extra, or has another dtype, shape or byte range.
    """
    expected: dict[str, tuple[str, int, list[int] | None]] = {}
    for path, spec in layers.items():
        st_name, itemsize = DTYPES[spec["dtype"]]
        shape = spec["shape"]
        expected[path] = (st_name, itemsize, None if shape[:1] == [None] else [rows, *shape])
        if shape[:1] == [None]:
            expected[f"{path}:offsets"] = ("I64", 8, [rows + 1])
    if not isinstance(header, dict) or set(header) != set(expected):
        found = sorted(header) if isinstance(header, dict) else header
        raise corrupt(name, "header", f"holds tensors {found!r:.200}, the manifest's layers need "
                                      f"{sorted(expected)}")
    spans = []
    for key, (st_name, itemsize, shape) in expected.items():
        entry = header[key]
        if not isinstance(entry, dict) or entry.get("dtype") != st_name:
            raise corrupt(name, f"header[{key!r}].dtype", f"must be {st_name} as the manifest says")
        found_shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(found_shape, list) and all(_is_int(n) for n in found_shape)):
            raise corrupt(name, f"header[{key!r}].shape", "must be a list of sizes")
        if shape is None:  # ragged: (tokens, *shape[1:])
            shape = [found_shape[0] if found_shape else -1, *layers[key]["shape"][1:]]
        if found_shape != shape:
            raise corrupt(name, f"header[{key!r}].shape", f"is {found_shape}, the manifest "
                                                          f"gives {shape}")
        nbytes = math.prod(shape) * itemsize
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and offsets[1] - offsets[0] == nbytes):
            raise corrupt(name, f"header[{key!r}].data_offsets", f"must span the {nbytes} bytes "
                                                                 f"of {shape}")
        spans.append((offsets[0], offsets[1], key))
    _check_spans(spans, size - data_start, name)


def _check_spans(spans: list[tuple[int, int, str]], data_bytes: int, name: str) -> None:
    """Raise unless the byte ranges ``(begin, end, tensor)``, sorted as safetensors sorts them,
    tile ``[0, data_bytes)``: each starts where the one before ends (no overlap, no gap)."""
    at, before = 0, "the data area"
    for begin, end, key in sorted(spans):
        if begin != at:
            raise corrupt(name, f"header[{key!r}].data_offsets",
                          f"starts at byte {begin} of the data, but {before} ends at byte {at}: "
                          f"tensors must follow each other without overlap or gap (as "
                          f"safetensors requires)")
        at, before = end, f"tensor {key!r}"
    if at != data_bytes:
        raise corrupt(name, "header", f"describes {at} bytes of tensor data, the file holds "
                                      f"{data_bytes}")
