"""Inference tensors, DTensors, meta tensors and FakeTensors through every verb (issue 20; cases
42 and 48): each is held as a usable value, or refused by one engine rule naming the fix."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import HookscopeError
from tests.models import ReluMlp


# ----------------------------------------------------------------- case 42: inference tensors
@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 6), clone=st.sampled_from([None, True, False]), inputs=st.booleans())
def test_42_inference_mode_captures_train_a_probe(batch: int, clone: bool | None, inputs: bool) -> None:
    torch.manual_seed(batch)
    backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(batch, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clone=False under inference_mode warns (unverifiable)
        with torch.inference_mode(), hookscope.capture(backbone, "1", clone=clone, inputs=inputs) as acts:
            backbone(x)
    with torch.no_grad():
        expected = torch.relu(backbone[0](x))
    f = acts["1"]
    assert not f.is_inference() and torch.equal(f, expected)
    probe = nn.Linear(8, 1)
    probe(f).sum().backward()  # an inference tensor cannot be saved for backward
    assert probe.weight.grad is not None
    assert torch.allclose(probe.weight.grad, f.sum(0, keepdim=True))
    f.add_(1)  # in-place outside inference mode
    assert torch.equal(acts["1"], expected + 1) and acts["1"] is f  # converted once, kept
    if inputs:
        assert not acts.inputs("1")[0].is_inference()


def test_42_records_stay_inference_tensors_until_read_outside() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    with torch.inference_mode():
        with hookscope.capture(model, "**") as acts:
            model(torch.randn(2, 3, 8, 8))
        assert acts.entry("0").outputs[0].is_inference()  # nothing converted at capture time
        assert acts["0"].is_inference()  # read inside: as kept
    assert not acts["0"].is_inference()


def test_42_stats_extract_compare_under_inference_mode(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ReluMlp(4).eval()
    x = torch.randn(5, 4)
    with torch.no_grad():
        up = model.up(x)
    with torch.inference_mode():
        result = hookscope.stats(model, [x], "up")["up"]
        store = hookscope.extract(model, [x], "up", tmp_path / "s", progress=False)
        diff = hookscope.compare(model, model, x, layers="up")["up"]
    assert torch.allclose(result.mean, up.double().mean()) and int(result.count) == up.numel()
    assert torch.equal(store["up"][:], up) and diff.max_abs == 0.0


# ----------------------------------------------------------------- case 48: DTensor outputs
def _tp_pair(local_output: bool = False) -> tuple[ReluMlp, ReluMlp]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    tp, reference = ReluMlp(4), ReluMlp(4)
    reference.load_state_dict(tp.state_dict())
    parallelize_module(tp, DeviceMesh("cpu", [0]),
                       {"up": ColwiseParallel(use_local_output=local_output), "down": RowwiseParallel()})
    return tp, reference


def test_48_capture_save_load_keep_the_global_tensor(process_group: None, tmp_path: Path) -> None:
    tp, reference = _tp_pair()
    x = torch.randn(3, 4)
    with hookscope.capture(tp, "up") as acts:
        tp(x)
    with torch.no_grad():
        expected = reference.up(x)
    kept = acts["up"]
    assert type(kept) is torch.Tensor and torch.allclose(kept, expected, atol=1e-6)
    assert "DTensor (Shard(dim=1)" in acts.notes["up"] and "full_tensor()" in acts.notes["up"]
    acts.save(tmp_path / "a.safetensors")
    assert torch.equal(hookscope.load(tmp_path / "a.safetensors")["up"], kept)


def test_48_compare_stats_with_the_unsharded_model(process_group: None) -> None:
    tp, reference = _tp_pair()
    x = torch.randn(3, 4)
    comparison = hookscope.compare(reference, tp, x, layers=["up", "down"])
    assert comparison["up"].close and comparison["up"].max_abs < 1e-6
    assert comparison.first_divergent is None
    with torch.no_grad():
        up = reference.up(x)
    assert torch.allclose(hookscope.stats(tp, [x], "up")["up"].mean, up.double().mean())


@settings(max_examples=5, deadline=None)
@given(scale=st.floats(-3, 3))
def test_48_steer_and_patch_a_dtensor_output(process_group: None, scale: float) -> None:
    tp, reference = _tp_pair()
    x = torch.randn(3, 4)
    vector = torch.linspace(-1, 1, 8)
    with torch.no_grad():
        with hookscope.steer(tp, {"up": vector}, scale=scale):
            steered = tp(x)
        want = reference.down(torch.relu(reference.up(x) + scale * vector))  # plain PyTorch
    assert torch.allclose(steered, want, atol=1e-5)
    with hookscope.capture(reference, "up") as source:
        reference(x + 1)
    with torch.no_grad(), hookscope.patch(tp, source=source, layers="up"):
        patched = tp(x)
    with torch.no_grad():
        want = reference.down(torch.relu(reference.up(x + 1)))
    assert torch.allclose(patched, want, atol=1e-5)


def test_48_edit_gradient_flows_through_a_dtensor_output(process_group: None) -> None:
    tp, reference = _tp_pair()
    x = torch.randn(3, 4)
    with hookscope.edit(tp, {"up": lambda o: o * 2}):
        tp(x).sum().backward()
    with hookscope.edit(reference, {"up": lambda o: o * 2}):
        reference(x).sum().backward()
    grad = tp.up.weight.grad
    assert grad is not None and reference.up.weight.grad is not None
    assert torch.allclose(grad.full_tensor(), reference.up.weight.grad, atol=1e-5)  # type: ignore[attr-defined]


# ----------------------------------------------------------------- meta tensors, FakeTensors
def _fake_model() -> tuple[nn.Module, torch.Tensor, object]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = ReluMlp(4)
        x = torch.randn(3, 4)
    return model, x, mode


@pytest.mark.filterwarnings("ignore:the records of up hold")  # extract's own capture warns first
@pytest.mark.parametrize("kind", ["meta", "fake"])
def test_valueless_tensors_are_noted_and_refused_by_every_verb(kind: str, tmp_path: Path) -> None:
    if kind == "meta":
        with torch.device("meta"):
            model, x = ReluMlp(4), torch.randn(3, 4)
        mode = None
    else:
        model, x, mode = _fake_model()
    word = "meta tensor" if kind == "meta" else "FakeTensor"

    def run(fn):  # type: ignore[no-untyped-def]
        if mode is None:
            return fn()
        with mode:  # type: ignore[attr-defined]
            return fn()

    def capture_it() -> hookscope.Records:
        with hookscope.capture(model, "up") as acts:
            model(x)
        return acts
    with pytest.warns(RuntimeWarning, match=word):
        acts = run(capture_it)
    assert word in acts.notes["up"] and tuple(acts["up"].shape) == (3, 8)  # shapes, noted
    for verb, fn in [
        ("save", lambda: acts.save(tmp_path / "a.safetensors")),
        ("stats", lambda: hookscope.stats(model, [x], "up")),
        ("extract", lambda: hookscope.extract(model, [x], "up", tmp_path / "s", progress=False)),
        ("compare", lambda: hookscope.compare(model, model, x, layers="up")),
    ]:
        with pytest.raises(HookscopeError, match=f"'up' returned a {word}.*to_empty") as err:
            run(fn)
        assert "no values" in str(err.value), verb
