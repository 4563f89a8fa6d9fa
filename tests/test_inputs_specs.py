"""Input specs with small stand-in models: images, samples, tensor files, randn, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from hookscope.errors import ModelCodeError, SpecError
from hookscope.zoo.inputs import SAMPLES, load_inputs, preprocess_image
from hookscope.zoo.models import ImagePreprocess, LoadedModel
from tests.models import MlpStack

PREPROCESS = ImagePreprocess(size=(16, 24))  # (height, width)


@pytest.fixture()
def image_model() -> LoadedModel:
    return LoadedModel(module=nn.Flatten(), spec="tiny-image", kind="image", preprocess=PREPROCESS)


@pytest.fixture()
def tensor_model() -> LoadedModel:
    return LoadedModel(module=MlpStack().eval(), spec="mlp", kind="tensor")


def _png(path: Path, height: int, width: int, seed: int) -> np.ndarray:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)
    return rgb


def test_preprocess_matches_pillow_resize_and_imagenet_normalisation() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    tensor, resized = preprocess_image(rgb, PREPROCESS)
    expected = np.asarray(Image.fromarray(rgb).resize((24, 16), Image.Resampling.BICUBIC))
    assert np.array_equal(resized, expected)
    manual = (expected / 255.0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    assert tensor.shape == (3, 16, 24) and tensor.dtype == torch.float32
    assert torch.allclose(tensor, torch.from_numpy(manual.transpose(2, 0, 1)).float(), atol=1e-6)


def test_several_image_files_form_one_batch(tmp_path: Path, image_model: LoadedModel) -> None:
    first = _png(tmp_path / "a.png", 40, 30, seed=1)
    _png(tmp_path / "b.jpg", 10, 50, seed=2)
    inputs = load_inputs([str(tmp_path / "a.png"), str(tmp_path / "b.jpg")], image_model)
    (batch,) = inputs.args
    assert batch.shape == (2, 3, 16, 24) and inputs.kwargs == {}
    assert torch.equal(batch[0], preprocess_image(first, PREPROCESS)[0])
    assert [im.shape for im in inputs.images] == [(16, 24, 3), (16, 24, 3)]
    assert inputs.descriptions[0].endswith("a.png: 30x40 RGB picture, resized to 24x16 (bicubic), "
                                           "ImageNet mean/std normalised")


def test_image_batch_takes_the_model_dtype(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", 8, 8, seed=1)
    model = LoadedModel(module=nn.Flatten(), spec="m", kind="image", preprocess=PREPROCESS,
                        dtype=torch.bfloat16)
    assert load_inputs([str(tmp_path / "a.png")], model).args[0].dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_sample_loads_offline_as_rgb(name: str, image_model: LoadedModel) -> None:
    inputs = load_inputs([f"sample:{name}"], image_model)
    assert inputs.args[0].shape == (1, 3, 16, 24)
    assert inputs.images[0].dtype == np.uint8 and inputs.images[0].shape == (16, 24, 3)
    assert torch.isfinite(inputs.args[0]).all()


def test_randn_is_seeded_and_shaped(tensor_model: LoadedModel) -> None:
    a = load_inputs(["randn:2,10"], tensor_model)
    b = load_inputs(["randn:2,10"], tensor_model)
    assert torch.equal(a.args[0], b.args[0])
    assert torch.equal(a.args[0], torch.randn(2, 10, generator=torch.Generator().manual_seed(0)))
    assert a.descriptions == ("randn:2,10: tensor 2x10 float32 (seed 0)",)


def test_tensor_files_become_positional_arguments(tmp_path: Path, tensor_model: LoadedModel) -> None:
    x = torch.arange(20.0).reshape(2, 10)
    torch.save(x, tmp_path / "x.pt")
    np.save(tmp_path / "x.npy", x.numpy())
    save_file({"x": x, "other": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    for spec in ("x.pt", "x.npy", "x.safetensors:x"):
        inputs = load_inputs([str(tmp_path / spec)], tensor_model)
        assert len(inputs.args) == 1 and torch.equal(inputs.args[0], x), spec
    out = inputs.call(tensor_model.module)
    with torch.no_grad():
        assert torch.equal(out, tensor_model.module(inputs.args[0]))


def test_multi_tensor_file_without_key_lists_keys(tmp_path: Path, tensor_model: LoadedModel) -> None:
    save_file({"x": torch.zeros(2), "y": torch.ones(2)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(SpecError, match=r"holds 2 tensors; pick one with '.*two\.safetensors:KEY' "
                                        r"\(keys: x, y\)"):
        load_inputs([str(tmp_path / "two.safetensors")], tensor_model)
    with pytest.raises(SpecError, match=r"has no tensor 'z'; it holds x, y"):
        load_inputs([str(tmp_path / "two.safetensors:z")], tensor_model)


@pytest.mark.parametrize(("specs", "fix"), [
    (["sample:doge"], r"unknown sample 'doge': choose one of astronaut, .*chelsea, .*coffee"),
    (["missing.png"], r"image 'missing\.png' does not exist"),
    (["missing.npy"], r"tensor file 'missing\.npy' does not exist"),
    (["randn:2,0,3"], r"'randn:2,0,3' needs a shape of positive integers, e\.g\. randn:2,3,32,32"),
    (["randn:1,3,16"], r"takes images as a float \(batch, 3, height, width\) tensor, but "
                       r"randn:1,3,16 is \(1, 3, 16\) float32; e\.g\. randn:1,3,16,24"),
    (["hello there"], r"does not take text; it takes images \(png/jpg files, sample:NAME\)"),
    (["notes/readme.md"], r"not a file hookscope can read"),
    (["sample:chelsea", "randn:1,3,16,24"], r"different kinds cannot form one batch"),
    ([], r"no input given"),
])
def test_bad_inputs_say_what_to_do(specs: list[str], fix: str, image_model: LoadedModel) -> None:
    with pytest.raises(SpecError, match=fix):
        load_inputs(specs, image_model)


def test_images_for_a_tensor_model_are_refused(tensor_model: LoadedModel) -> None:
    with pytest.raises(SpecError, match=r"'mlp' does not take images .*it takes tensors: randn"):
        load_inputs(["sample:chelsea"], tensor_model)


def test_unreadable_image_is_one_clear_line(tmp_path: Path, image_model: LoadedModel) -> None:
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(SpecError, match=r"cannot read image '.*broken\.png'"):
        load_inputs([str(tmp_path / "broken.png")], image_model)


def test_pickled_tensor_file_is_refused(tmp_path: Path, tensor_model: LoadedModel) -> None:
    torch.save(MlpStack(), tmp_path / "model.pt")
    with pytest.raises(SpecError, match=r"'.*model\.pt' holds Python objects, not plain tensors") \
            as caught:
        load_inputs([str(tmp_path / "model.pt")], tensor_model)
    assert "weights_only=False" not in str(caught.value)


def test_forward_failure_names_input_and_module(tensor_model: LoadedModel) -> None:
    inputs = load_inputs(["randn:2,7"], tensor_model)
    with pytest.raises(ModelCodeError, match=r"the model failed on input randn:2,7: RuntimeError: "
                                        r".*raised inside 'fc1' \(Linear\)") as caught:
        inputs.call(tensor_model.module)
    assert isinstance(caught.value.__cause__, RuntimeError)
