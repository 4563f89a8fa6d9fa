"""Grad-CAM++, LayerCAM and token models (ViT, Swin from configs): equal to the formulas of
Chattopadhay et al. (2018) and Jiang et al. (2021) computed by hand in plain torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope import GradcamError
from tests.models import LeNet

transformers = pytest.importorskip("transformers")


def _unit(cam: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    cam = F.interpolate(cam[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    low, high = cam.amin(dim=(1, 2), keepdim=True), cam.amax(dim=(1, 2), keepdim=True)
    return (cam - low) / (high - low)


def _by_hand(features: torch.Tensor, grads: torch.Tensor, method: str) -> torch.Tensor:
    """The papers' formulas, one channel k at a time: (batch, channels, h, w) -> (batch, h, w)."""
    cam = torch.zeros(features.shape[0], *features.shape[2:])
    for k in range(features.shape[1]):
        a, g = features[:, k], grads[:, k]  # (batch, h, w)
        if method == "gradcam":
            cam += g.mean(dim=(1, 2))[:, None, None] * a
        elif method == "gradcam++":  # Chattopadhay et al. 2018, eq. 19
            denominator = 2 * g**2 + a.sum(dim=(1, 2))[:, None, None] * g**3
            alpha = torch.nan_to_num(g**2 / denominator)
            cam += (alpha * g.clamp_min(0)).sum(dim=(1, 2))[:, None, None] * a
        else:  # LayerCAM, Jiang et al. 2021, eq. 4-5
            cam += g.clamp_min(0) * a
    return cam.clamp_min(0)


@pytest.mark.parametrize("method", ["gradcam", "gradcam++", "layercam"])
def test_lenet_maps_equal_the_papers_formulas(method: str) -> None:
    model, x = LeNet().eval(), torch.randn(3, 3, 32, 32)
    features = model.conv2(model.pool(F.relu(model.conv1(x))))
    logits = model.fc2(F.relu(model.fc1(model.pool(F.relu(features)).flatten(1))))
    classes = logits.argmax(dim=1)
    (grads,) = torch.autograd.grad(logits.gather(1, classes[:, None]).sum(), features)
    expected = _unit(_by_hand(features.detach(), grads, method), (32, 32))
    cam = hookscope.gradcam(model, x, "conv2", method=method)  # type: ignore[arg-type]
    assert cam.shape == (3, 32, 32) and torch.allclose(cam, expected, atol=1e-5)


class _Square(nn.Module):
    """score = sum(A^2) / 2, so d score / d A = A: the maps can be worked out on paper."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.features(x) ** 2).sum(dim=(1, 2, 3))[:, None] / 2


def test_two_channel_maps_worked_out_on_paper() -> None:
    # channel 0: A = [[1, 2], [3, 4]]; channel 1: B = [[1, 0], [0, 0]]; g = A and B.
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]], [[1.0, 0.0], [0.0, 0.0]]]])
    # Grad-CAM: weights mean(A) = 2.5, mean(B) = 0.25: 2.5 A + 0.25 B = [[2.75, 5], [7.5, 10]]
    gradcam = torch.tensor([[0.0, 2.25 / 7.25], [4.75 / 7.25, 1.0]])
    # LayerCAM: A^2 + B^2 = [[2, 4], [9, 16]]
    layercam = torch.tensor([[0.0, 2 / 14], [7 / 14, 1.0]])
    # Grad-CAM++: alpha = 1 / (2 + 10 a) for A (sum 10), 1 / (2 + 1) at B's one 1 (sum 1):
    # w_A = 1/12 + 2/22 + 3/32 + 4/42, w_B = 1/3
    w_a = 1 / 12 + 2 / 22 + 3 / 32 + 4 / 42
    plus = torch.tensor([[w_a + 1 / 3, 2 * w_a], [3 * w_a, 4 * w_a]])
    plus = (plus - plus.min()) / (plus.max() - plus.min())
    for method, expected in [("gradcam", gradcam), ("layercam", layercam), ("gradcam++", plus)]:
        cam = hookscope.gradcam(_Square(), x, "features", method=method)  # type: ignore[arg-type]
        assert torch.allclose(cam[0], expected, atol=1e-6), method


def _vit(registers: int = 0) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2,
                                    hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                    num_labels=5)
    return transformers.ViTForImageClassification(config).eval()


def _vit_by_hand(model: nn.Module, x: torch.Tensor, method: str) -> torch.Tensor:
    """Plain forward hook on the last block's layernorm_before, class token dropped by hand."""
    kept: list[torch.Tensor] = []
    module = model.vit.layers[1].layernorm_before
    handle = module.register_forward_hook(lambda m, a, o: kept.append(o))
    try:
        logits = model(x).logits
    finally:
        handle.remove()
    (grads,) = torch.autograd.grad(logits.gather(1, logits.argmax(1, keepdim=True)).sum(), kept[0])
    def grid(t: torch.Tensor) -> torch.Tensor:  # (batch, 17, 32) -> (batch, 32, 4, 4)
        return t[:, 1:].reshape(t.shape[0], 4, 4, 32).permute(0, 3, 1, 2)
    return _unit(_by_hand(grid(kept[0].detach()), grid(grads), method), (32, 32))


@settings(max_examples=6, deadline=None)
@given(method=st.sampled_from(["gradcam", "gradcam++", "layercam"]), batch=st.integers(1, 3),
       grid_given=st.booleans())
def test_vit_tokens_laid_on_the_patch_grid(method: str, batch: int, grid_given: bool) -> None:
    model, x = _vit(), torch.randn(batch, 3, 32, 32)
    cam = hookscope.gradcam(model, x, "vit.layers.1.layernorm_before", method=method,  # type: ignore[arg-type]
                            grid=(4, 4) if grid_given else None)
    assert cam.shape == (batch, 32, 32)
    assert torch.allclose(cam, _vit_by_hand(model, x, method), atol=1e-5)


def test_swin_stage_grid_inferred_without_class_token() -> None:
    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                     num_heads=[2, 2], window_size=4, num_labels=3)
    model, x = transformers.SwinForImageClassification(config).eval(), torch.randn(2, 3, 32, 32)
    layer = _swin_last_norm(model)
    cam = hookscope.gradcam(model, x, layer)  # 16 tokens of stage 2: a 4x4 grid, no class token
    assert cam.shape == (2, 32, 32) and float(cam.max()) == 1.0
    assert torch.allclose(cam, hookscope.gradcam(model, x, layer, grid=(4, 4)))


def _swin_last_norm(model: nn.Module) -> str:
    names = [n for n, _ in model.named_modules() if n.endswith("layernorm_before")]
    return names[-1]


def test_token_errors_say_what_to_do() -> None:
    model, x = _vit(), torch.randn(1, 3, 32, 32)
    with pytest.raises(GradcamError, match=r"grid=\(5, 5\) needs 25 patch tokens.*gives 17"):
        hookscope.gradcam(model, x, "vit.layers.1.layernorm_before", grid=(5, 5))
    with pytest.raises(GradcamError, match=r"method='cam' is not one of"):
        hookscope.gradcam(model, x, "vit.layers.1.layernorm_before", method="cam")  # type: ignore[arg-type]
    # 99 … 91 patch tokens after 0 … 8 leading ones: none is a square (81 < 91, 99 < 100)
    with pytest.raises(GradcamError, match=r"99 tokens, which fill no patch grid.*grid=\(h, w\)"):
        hookscope.gradcam(_Tokens(99), torch.randn(1, 3, 8, 8), "tokens")


class _Tokens(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.tokens = nn.Identity()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Any:
        tokens = self.tokens(x.mean(dim=(1, 2, 3))[:, None, None].expand(-1, self.count, 4))
        return self.head(tokens.mean(dim=1))  # (batch, count, 4) tokens -> 2 classes


@pytest.mark.parametrize("method", ["gradcam", "gradcam++", "layercam"])
def test_a_block_output_whose_patch_tokens_get_no_gradient_is_refused(method: str) -> None:
    model, x, block = _vit(), torch.randn(2, 3, 32, 32), 1  # the last block
    # plain torch: the classifier reads only the class token, so the patch tokens' gradient is 0
    kept: list[torch.Tensor] = []
    handle = model.vit.layers[block].register_forward_hook(lambda m, a, o: kept.append(o))
    try:
        logits = model(x).logits
    finally:
        handle.remove()
    (grads,) = torch.autograd.grad(logits.max(1).values.sum(), kept[0])
    assert not grads[:, 1:].any() and grads[:, 0].any()
    with pytest.raises(GradcamError, match=(
            rf"no gradient reaches the spatial/patch positions of 'vit.layers.{block}'.*"
            rf"choose a layer inside the block such as 'vit.layers.{block}.layernorm_before'")):
        hookscope.gradcam(model, x, f"vit.layers.{block}", method=method)  # type: ignore[arg-type]


class _Negated(nn.Module):
    """A positive feature map whose class-0 score is minus its mean: real, negative gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.features(x).mean(dim=(1, 2, 3))
        return torch.stack([-mean, mean], dim=1)


def test_a_map_zero_after_the_relu_of_real_gradients_is_returned() -> None:
    x = torch.rand(2, 3, 8, 8)
    cam = hookscope.gradcam(_Negated(), x, "features", target=0)
    assert torch.equal(cam, torch.zeros(2, 8, 8))  # every weight is negative: relu gives 0


def test_cli_gradcam_on_a_block_output_says_which_layer_to_take(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    from hookscope.cli.main import main

    Image.new("RGB", (32, 32), (90, 140, 200)).save(tmp_path / "photo.png")
    code = main(["gradcam", "tests.test_gradcam_tokens:_vit", "--input", str(tmp_path / "photo.png"),
                 "--image-size", "32", "--layers", "vit.layers.1", "--out", str(tmp_path / "maps")])
    assert code == 1  # a run that failed (GradcamError), nothing drawn
    assert "choose a layer inside the block such as 'vit.layers.1.layernorm_before'" in (
        capsys.readouterr().err)
    assert not list((tmp_path / "maps").glob("*.png"))
