"""Case 43: gradients of activations under every grad mode and with frozen weights.

``gradcam`` gives the map plain PyTorch gives on a trainable model in grad mode, also for frozen
weights, under ``torch.no_grad()`` and under ``torch.inference_mode()``, and leaves the weights'
``requires_grad`` and ``.grad`` alone. ``capture(..., grads=True)`` records the gradient where a
backward can run and refuses, at block entry and naming the grad mode and the fix, where none
can (no_grad, inference_mode).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope
from hookscope import CaptureError, GradcamError

MODES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
}


def _model(frozen: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
    model.requires_grad_(not frozen)
    return model


def _plain_gradcam(model: nn.Sequential, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grad-CAM of layer 3 by hand (forward hook + tensor hook) on a trainable copy in grad mode;
    also d(score)/d(activation)."""
    model = copy.deepcopy(model).requires_grad_(True)
    store: dict[str, torch.Tensor] = {}

    def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
        store["act"] = output.detach()
        output.register_hook(lambda g: store.__setitem__("grad", g))
    handle = model[3].register_forward_hook(hook)
    out = model(x)
    out.gather(1, out.argmax(1, keepdim=True)).sum().backward()
    handle.remove()
    cam = F.relu((store["grad"].mean((2, 3), keepdim=True) * store["act"]).sum(1, keepdim=True))
    cam = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    low, high = cam.amin((1, 2), keepdim=True), cam.amax((1, 2), keepdim=True)
    return (cam - low) / (high - low), store["grad"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_gradcam_in_every_grad_mode(frozen: bool, mode: str) -> None:
    model, x = _model(frozen), torch.randn(2, 3, 8, 8)
    expected, _ = _plain_gradcam(model, x)
    grads_before = [p.grad for p in model.parameters()]
    with MODES[mode]():
        cam = hookscope.gradcam(model, x.clone(), "3")  # an inference tensor under inference_mode
    assert cam.shape == (2, 8, 8)
    assert torch.allclose(cam, expected, atol=1e-5)
    assert [p.requires_grad for p in model.parameters()] == [not frozen] * 6
    assert [p.grad for p in model.parameters()] == grads_before == [None] * 6


def test_case43_frozen_backbone_as_written() -> None:
    """The reproduction's three failing settings: frozen, no_grad, inference_mode + enable_grad."""
    model, x = _model(frozen=True), torch.randn(1, 3, 8, 8)
    expected, _ = _plain_gradcam(model, x)
    frozen_cam = hookscope.gradcam(model, x, "3")
    model.requires_grad_(True)
    with torch.no_grad():
        no_grad_cam = hookscope.gradcam(model, x, "3")
    with torch.inference_mode(), torch.enable_grad():
        inference_cam = hookscope.gradcam(model, x, "3")
    for cam in (frozen_cam, no_grad_cam, inference_cam):
        assert cam.shape == (1, 8, 8) and torch.allclose(cam, expected, atol=1e-5)


def test_gradcam_on_a_model_built_in_inference_mode_names_it() -> None:
    with torch.inference_mode():
        model = _model(frozen=False)
        with pytest.raises(GradcamError, match=r"inference tensors.*built or loaded under "
                                               r"torch\.inference_mode\(\).*Trainer\(inference_mode=False\)"):
            hookscope.gradcam(model, torch.randn(1, 3, 8, 8), "3")


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_capture_grads_in_grad_mode_records_the_gradient(frozen: bool) -> None:
    """Frozen weights: the user's backward runs once the input requires grad."""
    model, x = _model(frozen), torch.randn(2, 3, 8, 8)
    _, expected = _plain_gradcam(model, x)
    x.requires_grad_(frozen)
    with hookscope.capture(model, "3", grads=True) as acts:
        out = model(x)
        out.gather(1, out.argmax(1, keepdim=True)).sum().backward()
    assert acts.grad("3").shape == (2, 8, 8, 8)
    assert torch.allclose(acts.grad("3"), expected, atol=1e-6)


@pytest.mark.parametrize("option", ["grads", "grad_inputs"])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_capture_grads_refuses_no_grad_at_entry(frozen: bool, option: str) -> None:
    model = _model(frozen)
    block = hookscope.capture(model, "3", **{option: True})
    with torch.no_grad(), pytest.raises(CaptureError, match=rf"{option}=True\) was entered with "
                                        r"gradients disabled \(torch\.no_grad\(\)\).*torch\.enable_grad\(\)"):
        block.__enter__()
    assert hookscope.hooks(model) == []  # nothing was registered


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_capture_grads_refuses_inference_mode_at_entry(frozen: bool) -> None:
    model = _model(frozen)
    with torch.inference_mode(), torch.enable_grad():  # enable_grad cannot lift inference mode
        with pytest.raises(CaptureError, match=r"grads=True\) was entered under torch\.inference_mode"
                                               r"\(\).*Trainer\(inference_mode=False\)"):
            with hookscope.capture(model, "3", grads=True):
                pass
    assert hookscope.hooks(model) == []


def test_capture_grads_with_the_fix_the_message_gives() -> None:
    model, x = _model(frozen=False), torch.randn(2, 3, 8, 8)
    _, expected = _plain_gradcam(model, x)
    with torch.no_grad():
        with torch.enable_grad(), hookscope.capture(model, "3", grads=True) as acts:
            out = model(x)
            out.gather(1, out.argmax(1, keepdim=True)).sum().backward()
    assert torch.allclose(acts.grad("3"), expected, atol=1e-6)
    model.zero_grad(set_to_none=True)
    with torch.inference_mode():
        with torch.inference_mode(False), torch.enable_grad(), \
                hookscope.capture(model, "3", grads=True) as acts:
            out = model(x)
            out.gather(1, out.argmax(1, keepdim=True)).sum().backward()
    assert torch.allclose(acts.grad("3"), expected, atol=1e-6)
