"""Your own image model in the CLI (issue 25): any model spec takes images given a preprocessing
(--image-size, --mean, --std, or a factory returning LoadedModel), and ``hf:DIR`` loads the
class its config.json names, with its image processor, refusing missing or unused weights."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import hookscope
from hookscope.cli.main import main
from hookscope.errors import SpecError
from hookscope.zoo.models import ImagePreprocess, load_model

transformers = pytest.importorskip("transformers")

MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn
    from hookscope.zoo.models import ImagePreprocess, LoadedModel

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(4, 3)).eval()

    def loaded():
        return LoadedModel(build(), kind="image",
                           preprocess=ImagePreprocess(size=(12, 10), mean=(0.5, 0.5, 0.5),
                                                      std=(0.25, 0.25, 0.25)))

    def without_preprocess():
        return LoadedModel(build(), kind="image")
""")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mycnn.py").write_text(MODEL_FILE)
    rng = np.random.default_rng(0)
    for name in ("cat.png", "dog.png"):
        Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def by_hand(path: Path, size: tuple[int, int], mean: float, std: float) -> torch.Tensor:
    """Pillow bicubic resize to (height, width), scaled to [0, 1], normalised: (1, 3, h, w)."""
    image = Image.open(path).convert("RGB").resize((size[1], size[0]), Image.Resampling.BICUBIC)
    pixels = (np.asarray(image, np.float32) / 255.0 - mean) / std
    return torch.from_numpy(pixels).permute(2, 0, 1)[None]


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(4, 3)).eval()


def test_capture_your_cnn_on_an_image_with_image_size_mean_std(folder: Path) -> None:
    assert main(["capture", "mycnn.py:build", "--input", "cat.png", "--layers", "0",
                 "--image-size", "16", "--mean", "0.5,0.5,0.5", "--std", "0.25,0.25,0.25",
                 "--save", "acts.safetensors", "--gradcam", "1", "--plot", "plots"]) == 0
    with torch.no_grad():
        expected = build()[0](by_hand(folder / "cat.png", (16, 16), 0.5, 0.25))
    saved = load_file(str(folder / "acts.safetensors"))
    torch.testing.assert_close(saved["0"], expected, rtol=1e-5, atol=1e-5)
    assert (folder / "plots" / "gradcam_0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_factory_returning_loaded_model_takes_images(folder: Path) -> None:
    assert main(["capture", "mycnn.py:loaded", "--input", "cat.png", "dog.png", "--layers", "0",
                 "--save", "acts.safetensors"]) == 0
    with torch.no_grad():
        expected = build()[0](torch.cat([by_hand(folder / n, (12, 10), 0.5, 0.25)
                                         for n in ("cat.png", "dog.png")]))
    torch.testing.assert_close(load_file(str(folder / "acts.safetensors"))["0"], expected,
                               rtol=1e-5, atol=1e-5)
    loaded = load_model("mycnn.py:loaded")
    assert loaded.spec == "mycnn.py:loaded" and loaded.preprocess == ImagePreprocess(
        (12, 10), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def test_extract_a_folder_of_photos_with_your_model(folder: Path) -> None:
    (folder / "photos").mkdir()
    for name in ("cat.png", "dog.png"):
        (folder / name).rename(folder / "photos" / name)
    assert main(["extract", "mycnn.py:build", "--data", "photos", "--layers", "3", "--out",
                 "store", "--image-size", "16", "--no-progress"]) == 0
    model = build()
    stored = hookscope.open_store(folder / "store")["3"][0:2]
    assert stored.shape == (2, 4)
    # ImageNet mean/std per channel: compare with the exact per-channel normalisation
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    raw = torch.cat([by_hand(folder / "photos" / n, (16, 16), 0.0, 1.0)
                     for n in ("cat.png", "dog.png")])
    with torch.no_grad():
        expected = model[:4]((raw - mean) / std)
    torch.testing.assert_close(stored, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("argv", "message"), [
    (["capture", "mycnn.py:build", "--input", "cat.png", "--layers", "0"],
     r"'mycnn.py:build' does not take images \(cat.png\).*--image-size N.*LoadedModel\(module, "
     r"kind='image', preprocess=ImagePreprocess"),
    (["stats", "mycnn.py:build", "--data", "photos", "--layers", "4"],
     r"'mycnn.py:build' does not take images \(--data photos is a folder of images\): it takes "
     r"tensors.*--image-size N \(and --mean R,G,B --std R,G,B.*LoadedModel\(module, "
     r"kind='image', preprocess=ImagePreprocess"),
    (["extract", "mycnn.py:build", "--data", "photos", "--layers", "4", "--out", "store"],
     r"'mycnn.py:build' does not take images \(--data photos is a folder of images\): it takes "
     r"tensors.*--image-size N \(and --mean R,G,B --std R,G,B.*LoadedModel\(module, "
     r"kind='image', preprocess=ImagePreprocess"),
    (["capture", "mycnn.py:build", "--input", "cat.png", "--layers", "0", "--mean", "0,0,0"],
     r"'mycnn.py:build' has no image preprocessing of its own, so --mean/--std need the image "
     r"size too: add --image-size N"),
    (["capture", "mycnn.py:without_preprocess", "--input", "cat.png", "--layers", "0"],
     r"returned a LoadedModel\(kind='image'\) without preprocess: give preprocess=ImagePreprocess"),
])
def test_images_without_a_preprocessing_are_refused_naming_the_fix(
        folder: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "--data" in argv:
        (folder / "photos").mkdir()
        (folder / "cat.png").rename(folder / "photos" / "cat.png")
    assert main(argv) == 2  # usage: nothing was written
    assert re.search(message, capsys.readouterr().err.replace("\n", " "))
    assert not (folder / "store").exists()


def test_bad_image_options_are_refused_at_parse_time(folder: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["capture", "mycnn.py:build", "--input", "cat.png", "--layers", "0",
              "--std", "0.2,0,0.2"])
    assert "'0.2,0,0.2' is not three numbers R,G,B > 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- hf:DIR
def tiny_vit(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, num_labels=3,
                                    id2label={0: "cat", 1: "dog", 2: "fox"},
                                    label2id={"cat": 0, "dog": 1, "fox": 2})
    model = transformers.ViTForImageClassification(config).eval()
    folder = tmp_path / "vit"
    model.save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                   image_std=[0.5] * 3).save_pretrained(folder)
    return folder, model


def test_hf_folder_loads_the_class_config_names_with_its_processor(tmp_path: Path) -> None:
    folder, saved = tiny_vit(tmp_path)
    loaded = load_model(f"hf:{folder}")
    assert type(loaded.module).__name__ == "ViTForImageClassification"
    torch.testing.assert_close(loaded.module.classifier.weight, saved.classifier.weight)
    assert loaded.kind == "image" and loaded.class_names == ("cat", "dog", "fox")
    assert loaded.preprocess == ImagePreprocess((32, 32), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5),
                                                "bilinear")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(x).logits, saved(x).logits)


def test_hf_folder_refuses_missing_and_unused_weights(tmp_path: Path) -> None:
    folder, _ = tiny_vit(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["ViTModel"]}))
    with pytest.raises(SpecError, match=r"does not load as ViTModel: weights missing from the "
                                        r"folder \(they would keep random values\): pooler.dense"
                                        r".*weights in the folder but not used by ViTModel: "
                                        r"classifier.bias, classifier.weight"):
        load_model(f"hf:{folder}")
    (folder / "model.safetensors").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=r"ViTForImageClassification found no weights in .*"
                                        r"save the model there with model.save_pretrained"):
        load_model(f"hf:{folder}")
