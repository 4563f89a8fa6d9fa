"""Replay bundles as hostile input (issue 35): a bundle is checksummed safetensors + JSON fields
(never unpickled), written atomically; ``replay`` checks the whole bundle and its fit to the
model before ``load_state_dict``, so a damaged bundle (truncated, bit flips, keys dropped or
retyped, a FIFO, a link out of the folder) is one ``BundleError`` and the model's state dict is
bitwise what it was; an undamaged one replays identically."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import ArgumentTypeError, BundleError, HookscopeError
from hookscope.train import bundle as fmt
from tests.test_monitor_faults import _model, _train


@pytest.fixture(scope="module")
def bundle_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    run = tmp_path_factory.mktemp("run")
    with pytest.warns(hookscope.NonFiniteStepWarning):
        _train(_model(), 3, mon_args={"run_dir": run, "guard": "skip"}, nan_at=1)
    assert sorted(os.listdir(run)) == ["nonfinite-step-1.safetensors", "records.jsonl"]
    return (run / "nonfinite-step-1.safetensors").read_bytes()


def _victim() -> nn.Module:
    model = _model()
    model[1].temperature = 0.0
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the user's weights: not the bundle's
    return model


def _outcome(path: Path) -> tuple[str, Any]:
    """``("ok", origin fields, state)`` or ``("error", type)``; asserts the model is untouched
    after any failure, and that no other exception than a HookscopeError escapes."""
    model = _victim()
    before = copy.deepcopy(model.state_dict())
    try:
        origin = hookscope.replay(path, model)
    except HookscopeError as err:
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return "error", type(err)
    fields = None if origin is None else (origin.path, origin.phase, origin.op, origin.call_index,
                                          origin.bad_label)
    return "ok", (fields, {k: v.clone() for k, v in model.state_dict().items()})


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    return a[0] == b[0] == "ok" and a[1][0] == b[1][0] and all(
        torch.equal(a[1][1][k], b[1][1][k]) for k in a[1][1])


def test_clean_bundle_replays_and_names_the_module(bundle_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    path.write_bytes(bundle_bytes)
    kind, (fields, state) = _outcome(path)
    assert kind == "ok" and fields[:3] == ("1", "forward", "div")
    header = json.loads(bundle_bytes[8:8 + int.from_bytes(bundle_bytes[:8], "little")])
    assert header["__metadata__"]["format"] == "hookscope.replay"
    assert header["__metadata__"]["version"] == "1"


def _rewrite(data: bytes, edit: Any) -> bytes:
    """The bundle with its fields (and tensors) edited and a valid checksum again: what only the
    schema can refuse."""
    tensors = safetensors.torch.load(data)
    n = int.from_bytes(data[:8], "little")
    fields = json.loads(json.loads(data[8:8 + n])["__metadata__"]["fields"])
    fields, tensors = edit(fields, tensors)
    text = json.dumps(fields)
    return safetensors.torch.save(tensors, metadata={"format": fmt.FORMAT, "version": fmt.VERSION,
                                                     "fields": text,
                                                     "sha256": fmt._digest(text, tensors)})


_ODD = [None, [], {}, "x", -1, 1.5, True, 2**70, {"t": "value", "value": []}]
_TOP = sorted(fmt._FIELDS)


def _drop(key: str) -> Any:
    return lambda f, t: ({k: v for k, v in f.items() if k != key}, t)


def _retype(key: str, value: Any) -> Any:
    return lambda f, t: ({**f, key: value}, t)


def _drop_tensor(k: int) -> Any:
    def edit(f: dict[str, Any], t: dict[str, torch.Tensor]) -> Any:
        name = sorted(t)[k % len(t)]
        return f, {n: v for n, v in t.items() if n != name}
    return edit


def _retype_tensor(k: int) -> Any:
    def edit(f: dict[str, Any], t: dict[str, torch.Tensor]) -> Any:
        name = sorted(t)[k % len(t)]
        return f, {**t, name: t[name].to(torch.float64 if t[name].dtype != torch.float64
                                         else torch.float32)}
    return edit


def _deep(path: list[Any], value: Any) -> Any:
    def edit(f: dict[str, Any], t: dict[str, torch.Tensor]) -> Any:
        f = copy.deepcopy(f)
        node = f
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value
        return f, t
    return edit


_EDITS = st.one_of(
    st.sampled_from(_TOP).map(_drop),
    st.tuples(st.sampled_from(_TOP), st.sampled_from(_ODD)).map(lambda a: _retype(*a)),
    st.integers(0, 40).map(_drop_tensor),
    st.integers(0, 40).map(_retype_tensor),
    st.tuples(st.sampled_from([["args", "t"], ["args", "items"], ["args", "items", 0],
                               ["args", "items", 0, "name"], ["args", "items", 0, "t"],
                               ["kwargs", "items"], ["output_grads", 0], ["state", "0.weight"],
                               ["autocast"], ["rng_cuda"], ["step"]]),
              st.sampled_from(_ODD + ["t0", "t1", {"t": "tensor", "name": "t2"}])).map(
        lambda a: _deep(*a)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.one_of(
    st.integers(0, 10**9).map(lambda n: ("truncate", n)),
    st.tuples(st.integers(0, 10**9), st.integers(1, 255)).map(lambda a: ("flip", a)),
    _EDITS.map(lambda e: ("edit", e))))
def test_damaged_bundle_is_a_clean_error_or_an_identical_replay(
        bundle_bytes: bytes, tmp_path: Path, damage: tuple[str, Any]) -> None:
    kind, arg = damage
    if kind == "truncate":
        data = bundle_bytes[:arg % len(bundle_bytes)]
    elif kind == "flip":
        at, mask = arg
        data = bytearray(bundle_bytes)
        data[at % len(data)] ^= mask
        data = bytes(data)
    else:
        data = _rewrite(bundle_bytes, arg)
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(data)
    clean = tmp_path / "clean.safetensors"
    clean.write_bytes(bundle_bytes)
    got = _outcome(path)
    assert got[0] == "error" and got[1] is BundleError or _same(got, _outcome(clean))


def _fifo(folder: Path) -> Path:
    path = folder / "fifo.safetensors"
    os.mkfifo(path)
    return path


def _outside_link(folder: Path, bundle: bytes) -> Path:
    (folder / "elsewhere").mkdir()
    (folder / "elsewhere" / "b.safetensors").write_bytes(bundle)
    (folder / "run").mkdir()
    (folder / "run" / "b.safetensors").symlink_to(folder / "elsewhere" / "b.safetensors")
    return folder / "run" / "b.safetensors"


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _pickle(folder: Path) -> Path:
    path = folder / "old.pt"
    torch.save({"output_grads": [], "step": 0}, path)  # the old format: a pickle
    return path


@pytest.mark.parametrize("make", [
    lambda f, b: _fifo(f), lambda f, b: _outside_link(f, b), lambda f, b: f / "missing.pt",
    lambda f, b: f, lambda f, b: _pickle(f),
    lambda f, b: _file(f / "empty", b""), lambda f, b: _file(f / "p", pickle.dumps(os.system)),
    lambda f, b: _file(f / "half", b[:len(b) // 2])],
    ids=["fifo", "link-out", "missing", "folder", "pickle", "empty", "hostile-pickle", "truncated"])
def test_hostile_files_are_refused_without_touching_the_model(
        bundle_bytes: bytes, tmp_path: Path, make: Any) -> None:
    path = make(tmp_path, bundle_bytes)
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(_outcome(path)), daemon=True)
    worker.start()
    worker.join(20)  # a FIFO opened for reading would block forever
    assert result == [("error", BundleError)]


def test_a_bundle_of_another_model_is_refused_before_loading(bundle_bytes: bytes,
                                                             tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    path.write_bytes(bundle_bytes)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5))
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(BundleError, match=r"'2.weight' is \(5, 8\)|does not fit"):
        hookscope.replay(path, other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_replay_of_none_names_the_fix() -> None:
    with pytest.raises(ArgumentTypeError, match="bundle must be a path, e.g. a ReplayBundle"):
        hookscope.replay(None, _model())  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="model"):
        hookscope.replay("x.safetensors", None)  # type: ignore[arg-type]


def test_replay_on_the_fixed_model_says_the_forward_is_finite_now(bundle_bytes: bytes,
                                                                   tmp_path: Path) -> None:
    # finding 08: replaying a bundle on the fixed model blamed '<loss>' (loss_fn), a module the
    # user never defined; the recorded outputs were non-finite, so only their recorded gradient is
    file = tmp_path / "nonfinite-step-1.safetensors"
    file.write_bytes(bundle_bytes)
    bundle = hookscope.ReplayBundle.load(file)
    assert bundle.forward_finite is False
    still_broken = _model()
    still_broken[1].temperature = 0.0
    origin = hookscope.replay(file, still_broken)
    assert origin is not None and (origin.path, origin.phase) == ("1", "forward")
    fixed = _model()  # temperature 1.0: the fix
    origin = hookscope.replay(file, fixed)
    assert origin is not None and (origin.path, origin.phase, origin.call_index) == (
        "<recorded gradient>", "backward", 1)
    assert str(origin).startswith("the forward is finite now")
    assert "only the gradient recorded in the bundle is non-finite" in str(origin)
    assert "check the backward on a fresh training step" in str(origin)
    older = tmp_path / "older.safetensors"  # a bundle written before forward_finite: as before
    dataclasses.replace(bundle, forward_finite=None).save(older)
    assert "forward_finite" not in json.loads(safetensors.safe_open(
        str(older), "pt").metadata()["fields"])
    origin = hookscope.replay(older, _model())
    assert origin is not None and origin.path == "<loss>"


def _sparse_tail(path: Path, data: bytes, extra_bytes: int) -> Path:
    path.write_bytes(data)
    with open(path, "r+b") as f:
        f.truncate(len(data) + extra_bytes)  # a hole: no disk used, read as zeros
    return path


def _declaring(path: Path, data: bytes, end: int) -> Path:
    """The bundle with its last tensor's end offset changed to ``end`` (header only)."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"][1] = end
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])
    return path


@pytest.mark.parametrize("make", [
    lambda p, b: _sparse_tail(p, b, 2**40),  # 1 TiB read as zeros, before: read whole
    lambda p, b: _sparse_tail(p, b, 1),
    lambda p, b: _declaring(p, b, 2**60),  # a header declaring an exabyte tensor
    lambda p, b: _declaring(p, b, -1),
    lambda p, b: _file(p, (2**62).to_bytes(8, "little") + b[8:])],  # a 4 EiB header
    ids=["sparse-1TiB-tail", "one-byte-tail", "exabyte-tensor", "negative-offset", "huge-header"])
def test_a_bundle_larger_than_it_declares_is_refused_before_it_is_read(
        bundle_bytes: bytes, tmp_path: Path, make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: the size a bundle's header declares is checked against the file's real size
    and this machine's memory before any tensor byte is read (a 1 TiB sparse file was read
    whole); nothing larger than the declared size is ever read."""
    path = make(tmp_path / "b.safetensors", bundle_bytes)
    reads: list[int] = []
    real = fmt.read_regular

    def counted(file: Path, limit: int = -1, **options: Any) -> bytes:
        data = real(file, limit, **options)
        reads.append(len(data))
        return data
    monkeypatch.setattr(fmt, "read_regular", counted)
    assert _outcome(path) == ("error", BundleError)
    assert max(reads) <= len(bundle_bytes)
