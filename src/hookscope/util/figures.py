"""Figures and PNG files: one size, one resolution, written atomically.

Every picture hookscope draws (feature maps, histograms, attention maps, Grad-CAM overlays,
sweep heat maps) is a matplotlib ``Figure`` built on the Agg canvas (object API: no pyplot, no
global state, no display) and written here. matplotlib is the optional extra ``[viz]``; it is
imported when a figure is asked for, never at ``import hookscope``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hookscope.util.extras import require
from hookscope.util.files import write_atomic

__all__ = ["FIGURE_SIZE_PX", "DPI", "new_figure", "save_figure"]

FIGURE_SIZE_PX = (1600, 800)  # (width, height) of every PNG hookscope writes
DPI = 100


def new_figure(purpose: str) -> Any:
    """A blank ``matplotlib.figure.Figure`` of ``FIGURE_SIZE_PX`` pixels at ``DPI``.

    Raises:
        MissingExtraError: matplotlib is not installed; ``purpose`` (a flag or function name)
            says what needed it.
    """
    figure_module = require("matplotlib.figure", purpose)
    width, height = FIGURE_SIZE_PX
    return figure_module.Figure(figsize=(width / DPI, height / DPI), dpi=DPI)


def save_figure(figure: Any, file: Path) -> Path:
    """Write ``figure`` as a PNG to ``file`` atomically (temporary name, fsync, rename)."""
    write_atomic(file, lambda tmp: figure.savefig(tmp, format="png", dpi=DPI))
    return file
