"""PNG pictures of activations: sizes, which channels a grid shows, no overwrite, no temp files."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hookscope.errors import MissingExtraError, SpecError
from hookscope.zoo.viz import FIGURE_SIZE_PX, MAX_CHANNELS, _varied_channels, plot_activations


def _pixels(file: Path) -> np.ndarray:
    with Image.open(file) as image:
        assert image.format == "PNG" and image.size == FIGURE_SIZE_PX
        return np.asarray(image.convert("RGB"))


def test_grid_and_histogram_files(tmp_path: Path) -> None:
    picture = np.zeros((32, 32, 3), dtype=np.uint8)
    picture[..., 0] = 255  # a pure red input picture
    activations = {"conv": torch.randn(2, 5, 8, 8), "fc:1": torch.randn(2, 10),
                   "attn[0]": torch.randn(3, 4, 6)}
    files = plot_activations(activations, tmp_path / "plots", image=picture)
    assert [f.name for f in files] == ["conv.png", "fc_1.png", "attn[0].png"]
    grid = _pixels(files[0])
    red = (grid[..., 0] > 200) & (grid[..., 1] < 50) & (grid[..., 2] < 50)
    assert red[:, : FIGURE_SIZE_PX[0] // 3].sum() > 10_000  # the input picture, on the left
    assert red[:, FIGURE_SIZE_PX[0] // 3:].sum() == 0
    assert not (_pixels(files[1]) == 255).all()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(f.name for f in files)


def test_existing_png_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    activations = {"conv": torch.randn(1, 2, 4, 4)}
    (file,) = plot_activations(activations, tmp_path)
    before = file.read_bytes()
    with pytest.raises(SpecError, match=r"1 PNG\(s\) already exist .*pass --overwrite"):
        plot_activations({"conv": torch.zeros(1, 2, 4, 4)}, tmp_path)
    assert file.read_bytes() == before
    plot_activations({"conv": torch.zeros(1, 2, 4, 4)}, tmp_path, overwrite=True)
    assert file.read_bytes() != before


def test_grid_shows_the_most_varied_channels() -> None:
    maps = torch.zeros(100, 4, 4)
    varied = [3, 99] + list(range(10, 10 + MAX_CHANNELS - 2))
    for channel in varied:
        maps[channel, 0, 0] = 1.0 + channel  # every other channel is constant
    assert _varied_channels(maps) == sorted(varied)
    assert _varied_channels(torch.randn(7, 3, 3)) == list(range(7))


def test_nonfinite_and_constant_values_still_plot(tmp_path: Path) -> None:
    values = torch.tensor([[1.0, float("nan"), float("inf"), 2.0]])
    maps = torch.zeros(1, 3, 4, 4)
    maps[0, 1, 0, 0] = float("nan")
    files = plot_activations({"h": values, "g": maps, "empty": torch.full((3,), float("nan"))},
                             tmp_path)
    for file in files:
        _pixels(file)


def test_plot_folder_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("")
    with pytest.raises(SpecError, match=r"plot folder '.*out' is a file"):
        plot_activations({"a": torch.zeros(3)}, tmp_path / "out")


def test_missing_matplotlib_gives_the_viz_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'hookscope\[viz\]'$"):
        plot_activations({"a": torch.zeros(3)}, tmp_path)
