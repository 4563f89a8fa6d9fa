"""Layers of a store: what one row holds, read back by row index.

``LayerInfo`` is a layer's row as the manifest describes it (shape, dtype), ``LayerView`` reads
rows of one layer from the shards of a ``Store`` (``hookscope.store.reader``), copying only the
rows asked for, and ``StoreDataset`` hands them to a ``DataLoader``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hookscope.errors import StoreCorruptError

if TYPE_CHECKING:
    from hookscope.store.reader import Store

__all__ = ["LayerInfo", "LayerView", "StoreDataset", "dtype_name", "row_shape"]

Tensor = torch.Tensor

# torch dtype <-> safetensors dtype name (the manifest uses torch's name without "torch.")
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest name of ``dtype`` (``torch.float16`` -> ``"float16"``)."""
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in _ST_DTYPES:
        raise StoreCorruptError(f"unknown dtype {name!r} in the manifest; known: "
                                f"{sorted(dtype_name(d) for d in _ST_DTYPES)}")
    return dtype


@dataclass(frozen=True)
class LayerInfo:
    """What one row of a layer is: ``shape`` (``None`` first for ragged rows), ``dtype``."""

    path: str
    shape: tuple[int | None, ...]
    dtype: torch.dtype

    @property
    def ragged(self) -> bool:
        """True when rows have different lengths (first dimension ``None``): tokens, flat."""
        return bool(self.shape) and self.shape[0] is None

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype), "ragged": self.ragged}

def _as_tensor(data: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> Tensor:
    if data.size == 0:
        return torch.empty(*shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).reshape(*shape)


class LayerView:
    """Rows of one layer: ``view[i]``, ``view[i:j]`` (one tensor), ``view[[i, j, ...]]``.

    A fixed layer returns ``(rows, *shape)`` tensors; a ragged layer returns a ``(tokens, *rest)``
    tensor for one row and a list of them for several. Reads copy only the rows asked for.
    ``view[mask]`` with a bool list, array or tensor of one entry per row takes the rows where
    it is True, as torch does. Any other index (a float, a str, 2-dim indices) is an
    ``IndexError``, as is a row out of range.
    """

    def __init__(self, store: Store, info: LayerInfo):
        self.store, self.info = store, info
        self._row_shape = tuple(int(n or 0) for n in info.shape[info.ragged:])  # known dims

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int | slice | Sequence[int] | Tensor) -> Tensor | list[Tensor]:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return self[list(range(start, stop, step))]
            return self._rows(start, max(start, stop))
        if isinstance(index, (Sequence, Tensor, np.ndarray)) and not isinstance(index, str):
            if isinstance(index, Tensor) and index.layout != torch.strided:  # no numpy view
                raise IndexError(f"rows of layer {self.info.path!r} are indexed by a dense "
                                 f"tensor, not a {index.layout} one: pass index.to_dense()")
            found = np.asarray(index.cpu() if isinstance(index, Tensor) else index)
            if found.ndim == 1:
                rows = [self._one(i, n) for i in self._indices(found, n)]
                if self.info.ragged:
                    return [row for i in rows for row in self._ragged(i, i + 1)]
                return torch.cat([self._fixed(i, i + 1) for i in rows]) if rows else \
                    self._fixed(0, 0)
            if found.ndim != 0:
                raise IndexError(f"rows of layer {self.info.path!r} are indexed by an int, a "
                                 f"slice, or a 1-dim list of ints or bool mask, not "
                                 f"{found.ndim}-dim indices")
            index = found.item()
        i = self._one(_as_int(index, self.info.path), n)
        return self._ragged(i, i + 1)[0] if self.info.ragged else self._fixed(i, i + 1)[0]

    def _indices(self, found: np.ndarray, n: int) -> list[int]:
        """Row numbers of a 1-dim index: ints as given, a bool mask (length ``n``) as the rows
        where it is True (as torch and numpy read a mask)."""
        if found.dtype == np.bool_:
            if len(found) != n:
                raise IndexError(f"a bool mask over layer {self.info.path!r} needs {n} entries "
                                 f"(one per row), not {len(found)}")
            return np.flatnonzero(found).tolist()
        if found.size and not np.issubdtype(found.dtype, np.integer):
            raise IndexError(f"row indices of layer {self.info.path!r} must be integers or a "
                             f"bool mask, not {found.dtype}")
        return [int(i) for i in found]

    def _one(self, i: int, n: int) -> int:
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for layer {self.info.path!r} of {n} rows")
        return i % n

    def _rows(self, start: int, stop: int) -> Tensor | list[Tensor]:
        return self._ragged(start, stop) if self.info.ragged else self._fixed(start, stop)

    def _fixed(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` as one ``(rows, *shape)`` tensor."""
        info = self.info
        pieces = [_as_tensor(shard.array(info.path, a, b), info.dtype, (b - a, *self._row_shape))
                  for shard, a, b in self.store._locate(start, stop)]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(0, *self._row_shape, dtype=info.dtype)

    def _ragged(self, start: int, stop: int) -> list[Tensor]:
        """Rows ``start:stop`` as a list of ``(tokens, *shape[1:])`` tensors."""
        rows: list[Tensor] = []
        for shard, a, b in self.store._locate(start, stop):
            offsets = shard.offsets(self.info.path)
            first, last = int(offsets[a]), int(offsets[b])
            flat = _as_tensor(shard.array(self.info.path, first, last), self.info.dtype,
                              (last - first, *self._row_shape))
            rows += torch.split(flat, np.diff(offsets[a:b + 1]).tolist())
        return rows

def row_shape(info: LayerInfo) -> str:
    """``"tokensx8"``, ``"3x4"``, ``"scalar"``: a row's shape as ``show`` prints it."""
    return "x".join("tokens" if n is None else str(n) for n in info.shape) or "scalar"


def _as_int(index: object, layer: str) -> int:
    """``index`` as a row number; a float, str or other non-integer is an IndexError."""
    try:
        if isinstance(index, (bool, np.bool_)):
            raise TypeError
        return operator.index(index)  # type: ignore[arg-type]
    except TypeError:
        raise IndexError(f"a row of layer {layer!r} is indexed by an int, a slice, or a list of "
                         f"ints or a bool mask, not {type(index).__name__} {index!r:.40}") from None


class StoreDataset(torch.utils.data.Dataset[Tensor]):
    """``store.dataset(layer)``: item ``i`` is row ``i`` of the layer; safe in DataLoader workers."""

    def __init__(self, view: LayerView):
        self.view = view

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, i: int) -> Tensor:
        return self.view[i]  # type: ignore[return-value]
