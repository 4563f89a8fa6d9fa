"""The monitor under faults (issues 35 and 31): a full disk, a failing writer, a fault in its own
statistics or an optimizer it does not know never stop training nor change it; each is one
MonitorFaultWarning and one 'fault' event; the guard's finding is raised or recorded whatever
the disk does; the step is counted as the model saw it; GradScaler statistics are unscaled."""

from __future__ import annotations

import copy
import errno
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hookscope
from hookscope.cli.main import main
from hookscope.errors import MonitorFaultWarning, NonFiniteStepError, NonFiniteStepWarning
from hookscope.train import records_file
from hookscope.util import files
from tests.models import Temperature

STEPS = 5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Temperature(), nn.ReLU(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


class Disk:
    """Fault injection at hookscope's one door to the disk (``util.files.write_all``): while
    ``full``, each write puts half its bytes down, then fails with ENOSPC, as a full disk does."""

    def __init__(self) -> None:
        self.full = False
        self.refused = 0
        self._write_all = files.write_all

    def __call__(self, fd: int, data: bytes) -> None:
        if self.full:
            self.refused += 1
            os.write(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        self._write_all(fd, data)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    fake = Disk()
    monkeypatch.setattr(files, "write_all", fake)
    monkeypatch.setattr(records_file, "write_all", fake)  # its one name for the door
    yield fake


def _train(model: nn.Module, steps: int, *, mon_args: dict[str, Any] | None = None,
           full: set[int] = frozenset(), disk: Disk | None = None, nan_at: int | None = None,
           skip: set[int] = frozenset()) -> hookscope.Monitor | None:
    """SGD steps; a monitor when ``mon_args``; the disk full at steps ``full``; the temperature
    zero (inf, then NaN in the backward) at ``nan_at``; ``skip``: steps a plain loop leaves out
    (the reference of guard="skip")."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = hookscope.monitor(model, ["0", "3"], every=1, optimizer=optimizer,
                            **(mon_args or {})) if mon_args is not None else None
    if mon is not None:
        mon.open()
    try:
        for step in range(steps):
            if disk is not None:
                disk.full = step in full
            model[1].temperature = 0.0 if step == nan_at else 1.0
            x, y = _batch(step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step not in skip:
                optimizer.step()
    finally:
        if disk is not None:
            disk.full = False
        if mon is not None:
            mon.close()
    return mon


def _lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                 strict=True))


def test_full_disk_mid_run_neither_stops_nor_changes_training(
        tmp_path: Path, disk: Disk, capsys: pytest.CaptureFixture[str]) -> None:
    plain, watched = _model(), _model()
    _train(plain, STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = _train(watched, STEPS, mon_args={"run_dir": tmp_path}, full={1, 2}, disk=disk)
    assert mon is not None
    assert _same_weights(plain, watched)  # equal to 5 plain steps
    assert mon.step_index == STEPS
    faults = [w for w in caught if issubclass(w.category, MonitorFaultWarning)]
    assert len(faults) == 1 and "the disk is full" in str(faults[0].message)
    assert disk.refused == 4  # steps 1 and 2: two modules each
    lines = _lines(tmp_path / "records.jsonl")  # whole lines only: the torn halves were cut back
    events = [r for r in lines if r.get("event") == "fault"]
    assert [(e["step"], e["where"], e["lost"]) for e in events] == [(1, "records", 4)]
    assert "the disk is full" in events[0]["error"]
    assert sorted({r["step"] for r in lines if "module" in r}) == [0, 3, 4]
    assert [e["where"] for e in mon.events] == ["records"]
    assert main(["monitor-report", str(tmp_path)]) == 0
    assert "step 1: the monitor's records failed (" in capsys.readouterr().out


@pytest.mark.parametrize("guard", ["raise", "warn", "skip"])
def test_guard_fires_on_a_full_disk(tmp_path: Path, disk: Disk, guard: str) -> None:
    nan_at = 2
    watched = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if guard == "raise":
            with pytest.raises(NonFiniteStepError) as info:
                _train(watched, STEPS, mon_args={"run_dir": tmp_path, "guard": guard},
                       full=set(range(STEPS)), disk=disk, nan_at=nan_at)
            assert info.value.step == nan_at and info.value.bundle is None  # type: ignore[attr-defined]
            assert info.value.origin.path == "1"  # type: ignore[attr-defined]
            reference_steps, skip = nan_at, set()
        else:
            mon = _train(watched, STEPS, mon_args={"run_dir": tmp_path, "guard": guard},
                         full=set(range(STEPS)), disk=disk, nan_at=nan_at)
            assert mon is not None and mon.step_index == STEPS
            finding = [e for e in mon.events if e["event"] == "nonfinite"]
            # "warn" lets the NaN weights through: every later step fires too
            assert [(e["step"], e["module"], e["bundle"]) for e in finding][:1] == [(nan_at, "1", None)]
            assert len(finding) == (1 if guard == "skip" else STEPS - nan_at)
            reference_steps, skip = STEPS, {nan_at} if guard == "skip" else set()
    kinds = [w.category for w in caught if issubclass(w.category, (MonitorFaultWarning,
                                                                  NonFiniteStepWarning))]
    # the records (one episode: the disk stays full), then each bundle of a new finding: under
    # "warn" the NaN step (finite weights) and the next (the weight now holds the NaN) are two
    # findings, and the later steps repeat the second (events only, no bundle, no warning)
    assert kinds.count(MonitorFaultWarning) == 1 + {"raise": 1, "skip": 1, "warn": 2}[guard]
    assert kinds.count(NonFiniteStepWarning) == {"raise": 0, "skip": 1, "warn": 2}[guard]
    names = sorted(os.listdir(tmp_path))
    assert names == ["records.jsonl"]  # no bundle, no temporary file left
    if guard != "warn":  # "warn" lets the NaN step through: weights NaN as in plain training
        reference = _model()
        _train(reference, reference_steps, nan_at=None, skip=skip)
        assert _same_weights(reference, watched)


def test_bundle_written_once_the_disk_has_room(tmp_path: Path, disk: Disk) -> None:
    with pytest.warns(NonFiniteStepWarning):
        mon = _train(_model(), 3, mon_args={"run_dir": tmp_path, "guard": "skip"}, disk=disk,
                     nan_at=1)
    assert mon is not None
    bundle = tmp_path / "nonfinite-step-1.safetensors"
    assert [e.get("bundle") for e in mon.events] == [str(bundle)]
    model = _model()
    model[1].temperature = 0.0  # as in the step (an attribute, not in the state dict)
    before = copy.deepcopy(model.state_dict())
    assert hookscope.replay(bundle, copy.deepcopy(model)).path == "1"  # type: ignore[union-attr]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_writer_that_raises_is_one_warning_and_training_goes_on(tmp_path: Path) -> None:
    class Broken:
        calls = 0

        def add_scalar(self, *args: Any) -> None:
            Broken.calls += 1
            raise RuntimeError("tensorboard is gone")

    plain, watched = _model(), _model()
    _train(plain, STEPS)
    with pytest.warns(MonitorFaultWarning, match="writer failed .RuntimeError: tensorboard is gone"):
        mon = _train(watched, STEPS, mon_args={"run_dir": tmp_path, "writer": Broken()})
    assert mon is not None and mon.step_index == STEPS and Broken.calls == 1
    assert _same_weights(plain, watched)
    assert [(e["event"], e["where"], e["step"]) for e in mon.events] == [("fault", "writer", 0)]
    lines = _lines(tmp_path / "records.jsonl")
    assert sum(r.get("event") == "fault" for r in lines) == 1
    assert sum("module" in r for r in lines) == 2 * STEPS  # the records are all there
    assert len(watched[0]._forward_hooks) == 0  # nothing left on the model


def test_a_fault_in_its_own_statistics_is_one_warning(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from hookscope.diagnostics.statistics import RunningStats
    update = RunningStats.update
    calls = []

    def flaky(self: RunningStats, tensor: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 3:  # step 0's first gradient: a value it cannot summarise
            raise TypeError("cannot summarise this value")
        update(self, tensor)

    monkeypatch.setattr(RunningStats, "update", flaky)
    plain, watched = _model(), _model()
    _train(plain, STEPS)
    with pytest.warns(MonitorFaultWarning, match="statistics of '3' failed"):
        mon = _train(watched, STEPS, mon_args={"run_dir": tmp_path})
    assert mon is not None and mon.step_index == STEPS
    assert _same_weights(plain, watched)
    assert [(e["where"], e["step"]) for e in mon.events] == [("statistics of '3'", 0)]


def test_opacus_dp_optimizer_is_watched_through_its_optimizer(tmp_path: Path) -> None:
    opacus = pytest.importorskip("opacus")

    def run(watch: bool) -> tuple[nn.Module, hookscope.Monitor | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # opacus' own notes on secure RNG
            model, optimizer, data = opacus.PrivacyEngine().make_private(
                module=model, optimizer=optimizer, data_loader=data, noise_multiplier=1.0,
                max_grad_norm=1.0, poisson_sampling=False)
        mon = hookscope.monitor(model, every=1, optimizer=optimizer,
                                run_dir=tmp_path / "run") if watch else None
        if mon is not None:
            mon.open()
        for x, y in data:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if mon is not None:
            mon.close()
        model._close()  # opacus' own per-sample hooks
        return model, mon

    plain, _ = run(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MonitorFaultWarning)
        watched, mon = run(True)
    assert mon is not None and mon.step_index == 4 and mon.events == []
    assert _same_weights(plain, watched)
    assert {r["step"] for r in _lines(tmp_path / "run" / "records.jsonl") if "module" in r} == \
        {0, 1, 2, 3}


def test_an_optimizer_without_step_hooks_is_one_warning() -> None:
    class Wrapper(torch.optim.Optimizer):
        def __init__(self, inner: torch.optim.Optimizer) -> None:  # no Optimizer.__init__
            self.inner = inner

        def step(self, closure: Any = None) -> None:
            self.inner.step()

    model = _model()
    with pytest.warns(MonitorFaultWarning, match="optimizer failed .* call mon.step"):
        mon = hookscope.monitor(model, every=1, optimizer=Wrapper(torch.optim.SGD(
            model.parameters(), lr=0.1))).open()
    try:
        model(_batch(0)[0]).sum().backward()
        mon.step()
    finally:
        mon.close()
    assert mon.step_index == 1 and [e["where"] for e in mon.events] == ["optimizer"]


def test_gradscaler_statistics_are_of_the_true_gradient() -> None:
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(0)
    reference = copy.deepcopy(model)  # the hand computation, plain PyTorch
    hidden = reference[0](x)
    hidden.retain_grad()
    out = reference[3](reference[2](reference[1](hidden)))
    out.retain_grad()
    F.cross_entropy(out, y).backward()
    with hookscope.monitor(model, ["0", "3"], every=1, scaler=scaler) as mon:
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        mon.step()
    for key, tensor, module in (("0", hidden, reference[0]), ("3", out, reference[3])):
        record = mon.latest[key]
        assert record["loss_scale"] == 1024.0
        assert record["gradient"]["absmax"] == pytest.approx(float(tensor.grad.abs().max()),
                                                             rel=1e-6)
        assert record["gradient"]["mean"] == pytest.approx(float(tensor.grad.double().mean()),
                                                           rel=1e-5, abs=1e-9)
        norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])
        assert record["grad_norm"] == pytest.approx(float(norm), rel=1e-6)


def test_a_file_in_the_bundles_place_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "nonfinite-step-1.safetensors").write_bytes(b"the user's file")
    with pytest.warns(MonitorFaultWarning, match="bundle failed .FileExistsError: .* exists and "
                                                 "is not this run's"):
        with pytest.warns(NonFiniteStepWarning):
            mon = _train(_model(), 3, mon_args={"run_dir": tmp_path, "guard": "skip"}, nan_at=1)
    assert (tmp_path / "nonfinite-step-1.safetensors").read_bytes() == b"the user's file"
    assert mon is not None
    assert [(e["event"], e.get("where"), e.get("bundle")) for e in mon.events] == [
        ("fault", "bundle", None), ("nonfinite", None, None)]
