"""Grad-CAM on the real EfficientNet-Lite0 and scikit-image's chelsea photo: it looks at the cat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookscope

pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("skimage")

# Regions of chelsea (451 x 300, resized to 224 x 224) as fractions of (rows, columns): the cat's
# face (eyes, nose, forehead), and the blurred room right of the cat.
FACE = ((0.15, 0.95), (0.20, 0.75))
BACKGROUND = ((0.30, 1.00), (0.88, 1.00))


def _region(cam: torch.Tensor, box: tuple[tuple[float, float], tuple[float, float]]) -> torch.Tensor:
    (top, bottom), (left, right) = box
    height, width = cam.shape
    return cam[int(top * height):int(bottom * height), int(left * width):int(right * width)]


@pytest.mark.slow
def test_gradcam_on_chelsea_looks_at_the_cat(tmp_path: Path) -> None:
    import skimage.data

    from hookscope.zoo.inputs import preprocess_image
    from hookscope.zoo.models import load_model

    loaded = load_model("efficientnet-lite0")
    x, picture = preprocess_image(skimage.data.chelsea(), loaded.preprocess)
    cam = hookscope.gradcam(loaded.module, x[None], "_conv_head")  # predicted: 285 Egyptian cat
    assert cam.shape == (1, 224, 224)
    assert float(cam.min()) == 0.0 and float(cam.max()) == 1.0
    face, background = _region(cam[0], FACE), _region(cam[0], BACKGROUND)
    assert float(face.mean()) > 0.5 > 0.25 > float(background.mean())
    assert float(face.max()) == 1.0  # the peak lies on the cat's face
    file = hookscope.save_gradcam_overlay(picture, cam[0], tmp_path / "chelsea.png")
    assert file.stat().st_size > 50_000
