"""Pictures of activations: feature-map grids for conv outputs, histograms for everything else.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global state, no display
needed); matplotlib is the optional extra ``[viz]``. Every PNG is written to a temporary file
in the target folder and renamed into place, so a reader never sees half a picture.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from hookscope.errors import SpecError
from hookscope.util import DPI, FIGURE_SIZE_PX, new_figure, require, save_figure

__all__ = ["plot_activation", "plot_activations", "feature_grid", "histogram", "attention_grid",
           "FIGURE_SIZE_PX", "MAX_CHANNELS", "plan_png_files"]

MAX_CHANNELS = 64  # tiles in one feature-map grid (8 x 8)
_BINS = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._\-\[\]]")


def plot_activation(activation: torch.Tensor, file: str | Path, *, title: str,
                    image: np.ndarray | None = None, sample: int = 0) -> Path:
    """Draw one captured tensor: a feature-map grid if it is 4-D, else a histogram.

    Args:
        activation: ``(batch, channels, height, width)`` for a grid (row ``sample`` is drawn);
            any other shape for a histogram of all its values.
        file: PNG to write (its folder must exist); replaced atomically.
        title: figure title, e.g. ``"_blocks.3  call 0"``.
        image: ``(height, width, 3)`` uint8 input picture drawn beside the grid, or ``None``.
        sample: batch row drawn in a grid.

    Returns:
        The path written, ``FIGURE_SIZE_PX`` pixels.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    if activation.dim() == 4:
        return feature_grid(activation[sample], file, title=title, image=image)
    return histogram(activation, file, title=title)


def plot_activations(activations: Mapping[str, torch.Tensor], folder: str | Path, *,
                     image: np.ndarray | None = None, overwrite: bool = False,
                     sample: int = 0) -> list[Path]:
    """Draw each named tensor into ``folder/<name>.png`` (see ``plot_activation``).

    Args:
        activations: ``{name: tensor}``; names become file names (characters other than
            letters, digits, ``._-[]`` become ``_``) and figure titles.
        folder: created if missing.
        image: input picture drawn beside every feature-map grid.
        overwrite: replace existing PNGs; otherwise an existing one is an error, raised before
            anything is written.
        sample: batch row drawn in grids.

    Returns:
        The PNG paths, in the order of ``activations``.

    Raises:
        SpecError: a PNG exists and ``overwrite`` is false, or ``folder`` is a file.
        MissingExtraError: matplotlib is not installed.
    """
    require("matplotlib", "--plot")
    files = plan_png_files(Path(folder), activations, overwrite, "--plot")
    return [plot_activation(activations[name], file, title=name, image=image, sample=sample)
            for name, file in files.items()]


def plan_png_files(folder: Path, names: Iterable[str], overwrite: bool, flag: str) -> dict[str, Path]:
    """``png_files`` for ``names`` in ``folder``, checked before anything is drawn: an existing
    PNG (or a link where one goes) needs ``overwrite``. ``folder`` is not created here: the
    first PNG written makes it (``util.files.write_atomic``), so a run that fails before
    drawing leaves no empty folder behind.

    Raises:
        SpecError: ``folder`` is a file, or a PNG exists and ``overwrite`` is false (the message
            names ``flag``, the option that chose the folder).
    """
    if folder.exists() and not folder.is_dir():
        raise SpecError(f"{flag.lstrip('-')} folder '{folder}' is a file; give a folder, e.g. "
                        f"{flag} out/")
    files = png_files(folder, names, _UNSAFE)
    existing = [str(f) for f in files.values() if os.path.lexists(f)]
    if existing and not overwrite:
        raise SpecError(f"{len(existing)} PNG(s) already exist in '{folder}' (e.g. {existing[0]}); "
                        f"pass --overwrite to replace them, or choose another {flag}")
    return files


def png_files(folder: Path, names: Iterable[str], unsafe: re.Pattern[str]) -> dict[str, Path]:
    """``{name: folder/<name>.png}`` with the characters ``unsafe`` matches turned into ``_``;
    names that become the same file (``a/b`` and ``a_b``) get ``-2``, ``-3``... so no plot of a
    run overwrites another, and the root module (``""``) is ``root.png``, not a hidden file."""
    files: dict[str, Path] = {}
    taken: set[str] = set()
    for name in names:
        stem = unsafe.sub("_", name) or "root"
        unique, k = stem, 1
        while unique.lower() in taken:  # lower: a case-insensitive disk would merge them too
            k += 1
            unique = f"{stem}-{k}"
        taken.add(unique.lower())
        files[name] = folder / f"{unique}.png"
    return files


def feature_grid(maps: torch.Tensor, file: str | Path, *, title: str,
                 image: np.ndarray | None = None) -> Path:
    """Draw up to ``MAX_CHANNELS`` channels of one ``(channels, height, width)`` map as tiles.

    The channels with the most spatial variation (largest standard deviation) are shown, in
    channel order, each tile scaled to its own min..max (viridis) and labelled with its index.
    The tiles form one mosaic image, so drawing costs about the same for 4 or 64 channels.

    Returns:
        ``file`` as a ``Path``.
    """
    figure = new_figure("--plot")
    values = maps.detach().float().cpu()  # (channels, height, width)
    chosen = _varied_channels(values)
    left = 0.0
    if image is not None:
        axes = figure.add_axes((0.01, 0.06, 0.30, 0.84))
        axes.imshow(image)
        axes.set_title("input", fontsize=11)
        axes.axis("off")
        left = 0.33
    mosaic, origins = _mosaic(values, chosen)
    axes = figure.add_axes((left + 0.01, 0.02, 0.98 - left, 0.88))
    axes.imshow(mosaic, cmap="viridis", interpolation="nearest", vmin=0.0, vmax=1.0)
    axes.axis("off")
    for channel, (top, start) in zip(chosen, origins):
        axes.text(start, top - 0.5, str(channel), fontsize=6, color="black",
                  verticalalignment="bottom")
    channels, height, width = values.shape
    shown = (f"all {channels} channels" if len(chosen) == channels else
             f"{len(chosen)} of {channels} channels (most varied)")
    figure.suptitle(f"{title}   {channels}x{height}x{width}, {shown}, each tile min..max",
                    fontsize=12)
    return save_figure(figure, Path(file))


def histogram(values: torch.Tensor, file: str | Path, *, title: str) -> Path:
    """Draw the distribution of every finite value of ``values`` (any shape), log-count axis.

    Returns:
        ``file`` as a ``Path``.
    """
    figure = new_figure("--plot")
    flat = values.detach().reshape(-1).float().cpu().numpy()
    finite = flat[np.isfinite(flat)]
    axes = figure.add_axes((0.07, 0.10, 0.90, 0.78))
    if finite.size:
        axes.hist(finite, bins=_BINS, color="#3b75af")
        axes.axvline(float(finite.mean()), color="#d62728", linestyle="--", label="mean")
        axes.legend(loc="upper right")
    axes.set_yscale("log")
    axes.set_xlabel("value")
    axes.set_ylabel("count (log)")
    shape = "x".join(str(n) for n in values.shape) or "scalar"
    summary = (f"mean {finite.mean():.4g}, std {finite.std():.4g}, min {finite.min():.4g}, "
               f"max {finite.max():.4g}" if finite.size else "no finite values")
    nonfinite = flat.size - finite.size
    figure.suptitle(f"{title}   {shape} {str(values.dtype).removeprefix('torch.')}: {summary}"
                    + (f", {nonfinite} NaN/Inf" if nonfinite else ""), fontsize=12)
    return save_figure(figure, Path(file))


def attention_grid(probabilities: torch.Tensor, file: str | Path, *, title: str,
                   tokens: list[str] | None = None, heads: list[int] | None = None) -> Path:
    """Draw each head's attention probabilities as a heat map, heads in a grid.

    Args:
        probabilities: ``(heads, query, key)`` values in [0, 1] (one batch row of what
            ``hookscope.attention`` returns); every map shares the colour scale 0..1 (viridis).
        file: PNG to write (its folder must exist); replaced atomically.
        title: figure title, e.g. ``"encoder.layer.2"``.
        tokens: labels of the positions, drawn on both axes (queries down, keys across) when
            there are at most 40 of them; ``None`` for indices.
        heads: the head number of each map, for its title (``--head 3 7``: the maps are heads 3
            and 7); ``None``: 0, 1, ...

    Returns:
        ``file`` as a ``Path``, ``FIGURE_SIZE_PX`` wide and as tall as the grid needs.
    """
    values = probabilities.detach().float().cpu()  # (heads, query, key)
    count, queries, keys = values.shape
    columns = math.ceil(math.sqrt(count * 4 / 3))
    rows = math.ceil(count / columns)
    width = FIGURE_SIZE_PX[0] / DPI
    figure = require("matplotlib.figure", "--plot").Figure(
        figsize=(width, width * rows / columns + 0.6), dpi=DPI)
    grid = figure.subplots(rows, columns, squeeze=False)
    labelled = tokens is not None and len(tokens) <= 40
    for head, axes in enumerate(grid.flat):
        if head >= count:
            axes.axis("off")
            continue
        axes.imshow(values[head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0,
                    interpolation="nearest")
        axes.set_title(f"head {heads[head] if heads else head}", fontsize=9)
        if labelled and tokens is not None:
            axes.set_xticks(range(keys), tokens[:keys], rotation=90, fontsize=6)
            axes.set_yticks(range(queries), tokens[:queries], fontsize=6)
        else:
            axes.tick_params(labelsize=6)
    figure.suptitle(f"{title}   {count} heads, {queries} queries (rows) x {keys} keys "
                    f"(columns), probability 0..1", fontsize=12)
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    return save_figure(figure, Path(file))


# ------------------------------------------------------------------------------- internals
def _varied_channels(values: torch.Tensor) -> list[int]:
    channels = values.shape[0]
    if channels <= MAX_CHANNELS:
        return list(range(channels))
    spread = torch.nan_to_num(values.reshape(channels, -1).std(dim=1), nan=-1.0)
    return sorted(spread.topk(MAX_CHANNELS).indices.tolist())


def _mosaic(values: torch.Tensor, chosen: list[int]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Tile ``values[chosen]`` (each scaled to [0, 1]) into one array with NaN gaps.

    Returns:
        ``(mosaic, origins)``: a ``(rows * (height + gap), columns * (width + gap))`` float array
        and each tile's ``(row, column)`` of its top-left pixel.
    """
    _, height, width = values.shape
    columns = math.ceil(math.sqrt(len(chosen)))
    rows = math.ceil(len(chosen) / columns)
    gap = max(1, round(max(height, width) * 0.25))  # room for the channel label
    mosaic = np.full((rows * (height + gap), columns * (width + gap)), np.nan, dtype=np.float32)
    origins = []
    for k, channel in enumerate(chosen):
        tile = values[channel]
        low, high = float(tile.min()), float(tile.max())
        scaled = (tile - low) / (high - low) if high > low else torch.zeros_like(tile)
        top, start = (k // columns) * (height + gap) + gap, (k % columns) * (width + gap)
        mosaic[top:top + height, start:start + width] = scaled.numpy()
        origins.append((top, start))
    return mosaic, origins
