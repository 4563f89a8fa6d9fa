"""Save captured records to one safetensors file and load them back (no pickle).

Keys: ``path`` for a module that ran once, ``path:k`` for call ``k`` of a module that ran several
times; a tensor inside a structured output adds its position in brackets, as in patterns:
``lstm[1][0]``, ``bert[last_hidden_state]``, ``relu:2``. The file's metadata holds
``hookscope.calls``: a JSON object ``{path: number of calls}``, plus any caller-given strings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from hookscope._files import write_atomic
from hookscope._nested import iter_tensors_with_keys
from hookscope.errors import HookscopeError

if TYPE_CHECKING:
    from hookscope.capture import Capture

__all__ = ["save_records", "load", "record_items"]


def record_items(acts: Capture) -> Iterator[tuple[str, int, str, torch.Tensor]]:
    """Yield ``(path, call, file key, tensor)`` for every tensor of every recorded call."""
    for path, count in acts.counts.items():
        for call in range(count):
            stem = path if count == 1 else f"{path}:{call}"
            for keys, tensor in iter_tensors_with_keys(acts[path, call]):
                yield path, call, stem + "".join(f"[{k}]" for k in keys), tensor


def save_records(acts: Capture, file: str | os.PathLike[str], *, overwrite: bool = True,
                 metadata: Mapping[str, str] | None = None) -> None:
    """Write every recorded tensor of ``acts`` to the safetensors ``file``, atomically.

    Tensors are moved to CPU and made contiguous; tensors sharing memory are copied apart.

    Raises:
        HookscopeError: ``file`` exists and ``overwrite`` is False, or nothing was recorded.
    """
    file = os.fspath(file)
    if os.path.exists(file) and not overwrite:
        raise HookscopeError(f"{file} exists; pass overwrite=True (--overwrite) or pick another name")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for _, _, key, tensor in record_items(acts):
        t = tensor.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    if not tensors:
        raise HookscopeError("nothing to save: no selected module ran inside the capture block")
    meta = {"hookscope.calls": json.dumps({p: n for p, n in acts.counts.items() if n})}
    meta.update(metadata or {})
    write_atomic(file, lambda tmp: save_file(tensors, tmp, metadata=meta))


def load(file: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a file written by ``Capture.save``: ``{key: tensor}`` (CPU), keys as saved.

    Raises:
        HookscopeError: the file is missing or is not a safetensors file.
    """
    file = os.fspath(file)
    if not os.path.exists(file):
        raise HookscopeError(f"no such file: {file}")
    try:
        return load_file(file)
    except Exception as err:  # safetensors raises its own SafetensorError
        raise HookscopeError(f"{file} is not a readable safetensors file: {err}") from err
