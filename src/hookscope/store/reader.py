"""Activation store: a folder of safetensors shards joined by a JSON manifest; its reader.

A store holds, per layer, one row per input: a fixed-shape tensor, or for a ragged layer (token
sequences of different lengths) the tokens of all rows stored flat with offsets, padding left
out. ``manifest.json`` lists the shards in row order with their row ranges, byte sizes, a digest
of the whole file (``xxh3_128``; ``sha256`` in a version-1 store: ``manifest.DIGESTS``) and a
checksum of every ``CHUNK_BYTES`` of file (``chunk_sum``); the README documents the format field
by field. Writing lives in ``hookscope.store.writer``; a shard file's reads and checks in
``hookscope.store.shards``; a layer's rows in ``hookscope.store.layers``.

Reading is memory-mapped and checked, so nothing reads damaged data silently: a shard whose size
differs from the manifest fails when the store is opened, and each chunk is compared with its
checksum the first time any byte of it is read (``StoreCorruptError`` names the shard);
``Store.verify()`` also checks every shard's digest.
"""

from __future__ import annotations

import bisect
import fnmatch
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hookscope.engine import brief, check_path, unresolved_standard
from hookscope.errors import StoreCorruptError, StoreError
from hookscope.store.fs import ChunkCache, StorePath, listdir, location
from hookscope.store.layers import LayerInfo, LayerView, StoreDataset, _dtype, dtype_name, row_shape
from hookscope.store.manifest import (
    COLUMN_PREFIX,
    FORMAT,
    MAX_MANIFEST_BYTES,
    check_manifest,
    inside,
    parse_json,
    read_regular,
    tensor_specs,
)
from hookscope.store.shards import _REDO, MANIFEST, ShardInfo, _Shard

if TYPE_CHECKING:
    from hookscope.store.tokens import TokenView

__all__ = ["FORMAT", "Store", "open_store", "read_manifest"]

REMOTE_CACHE_BYTES = 64 * 2**20  # chunks of a remote store's shards kept in memory, per store
Tensor = torch.Tensor


def read_manifest(path: StorePath) -> dict[str, Any]:
    """Parse a manifest and check it against the schema (``hookscope.store.manifest``).

    Raises:
        StoreCorruptError: the file cannot be read or parsed, is a link leading outside its
            folder, or breaks the schema (naming the file and the field).
    """
    inside(path.parent, path.name, path, "name")
    try:
        data = parse_json(read_regular(path, max_bytes=MAX_MANIFEST_BYTES))
    except (OSError, ValueError) as err:
        raise StoreCorruptError(f"cannot read {path}: {err}. The file is damaged; extract the "
                                f"store again (overwrite=True / --overwrite).") from err
    check_manifest(data, path)
    return data  # type: ignore[no-any-return]

def _column_text(name: str, info: LayerInfo) -> str:
    """``ids: text``, ``ids: data-set indices``, ``labels: int64``, ``labels: 3 float32``: a
    column as ``repr`` shows it."""
    if name == "token":
        return "tokens: token ids"
    kind = "text" if info.ragged else "data-set indices" if name == "id" else \
        dtype_name(info.dtype) if not info.shape else f"{row_shape(info)} {dtype_name(info.dtype)}"
    return f"{name}s: {kind}"


def _text(row: Tensor, column: str, i: int) -> str:
    """Row ``i`` of text column ``column`` (``id``, ``label``): its bytes decoded as strict UTF-8.

    Raises:
        StoreCorruptError: the bytes are not UTF-8 (hookscope writes them with ``str.encode``).
    """
    try:
        return bytes(row.numpy()).decode("utf-8")
    except UnicodeDecodeError as err:
        raise StoreCorruptError(f"column @{column}, row {i}: its bytes are not UTF-8 text "
                                f"({err.reason} at byte {err.start}); {_REDO}") from err

class Store:
    """A store opened for reading (``hookscope.open_store``); see ``LayerView`` for row access.

    Shards are memory-mapped on their first read and stay mapped until ``close()``: the pages
    read count in the process's RSS (clean file pages, which the kernel may drop under memory
    pressure), so reading a whole store grows RSS by the bytes touched. ``close()`` (or ``with
    hookscope.open_store(path) as store:``) unmaps them; reading a closed store is
    ``StoreError``. A ``DataLoader`` worker maps the shards it reads itself.

    Besides the layers, a store may hold per-row columns (``store.columns``): ``ids``, what each
    row was (a file path relative to the data folder, a data-set index) and ``labels`` (a folder
    label, the ``y`` of ``(x, y)`` batches). ``repr(store)`` describes it in a few lines.
    """

    def __init__(self, path: StorePath, manifest: dict[str, Any], verify_reads: bool):
        self.path, self.manifest = path, manifest
        self.complete: bool = bool(manifest["complete"])
        self.layers: dict[str, LayerInfo] = {
            name: LayerInfo(name, tuple(spec["shape"]), _dtype(spec["dtype"]))
            for name, spec in manifest["layers"].items()}
        # {standard name: layer} for layers extracted by a standard name ("resid_post.1")
        self.standard_names: dict[str, str] = dict(manifest.get("standard_names", {}))
        self.columns: dict[str, LayerInfo] = {
            name: LayerInfo(COLUMN_PREFIX + name, tuple(spec["shape"]), _dtype(spec["dtype"]))
            for name, spec in manifest.get("columns", {}).items()}
        self.shards = [ShardInfo.from_json(e, manifest["version"]) for e in manifest["shards"]]
        chunk = int(manifest["chunk_bytes"])
        self._cache = ChunkCache(REMOTE_CACHE_BYTES)  # used by remote shards only
        self._shards = [_Shard(path, info, chunk, verify_reads, tensor_specs(manifest),
                               manifest.get("run"), self._cache) for info in self.shards]
        self._starts = [s.rows[0] for s in self.shards]
        self._rows = self.shards[-1].rows[1] if self.shards else 0

    def close(self) -> None:
        """Unmap every shard, so the pages read leave the process's RSS (a store at a URL: drop
        its cached chunks); closing twice is fine. Afterwards, reading rows
        (``store[layer][i]``, ``store.tokens``, ``verify()``) raises ``StoreError``."""
        for shard in self._shards:
            shard.close()
        self._cache.clear()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, layer: str) -> LayerView:
        if not isinstance(layer, str):
            raise StoreError(f"a store's layer is named by a str; got {type(layer).__name__} "
                             f"{brief(layer)}: pass one of {list(self.layers)}")
        layer = self.standard_names.get(layer, layer)  # store["resid_post.1"]
        if layer not in self.layers:
            if self._shards:  # a layer cut from the manifest: the shard header still holds it
                self._shards[0].open()
            raise StoreError(f"store {self.path} has no layer {layer!r}; it has "
                             f"{list(self.layers)}.{unresolved_standard(layer, 'this store')}")
        return LayerView(self, self.layers[layer])

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    @property
    def paths(self) -> dict[str, str]:
        """``{name asked: layer}`` for every layer, in layer order: the standard name a layer
        was extracted by (``{"resid_post.1": "transformer.h.1"}``; the first when it had
        several), else the layer itself (a path, a glob's match; every layer of a store
        written before standard names were kept). ``store[name]`` reads by either."""
        asked: dict[str, str] = {}  # layer -> its first standard name
        for name, layer in self.standard_names.items():
            asked.setdefault(layer, name)
        return {asked.get(layer, layer): layer for layer in self.layers}

    def __repr__(self) -> str:
        """What ``hookscope show`` shows, in a few lines: path, rows, shards, bytes, complete
        or not, one line per layer (row shape, dtype), and the columns (no row is read)."""
        state = "complete" if self.complete else "INCOMPLETE (resume the extraction)"
        lines = [f"Store({str(self.path)!r}: {len(self)} rows in {len(self.shards)} shard"
                 f"{'s' if len(self.shards) != 1 else ''}, {self.nbytes} bytes, {state})"]
        named = {name: (f"{name} ({layer})" if name != layer else name)
                 for name, layer in self.paths.items()}  # the name asked, its path beside it
        width = max((len(text) for text in named.values()), default=0)
        shape = max((len(row_shape(info)) for info in self.layers.values()), default=0)
        lines += [f"  {named[name]:<{width}}  {row_shape(self.layers[layer]):<{shape}}  "
                  f"{dtype_name(self.layers[layer].dtype)}" for name, layer in self.paths.items()]
        lines.append("  " + "; ".join(_column_text(name, info)
                                      for name, info in self.columns.items())
                     if self.columns else "  ids: row numbers (no id column); no labels")
        return "\n".join(lines)

    @property
    def ids(self) -> Tensor | list[str]:
        """What each row was: a ``list[str]`` (file paths relative to the data folder, as
        ``--data FOLDER`` gives), an ``(rows,)`` int64 tensor of data-set indices (a Dataset,
        or a DataLoader over one), or, when the store has no id column (an iterable of
        batches), the row numbers ``0..rows-1``."""
        column = self._column("id")
        return torch.arange(len(self)) if column is None else column

    @property
    def labels(self) -> Tensor | list[str] | None:
        """Each row's label: a ``list[str]`` (the class folder of ``--data FOLDER``), a
        ``(rows, ...)`` tensor (the ``y`` of ``(x, y)`` batches, as the data gave it), or
        ``None`` when the data had none."""
        return self._column("label")

    @property
    def token_ids(self) -> list[Tensor] | None:
        """Each row's token ids, real tokens only (a ``(tokens_i,)`` int64 tensor per row,
        aligned with the rows of every ragged layer: token ``t`` of a row is the one whose id
        is ``token_ids[row][t]``), or ``None`` when the data gave no ``input_ids`` beside an
        ``attention_mask`` (or no layer was stored per token). The attention mask is these
        rows' lengths: padding is not stored."""
        info = self.columns.get("token")
        return None if info is None else LayerView(self, info)[:]  # type: ignore[return-value]

    def tokens(self, layer: str, *, exclude: Sequence[int] = ()) -> TokenView:
        """A flat ``(tokens, *shape)`` view over the rows of ragged ``layer`` (``TokenView``):
        padding is never stored, and tokens whose id is in ``exclude`` (e.g. BOS) are left
        out. ``.ids`` and ``.rows`` give each token's id and row; ``.stream(buffer_tokens=,
        seed=)`` a shuffled, resumable stream a ``DataLoader`` reads
        (``hookscope.store.tokens``).

        Raises:
            StoreError: no such layer, the layer is not ragged, or ``exclude`` without stored
                token ids.
        """
        from hookscope.store.tokens import TokenView  # the module builds on this one
        return TokenView(self, self[layer].info, exclude)

    def _column(self, name: str) -> Tensor | list[str] | None:
        info = self.columns.get(name)
        if info is None:
            return None
        rows = LayerView(self, info)[:]
        if info.ragged:  # text: UTF-8 bytes per row
            return [_text(row, name, i) for i, row in enumerate(rows)]
        return rows  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Total bytes of the shard files."""
        return sum(s.bytes for s in self.shards)

    def dataset(self, layer: str, *, ragged: bool = False) -> StoreDataset:
        """Return a ``torch.utils.data.Dataset`` whose item ``i`` is row ``i`` of ``layer``.

        A ragged layer's rows hold different numbers of tokens, which a ``DataLoader``'s
        default collate cannot stack: pass ``ragged=True`` and ``collate_fn=pad_rows``
        (``hookscope.store.pad_rows``: padded rows and their mask), or read tokens with
        ``store.tokens(layer)``.

        Raises:
            StoreError: no such layer, or ``layer`` is ragged and ``ragged`` is False.
        """
        view = self[layer]
        if view.info.ragged and not ragged:
            raise StoreError(
                f"layer {layer!r} is ragged: its rows hold different numbers of tokens, so a "
                f"DataLoader cannot stack them (torch: 'stack expects each tensor to be equal "
                f"size'). For tokens: store.tokens({layer!r}) (a flat (tokens, d) view; "
                f".stream() shuffles them); for whole rows: DataLoader(store.dataset({layer!r}, "
                f"ragged=True), collate_fn=hookscope.store.pad_rows)")
        return StoreDataset(view)

    def verify(self) -> None:
        """Check every shard as reading does (size, header against the manifest with byte
        ranges that follow each other without overlap or gap, every chunk sum, ragged offsets),
        its sha256 (reads every byte), and that safetensors' own parser accepts it; then that
        every row of a text column (``ids``, ``labels``) is UTF-8.

        Raises:
            StoreCorruptError: naming the first shard that is missing, truncated or damaged
                (or the column and row whose text is not UTF-8).
        """
        for shard in self._shards:
            shard.verify()
        for name, info in self.columns.items():
            if info.ragged:  # text: strict UTF-8, each row
                self._column(name)

    def _locate(self, start: int, stop: int) -> Iterator[tuple[_Shard, int, int]]:
        """Yield ``(shard, local start, local stop)`` covering global rows ``[start, stop)``."""
        k = bisect.bisect_right(self._starts, start) - 1
        while start < stop and k < len(self._shards):
            first, last = self.shards[k].rows
            if last > start:
                yield self._shards[k], start - first, min(stop, last) - first
                start = min(stop, last)
            k += 1


def open_store(path: str | os.PathLike[str], *, allow_incomplete: bool = False,
               verify_reads: bool = True, storage_options: dict[str, Any] | None = None) -> Store:
    """Open the store at ``path`` for reading; rows are memory-mapped (local) or read by byte
    ranges (a URL), not loaded.

    Args:
        path: the folder ``hookscope.extract`` wrote, or its URL (``s3://bucket/acts``,
            ``gs://...``, ``memory://...``, ``file://...``; any fsspec URL).
        allow_incomplete: read the rows of an interrupted single-process run written so far.
        verify_reads: check each chunk (``CHUNK_BYTES``) against its checksum the first time it
            is read. Off, a damaged shard is only found by ``verify()``.
        storage_options: for a URL, fsspec's options (credentials, ``client_kwargs``, ...);
            otherwise the environment's credentials apply. Never written anywhere.

    A store at a URL is read by chunks of ``CHUNK_BYTES`` (4 MiB): each read fetches the chunks
    it touches that are not cached, one ranged GET each, checks them, and keeps the last
    ``REMOTE_CACHE_BYTES`` (64 MiB) of them; ``verify()`` downloads each shard once.

    Returns:
        A ``Store``: ``store.layers`` (``{path: LayerInfo}``), ``len(store)`` rows,
        ``store[layer][i:j]`` tensors, ``store.dataset(layer)``, ``store.verify()``;
        ``store.close()`` (or a ``with`` block) unmaps the shards read.

    Raises:
        ArgumentTypeError: ``path`` is not a path (``None``, a number).
        StoreError: ``path`` is not a store, or its extraction did not finish, or is a URL
            whose file system is not installed (``s3fs`` for ``s3://``).
        StoreCorruptError: the manifest is damaged, or a shard is missing or has the wrong size.
    """
    check_path("path", path, "hookscope.open_store('acts/') (the folder extract wrote)")
    folder = location(path, StoreError, storage_options)
    if not folder.exists():
        raise StoreError(f"{folder} does not exist: give the folder that hookscope.extract / "
                         f"`hookscope extract --out` wrote")
    if not (folder / MANIFEST).is_file():
        names = listdir(folder) if folder.is_dir() else []
        parts = [n for n in names if fnmatch.fnmatchcase(n, "manifest-r*.json")]
        detail = (f"it holds the part manifests of an interrupted run over {len(parts)}+ "
                  f"processes; rerun the same torchrun command with --resume" if parts else
                  "it is empty: an extraction stopped before it began writing; run it again "
                  "(--resume starts afresh)" if folder.is_dir() and not names else
                  "point to the folder hookscope.extract / `hookscope extract --out` wrote")
        raise StoreError(f"{folder} is not a hookscope store (no {MANIFEST}): {detail}.")
    manifest = read_manifest(folder / MANIFEST)
    if not manifest["complete"] and not allow_incomplete:
        raise StoreError(f"{folder} is incomplete: its extraction stopped after "
                         f"{manifest['rows']} rows. Resume it (resume=True / --resume), or pass "
                         f"allow_incomplete=True to read the rows written so far.")
    store = Store(folder, manifest, verify_reads)
    for shard in store._shards:
        shard.check_size()
    return store
