"""Private: the replay bundle's file format, written atomically and read as hostile input.

A bundle is one safetensors file (no pickle: loading it runs no code). Its tensors are named
``t0, t1, ...``; its ``__metadata__`` holds:

- ``format``: ``"hookscope.replay"``, ``version``: ``"1"``;
- ``fields``: JSON text, the schema (every field checked, with its type, before use)::

      {"step": int >= 0, "rank": int >= 0, "autocast": null | [device, dtype name],
       "rng_cpu": tensor, "rng_cuda": null | [tensor, ...],
       "args": {"t": "tuple", "items": [value, ...]}, "kwargs": {"t": "dict", "items": [[name, value], ...]},
       "output_grads": [tensor | null, ...], "state": {state_dict key: tensor},
       "forward_finite": true | false}  (optional: bundles written before it lack it)

  where ``tensor`` is a tensor's name in the file and ``value`` is ``{"t": "tensor", "name": ...}``,
  ``{"t": "list" | "tuple", "items": [value, ...]}``, ``{"t": "dict", "items": [[str, value],
  ...]}`` or ``{"t": "value", "value": null | bool | int | float | str}``; every tensor of the
  file is named exactly once;
- ``sha256``: of the ``fields`` text and of each tensor's name, dtype, shape and bytes in name
  order: a flipped bit anywhere, in a tensor or in the fields, is found.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from hookscope.engine import check_path
from hookscope.errors import BundleError
from hookscope.util import read_regular, write_atomic, write_bytes

__all__ = ["SUFFIX", "decode", "read_bundle", "write_bundle"]

if TYPE_CHECKING:
    from hookscope.train.guard import ReplayBundle

Tensor = torch.Tensor
FORMAT, VERSION = "hookscope.replay", "1"
SUFFIX = ".safetensors"
_AUTOCAST_DTYPES = ("float16", "bfloat16", "float32", "float64")
_FIELDS = {"step", "rank", "autocast", "rng_cpu", "rng_cuda", "args", "kwargs", "output_grads",
           "state"}
_OPTIONAL = {"forward_finite"}
_MAX_DEPTH = 32  # nesting of the inputs' lists, tuples and dicts


def write_bundle(bundle: ReplayBundle, path: Path) -> Path:
    """Write ``bundle`` to ``path`` atomically (``util.files.write_atomic``); return ``path``.

    Raises:
        BundleError: an input is not a tensor, number, string, None, list, tuple or dict.
        OSError: the file cannot be written; no temporary file is left.
    """
    tensors: dict[str, Tensor] = {}

    def name(tensor: Tensor) -> str:
        key = f"t{len(tensors)}"
        tensors[key] = tensor.detach().cpu().contiguous().clone()
        return key

    i = bundle.inputs
    fields = {"step": bundle.step, "rank": bundle.rank,
              "autocast": list(i.autocast) if i.autocast else None,
              "rng_cpu": name(i.rng.cpu),
              "rng_cuda": [name(t) for t in i.rng.cuda] if i.rng.cuda is not None else None,
              "args": _encode(tuple(i.args), name, 0), "kwargs": _encode(dict(i.kwargs), name, 0),
              "output_grads": [None if g is None else name(g) for g in bundle.output_grads],
              "state": {key: name(t) for key, t in bundle.state.items()}}
    if bundle.forward_finite is not None:
        fields["forward_finite"] = bundle.forward_finite
    text = json.dumps(fields)
    data = safetensors.torch.save(tensors, metadata={"format": FORMAT, "version": VERSION,
                                                     "fields": text,
                                                     "sha256": _digest(text, tensors)})
    write_atomic(path, lambda tmp: write_bytes(tmp, data))
    return path


def _encode(value: Any, name: Any, depth: int) -> dict[str, Any]:
    if depth > _MAX_DEPTH:
        raise BundleError(f"the step's inputs are nested deeper than {_MAX_DEPTH}")
    if isinstance(value, Tensor):
        return {"t": "tensor", "name": name(value)}
    if isinstance(value, (list, tuple)):
        return {"t": type(value).__name__ if type(value) in (list, tuple) else "tuple",
                "items": [_encode(v, name, depth + 1) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"t": "dict", "items": [[k, _encode(v, name, depth + 1)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"t": "value", "value": value}
    raise BundleError(f"the step's inputs hold a {type(value).__name__}, which a replay bundle "
                      f"cannot hold (tensors, numbers, strings, None, lists, tuples, dicts)")


def _digest(text: str, tensors: dict[str, Tensor]) -> str:
    sha = hashlib.sha256(text.encode())
    for key in sorted(tensors):
        t = tensors[key]
        sha.update(f"\0{key}\0{t.dtype}\0{list(t.shape)}\0".encode())
        sha.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def read_bundle(path: Any) -> dict[str, Any]:
    """Read and check the bundle at ``path``: ``{"tensors": {name: tensor}, "fields": {...}}``.

    Raises:
        ArgumentTypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        BundleError: naming the file and what is wrong (see ``ReplayBundle.load``).
    """
    check_path("bundle", path, f"a ReplayBundle or 'runs/exp1/nonfinite-step-<N>{SUFFIX}' "
                               f"(written by hookscope.monitor)")
    path = Path(path)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(path.parent):
        raise BundleError(f"{path} is a link leading outside its folder; hookscope reads only a "
                          f"run folder's own files: pass the bundle file itself")
    try:
        header, size = _header(path)
        data = read_regular(path, size + 1, max_bytes=size)
        if len(data) != size:
            raise ValueError(f"{len(data)} bytes, its header declares {size}")
        metadata = header.get("__metadata__")
        tensors = safetensors.torch.load(data)
    except (OSError, ValueError, struct.error, RecursionError, safetensors.SafetensorError) as err:
        raise BundleError(f"{path} cannot be read as a replay bundle ({type(err).__name__}: "
                          f"{str(err)[:200]}): {_FIX}") from err
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise BundleError(f"{path} is not a hookscope replay bundle (no format {FORMAT!r}): {_FIX}")
    if metadata.get("version") != VERSION:
        raise BundleError(f"{path} has bundle version {metadata.get('version')!r:.20}; this "
                          f"hookscope reads version {VERSION}: replay it with the hookscope that "
                          f"wrote it")
    text = metadata.get("fields")
    if not isinstance(text, str) or metadata.get("sha256") != _digest(text, tensors):
        raise BundleError(f"{path} is damaged: its checksum does not match its contents (a "
                          f"changed byte, or a truncated or edited file): {_FIX}")
    try:
        fields = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise BundleError(f"{path}: field 'fields' is not JSON ({err}): {_FIX}") from err
    _check_fields(path, fields, tensors)
    return {"tensors": tensors, "fields": fields}


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``path`` and the file size it declares (8 + header + the end
    of its last tensor), read before any tensor byte: a truncated, padded or sparse file, or
    one declaring more bytes than this machine's memory, is refused before it is read whole.

    Raises:
        OSError, ValueError, struct.error: as ``read_bundle`` catches them.
    """
    (length,) = struct.unpack("<Q", read_regular(path, 8))
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"a header of {length} bytes (safetensors allows {_MAX_HEADER_BYTES})")
    header = json.loads(read_regular(path, 8 + length)[8:])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    ends = [entry.get("data_offsets", [0, 0])[1] if isinstance(entry, dict) else None
            for key, entry in header.items() if key != "__metadata__"]
    sizes = [end for end in ends if type(end) is int and end >= 0]
    if len(sizes) != len(ends):
        raise ValueError("a tensor's data_offsets are not whole numbers")
    size = 8 + length + max(sizes, default=0)
    memory = _memory_bytes()
    if memory is not None and size > memory:
        raise ValueError(f"it declares {size} bytes, more than this machine's {memory} bytes "
                         f"of memory")
    return header, size


def _memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit

_FIX = ("pass a nonfinite-step-<N>.safetensors file the monitor wrote, unchanged (a damaged "
        "bundle cannot be repaired; the run's next non-finite step writes a new one)")


def _check_fields(path: Path, fields: Any, tensors: dict[str, Tensor]) -> None:
    """Check every field's type, and that each tensor of the file is named exactly once."""
    def bad(field: str, what: str) -> BundleError:
        return BundleError(f"{path}: field {field} must be {what}: {_FIX}")

    if not isinstance(fields, dict) or not _FIELDS <= set(fields) <= _FIELDS | _OPTIONAL:
        raise bad("fields", f"an object with exactly {sorted(_FIELDS)} (and optionally "
                            f"{sorted(_OPTIONAL)})")
    if type(fields.get("forward_finite", False)) is not bool:
        raise bad("forward_finite", "true or false")
    for key in ("step", "rank"):
        if type(fields[key]) is not int or fields[key] < 0:
            raise bad(key, "a whole number >= 0")
    autocast = fields["autocast"]
    if autocast is not None and not (
            isinstance(autocast, list) and len(autocast) == 2 and autocast[0] in ("cpu", "cuda")
            and autocast[1] in _AUTOCAST_DTYPES):
        raise bad("autocast", f"null or [\"cpu\" | \"cuda\", one of {_AUTOCAST_DTYPES}]")
    used: list[str] = []

    def tensor(field: str, name: Any, dtype: torch.dtype | None = None) -> None:
        if not isinstance(name, str) or name not in tensors:
            raise bad(field, "the name of a tensor in the file")
        if dtype is not None and (tensors[name].dtype != dtype or tensors[name].dim() != 1):
            raise bad(field, f"a 1-D {dtype} tensor")
        used.append(name)

    tensor("rng_cpu", fields["rng_cpu"], torch.uint8)
    cuda = fields["rng_cuda"]
    if cuda is not None and not isinstance(cuda, list):
        raise bad("rng_cuda", "null or a list of tensor names")
    for k, name in enumerate(cuda or []):
        tensor(f"rng_cuda[{k}]", name, torch.uint8)
    if not isinstance(fields["output_grads"], list):
        raise bad("output_grads", "a list of tensor names or nulls")
    for k, name in enumerate(fields["output_grads"]):
        if name is not None:
            tensor(f"output_grads[{k}]", name)
    state = fields["state"]
    if not isinstance(state, dict):
        raise bad("state", "an object of state_dict keys and tensor names")
    for key, name in state.items():
        tensor(f"state[{key!r:.80}]", name)
    for field, kind in (("args", "tuple"), ("kwargs", "dict")):
        if not isinstance(fields[field], dict) or fields[field].get("t") != kind:
            raise bad(field, f"a {kind} value")
        _check_value(fields[field], field, tensor, bad, 0)
    if sorted(used) != sorted(tensors):
        raise bad("fields", "naming every tensor of the file exactly once")


def _check_value(value: Any, field: str, tensor: Any, bad: Any, depth: int) -> None:
    kinds = {"tensor": {"t", "name"}, "list": {"t", "items"}, "tuple": {"t", "items"},
             "dict": {"t", "items"}, "value": {"t", "value"}}
    if depth > _MAX_DEPTH or not isinstance(value, dict) or kinds.get(str(value.get("t"))) != set(value):
        raise bad(field, f"a value ({{\"t\": {' | '.join(kinds)}, ...}}) nested at most "
                         f"{_MAX_DEPTH} deep")
    kind = value["t"]
    if kind == "tensor":
        tensor(field, value["name"])
    elif kind == "value":
        if not (value["value"] is None or isinstance(value["value"], (bool, int, float, str))):
            raise bad(field, "null, a boolean, a number or a string")
    elif not isinstance(value["items"], list):
        raise bad(f"{field}.items", "a list")
    elif kind == "dict":
        for k, pair in enumerate(value["items"]):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise bad(f"{field}.items[{k}]", "a [name, value] pair")
            _check_value(pair[1], f"{field}[{pair[0]!r:.40}]", tensor, bad, depth + 1)
        if len({pair[0] for pair in value["items"]}) != len(value["items"]):
            raise bad(f"{field}.items", "pairs with distinct names")
    else:
        for k, item in enumerate(value["items"]):
            _check_value(item, f"{field}[{k}]", tensor, bad, depth + 1)


def decode(value: dict[str, Any], tensors: dict[str, Tensor]) -> Any:
    """The Python value of a checked ``value`` (see the module docstring)."""
    kind = value["t"]
    if kind == "tensor":
        return tensors[value["name"]]
    if kind == "value":
        return value["value"]
    if kind == "dict":
        return {k: decode(v, tensors) for k, v in value["items"]}
    items = [decode(v, tensors) for v in value["items"]]
    return tuple(items) if kind == "tuple" else items
