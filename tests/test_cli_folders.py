"""``capture``/``stats --input DIR`` (every image file in it, sorted, batched) and ``stats --data
PATH`` (streamed in batches as ``extract`` reads it), against the same statistics computed by hand
over the same pictures: Pillow, plain ``register_forward_hook`` and torch."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from hookscope.cli.main import main
from tests.models import LeNet
from tests.reference import plain_capture

IMAGE = ["--image-size", "32", "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5"]


def _photos(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` random 32x32 RGB PNGs (the model's size: no resampling) named out of order,
    one in a sub-folder, with a text file beside them that is not an image and hidden images."""
    rng = np.random.default_rng(seed)
    names = [f"sub/{i:02d}.png" if i == 1 else f"{(7 * i) % count:02d}-{i}.png"
             for i in range(count)]
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), np.uint8)).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    # hidden files and folders are no input: a notebook's checkpoint copy, macOS's '._' file
    (folder / ".ipynb_checkpoints").mkdir()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), np.uint8)).save(
        folder / ".ipynb_checkpoints" / "00-0-checkpoint.png")
    (folder / "._00-0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble, not a picture")
    return sorted((folder / n for n in names), key=lambda p: p.relative_to(folder).as_posix())


def _by_hand(files: list[Path], layer: str) -> torch.Tensor:
    """Every call's output of ``layer`` of LeNet (seed 0) on ``files``, one batch, plain hooks."""
    pixels = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    x = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    torch.manual_seed(0)
    model = LeNet()
    return torch.cat([o.flatten() for o in plain_capture(model, [layer], x,
                                                          grad_enabled=False)[layer]]).double()


def _expected(values: torch.Tensor) -> dict[str, float]:
    return {"count": values.numel(), "mean": float(values.mean()),
            "std": float(values.std(correction=0)), "min": float(values.min()),
            "max": float(values.max()), "frac_zeros": float((values == 0).double().mean())}


def _stats(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    assert main(["stats", "tests.models:LeNet", *IMAGE, "--json", *argv]) == 0
    result: dict[str, dict[str, float]] = json.loads(capsys.readouterr().out)
    return result


@pytest.mark.parametrize("how", [["--input", "{dir}"], ["--input", "{dir}/"],
                                 ["--data", "{dir}"], ["--data", "{dir}", "--batch-size", "2"],
                                 ["--input", "{dir}", "--batch-size", "3"]])
def test_stats_over_a_folder_equals_the_hand_computed(tmp_path: Path, how: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    files = _photos(tmp_path / "photos", 5)
    got = _stats([a.format(dir=tmp_path / "photos") for a in how] + ["--layers", "conv1", "pool"],
                 capsys)
    for layer in ("conv1", "pool"):  # pool runs twice per forward: both calls count
        expected = _expected(_by_hand(files, layer))
        assert got[layer]["count"] == expected["count"]
        assert {k: got[layer][k] for k in expected} == pytest.approx(expected, rel=1e-5, abs=1e-6)


@settings(max_examples=4, deadline=None)
@given(count=st.integers(1, 6), batch=st.integers(1, 4), seed=st.integers(0, 99))
def test_stats_data_any_batching_is_one_statistic(tmp_path_factory: pytest.TempPathFactory,
                                                  count: int, batch: int, seed: int) -> None:
    folder = tmp_path_factory.mktemp("photos")
    files = _photos(folder, count, seed)
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()) as out, \
            contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["stats", "tests.models:LeNet", *IMAGE, "--json", "--data", str(folder),
                     "--batch-size", str(batch), "--layers", "conv2"]) == 0
    got = json.loads(out.getvalue())["conv2"]
    expected = _expected(_by_hand(files, "conv2"))
    assert {k: got[k] for k in expected} == pytest.approx(expected, rel=1e-5, abs=1e-6)
    batches = -(-count // batch)
    assert f"{count} input(s) from {folder} in {batches} batch(es) of up to {batch}" in \
        err.getvalue()


def test_capture_takes_a_folder_as_its_sorted_images(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    files = _photos(tmp_path / "photos", 4)
    torch.manual_seed(0)
    out = tmp_path / "acts.safetensors"
    assert main(["capture", "tests.models:LeNet", *IMAGE, "--input", str(tmp_path / "photos"),
                 "--layers", "conv1", "--save", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"][0].startswith(f"{files[0]}: 32x32 RGB picture")
    assert [d.split(":")[0] for d in data["inputs"]] == [str(f) for f in files]
    from safetensors.torch import load_file
    expected = _by_hand(files, "conv1").float().reshape(4, 6, 28, 28)
    torch.testing.assert_close(load_file(out)["conv1"], expected, rtol=1e-5, atol=1e-6)


def test_an_empty_folder_and_both_sources_are_usage_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    assert main(["stats", "tests.models:LeNet", *IMAGE, "--input", str(tmp_path / "empty")]) == 2
    assert "holds no image file" in capsys.readouterr().err
    assert main(["stats", "tests.models:LeNet", *IMAGE, "--input", "randn:1,3,32,32",
                 "--data", str(tmp_path)]) == 2
    assert "exactly one of them" in capsys.readouterr().err


def test_hidden_folders_are_no_class_of_data(tmp_path: Path) -> None:
    from hookscope.zoo.data import load_data
    from hookscope.zoo.models import load_model

    for name in ("cat/1.png", "dog/2.png", ".ipynb_checkpoints/3.png", "dog/.ipynb_checkpoints/4.png",
                 ".git/5.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / name)
    model = load_model("tests.models:LeNet", image_size=32, mean=(0.5,) * 3, std=(0.5,) * 3)
    files = load_data(tmp_path, model, batch_size=2).dataset
    assert [files.row_id(i) for i in range(len(files))] == ["cat/1.png", "dog/2.png"]
    assert [files[i][1] for i in range(len(files))] == ["cat", "dog"]
