"""Grad-CAM on the zoo: equal to the formula of Selvaraju et al. (2017) computed by hand."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hookscope
from hookscope import GradcamError
from tests.models import InplaceRelu, LeNet


def _by_hand(model: LeNet, x: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    a = model.pool(F.relu(model.conv1(x)))
    features = model.conv2(a)  # (batch, 16, 10, 10)
    h = model.pool(F.relu(features))
    logits = model.fc2(F.relu(model.fc1(h.flatten(1))))
    (grads,) = torch.autograd.grad(logits.gather(1, classes[:, None]).sum(), features)
    cam = F.relu((grads.mean(dim=(2, 3), keepdim=True) * features).sum(dim=1, keepdim=True))
    cam = F.interpolate(cam, size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
    low, high = cam.amin(dim=(1, 2), keepdim=True), cam.amax(dim=(1, 2), keepdim=True)
    return (cam - low) / (high - low)


def test_gradcam_equals_the_formula_for_the_predicted_class() -> None:
    model, x = LeNet().eval(), torch.randn(3, 3, 32, 32)
    cam = hookscope.gradcam(model, x, "conv2")
    expected = _by_hand(model, x, model(x).argmax(dim=1))
    assert cam.shape == (3, 32, 32) and cam.dtype == torch.float32
    assert torch.allclose(cam, expected, atol=1e-5)
    assert float(cam.min()) == 0.0 and float(cam.amax(dim=(1, 2)).min()) == 1.0


def test_gradcam_for_given_classes() -> None:
    model, x = LeNet().eval(), torch.randn(2, 3, 32, 32)
    assert torch.allclose(hookscope.gradcam(model, x, "conv2", target=7),
                          _by_hand(model, x, torch.tensor([7, 7])), atol=1e-5)
    assert torch.allclose(hookscope.gradcam(model, x, "conv2", target=[3, 9]),
                          _by_hand(model, x, torch.tensor([3, 9])), atol=1e-5)


def test_gradcam_leaves_parameters_and_frozen_weights_alone() -> None:
    model, x = LeNet().eval(), torch.randn(1, 3, 32, 32)
    expected = hookscope.gradcam(model, x, "conv2")
    assert all(p.grad is None for p in model.parameters())
    model.requires_grad_(False)
    assert torch.allclose(hookscope.gradcam(model, x, "conv2"), expected)


def test_gradcam_through_an_inplace_relu_after_the_layer() -> None:
    cam = hookscope.gradcam(_Classifier(), torch.randn(2, 3, 6, 6), "body.conv")
    assert cam.shape == (2, 6, 6) and 0.0 <= float(cam.min()) and float(cam.max()) <= 1.0


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = InplaceRelu().eval()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).mean(dim=(2, 3)))


def test_gradcam_errors_say_what_to_do() -> None:
    model, x = LeNet().eval(), torch.randn(1, 3, 32, 32)
    with pytest.raises(GradcamError, match="not a feature map"):
        hookscope.gradcam(model, x, "fc1")
    with pytest.raises(GradcamError, match="matches 2 modules .*give its exact path"):
        hookscope.gradcam(model, x, "conv*")
    with pytest.raises(GradcamError, match=r"out of range: the model has 10 classes"):
        hookscope.gradcam(model, x, "conv2", target=10)
    with pytest.raises(GradcamError, match=r"got shape \(3, 32, 32\): one image without its batch "
                                           r"dimension: pass x\[None\]"):
        hookscope.gradcam(model, x[0], "conv2")
    for vectors in (torch.randn(1, 4), torch.randn(4)):  # x[None] would not make these images
        with pytest.raises(GradcamError, match=rf"got shape {re.escape(str(tuple(vectors.shape)))}: "
                                               rf"{vectors.dim()}-D input has no height and width") as err:
            hookscope.gradcam(model, vectors, "conv2")
        assert "x[None]" not in str(err.value) and "attribution_patching" in str(err.value)
    with pytest.raises(GradcamError, match=r"a video or a stack of batches: pass one batch of frames"):
        hookscope.gradcam(model, x[None], "conv2")
    with pytest.raises(GradcamError, match=r"ran 2 times .*call=k"):
        hookscope.gradcam(model, x, "pool")
    assert hookscope.gradcam(model, x, "pool", call=0).shape == (1, 32, 32)


def test_overlay_png_is_written_atomically(tmp_path: Path) -> None:
    image = (np.random.default_rng(0).random((32, 40, 3)) * 255).astype(np.uint8)
    cam = torch.rand(16, 20)  # resized to the image
    file = hookscope.save_gradcam_overlay(image, cam, tmp_path / "sub" / "cam.png", title="t")
    assert file == tmp_path / "sub" / "cam.png"
    assert file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and file.stat().st_size > 5000
    assert [p.name for p in file.parent.iterdir()] == ["cam.png"]
    with pytest.raises(hookscope.errors.OutputExistsError, match=r"pass overwrite=True"):
        hookscope.save_gradcam_overlay(image, cam, file, overwrite=False)
    with pytest.raises(hookscope.errors.OutputExistsError, match=r"is a folder"):  # as every save
        hookscope.save_gradcam_overlay(image, cam, tmp_path, overwrite=True)
    with pytest.raises(GradcamError, match=r"permute\(1, 2, 0\)"):
        hookscope.save_gradcam_overlay(torch.rand(3, 32, 40), cam, tmp_path / "x.png")
