"""Models placed by accelerate: parameters on ``meta`` between calls, loaded by accelerate's own
``AlignDevicesHook`` on an execution device (``cpu_offload``, ``disk_offload``, ``dispatch_model``
with a ``device_map`` that offloads some blocks).

Every verb puts the batch where the first computation runs (``engine.run.input_device``), gives
the values of the un-offloaded model, and leaves accelerate's hooks in place and working.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import hookscope
from hookscope.engine.run import input_device
from tests.reference import plain_capture

accelerate = pytest.importorskip("accelerate")

LAYER = "2.0"  # a Linear inside a nested block


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.GELU()),
                         nn.Linear(16, 3)).eval()


def _cpu_offload(model: nn.Module, folder: Path) -> nn.Module:
    return accelerate.cpu_offload(model, execution_device=torch.device("cpu"))


def _disk_offload(model: nn.Module, folder: Path) -> nn.Module:
    return accelerate.disk_offload(model, str(folder), execution_device=torch.device("cpu"))


def _dispatch(model: nn.Module, folder: Path) -> nn.Module:
    device_map = {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk"}
    return accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(folder))


PLACEMENTS: dict[str, Callable[[nn.Module, Path], nn.Module]] = {
    "cpu_offload": _cpu_offload, "disk_offload": _disk_offload, "dispatch_model": _dispatch}


def _placed(kind: str, tmp_path: Path) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    base = _net()
    placed = PLACEMENTS[kind](copy.deepcopy(base), tmp_path / "offload")
    assert any(p.is_meta for p in placed.parameters())  # the case: parameters are not there
    return base, placed, torch.randn(4, 8)


def _accelerate_hooks(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if hasattr(m, "_hf_hook")]


def _capture(base: nn.Module, placed: nn.Module, x: torch.Tensor, tmp_path: Path) -> None:
    with torch.no_grad(), hookscope.capture(placed, LAYER, "3") as acts:
        placed(x)
    plain = plain_capture(base, [LAYER, "3"], x, grad_enabled=False)
    assert torch.equal(acts[LAYER], plain[LAYER][0]) and torch.equal(acts["3"], plain["3"][0])


def _edit(base: nn.Module, placed: nn.Module, x: torch.Tensor, tmp_path: Path) -> None:
    with torch.no_grad():
        handle = base[2][0].register_forward_hook(lambda m, i, o: o * 3)
        expected = base(x)
        handle.remove()
        with hookscope.edit(placed, {LAYER: lambda o: o * 3}):
            edited = placed(x)
    assert torch.equal(edited, expected)


def _stats(base: nn.Module, placed: nn.Module, x: torch.Tensor, tmp_path: Path) -> None:
    running = hookscope.stats(placed, [x, x[:2]], LAYER)[LAYER]
    plain = plain_capture(base, [LAYER], torch.cat([x, x[:2]]), grad_enabled=False)[LAYER][0]
    assert int(running.count) == plain.numel()
    assert float(running.mean) == pytest.approx(float(plain.double().mean()), abs=1e-6)


def _extract(base: nn.Module, placed: nn.Module, x: torch.Tensor, tmp_path: Path) -> None:
    store = hookscope.extract(placed, TensorDataset(x), [LAYER], tmp_path / "store",
                              batch_size=4, progress=False)
    plain = plain_capture(base, [LAYER], x, grad_enabled=False)[LAYER][0]
    assert len(store) == 4 and torch.equal(store[LAYER][:4], plain)


def _compare(base: nn.Module, placed: nn.Module, x: torch.Tensor, tmp_path: Path) -> None:
    result = hookscope.compare(base, placed, x)
    assert {d.path for d in result.diffs} == {"", "0", "1", "2", "2.0", "2.1", "3"}
    assert result.first_divergent is None and result[""].max_abs == 0.0


def _tree(base: nn.Module, placed: nn.Module, x: torch.Tensor, tmp_path: Path) -> None:
    rows = {r.path: (r.calls, r.outputs) for r in hookscope.tree(placed, x)}
    assert rows == {r.path: (r.calls, r.outputs) for r in hookscope.tree(base, x)}
    assert rows[LAYER] == (1, ("4x16 float32",))


VERBS = {"capture": _capture, "edit": _edit, "stats": _stats, "extract": _extract,
         "compare": _compare, "tree": _tree}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("kind", list(PLACEMENTS))
def test_verbs_on_a_placed_model_give_the_plain_values_and_keep_accelerate(
        kind: str, verb: str, tmp_path: Path) -> None:
    base, placed, x = _placed(kind, tmp_path)
    placed_hooks = _accelerate_hooks(placed)
    assert placed_hooks
    VERBS[verb](base, placed, x, tmp_path)
    assert _accelerate_hooks(placed) == placed_hooks  # accelerate's hooks are still there
    assert any(p.is_meta for p in placed.parameters())  # and still offload after the block
    with torch.no_grad():
        assert torch.equal(placed(x), base(x))  # the model still runs, with the same values
    assert hookscope.remove_hooks(placed) == 0 and _accelerate_hooks(placed) == placed_hooks


@pytest.mark.parametrize("kind", list(PLACEMENTS))
def test_input_device_is_the_execution_device_not_meta(kind: str, tmp_path: Path) -> None:
    _, placed, _ = _placed(kind, tmp_path)
    assert next(placed.parameters()).is_meta or kind == "dispatch_model"
    assert input_device(placed) == torch.device("cpu")


def test_input_device_without_accelerate() -> None:
    assert input_device(_net()) == torch.device("cpu")
    on_meta = _net().to("meta")  # nothing loads its weights: it runs on meta inputs only
    assert input_device(on_meta) == torch.device("meta")
    assert input_device(nn.Sequential()) == torch.device("cpu")  # no tensors at all
    buffers_only = nn.BatchNorm1d(4, affine=False).to(torch.float64)
    assert input_device(buffers_only) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_model_dispatched_to_the_gpu_gets_its_batch_there(tmp_path: Path) -> None:
    base = _net()
    placed = accelerate.dispatch_model(
        copy.deepcopy(base), device_map={"0": 0, "1": 0, "2": "cpu", "3": "disk"},
        offload_dir=str(tmp_path / "offload"), main_device=0)
    x = torch.randn(4, 8)
    assert input_device(placed) == torch.device("cuda", 0)
    plain = plain_capture(base, [LAYER], x, grad_enabled=False)[LAYER][0]
    store = hookscope.extract(placed, TensorDataset(x), [LAYER], tmp_path / "store",
                              batch_size=4, progress=False)
    assert torch.allclose(store[LAYER][:4], plain, atol=1e-5)
    result = hookscope.compare(base, placed, x, atol=1e-4)
    assert result.first_divergent is None
