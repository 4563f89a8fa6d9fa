"""Attacks on written files (round 3): layer names that become the same PNG, the root module's
PNG, and a symbolic link where an output file goes (a link is a user's file: never replaced
without --overwrite, never followed)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.errors import HookscopeError, SpecError
from hookscope.zoo.viz import plot_activations, png_files

_UNSAFE = re.compile(r"[^A-Za-z0-9._\-\[\]]")


def test_names_that_sanitize_alike_get_distinct_png_files(tmp_path: Path) -> None:
    files = png_files(tmp_path, ["a/b", "a_b", "a:b", "A_B", ""], _UNSAFE)
    assert [f.name for f in files.values()] == ["a_b.png", "a_b-2.png", "a_b-3.png",
                                                "A_B-4.png", "root.png"]


def test_every_plot_of_a_run_is_kept(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    maps = {"x/y": torch.rand(2, 3, 4, 4), "x_y": torch.rand(2, 3, 4, 4)}
    written = plot_activations(maps, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["x_y-2.png", "x_y.png"]
    assert sorted(os.listdir(tmp_path / "plots")) == ["x_y-2.png", "x_y.png"]


def test_a_dangling_link_where_a_png_goes_counts_as_existing(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "plots").mkdir()
    os.symlink(tmp_path / "elsewhere.png", tmp_path / "plots" / "0.png")
    with pytest.raises(SpecError, match=r"1 PNG\(s\) already exist"):
        plot_activations({"0": torch.rand(1, 2, 3, 3)}, tmp_path / "plots")
    assert os.path.islink(tmp_path / "plots" / "0.png")
    assert not (tmp_path / "elsewhere.png").exists()


def test_save_never_replaces_a_dangling_link_without_overwrite(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with hookscope.capture(model, "0") as acts:
        model(torch.ones(1, 2))
    link = tmp_path / "r.safetensors"
    os.symlink(tmp_path / "missing", link)
    with pytest.raises(HookscopeError, match="exists: pass overwrite=True"):
        acts.save(link)
    assert os.readlink(link) == str(tmp_path / "missing")
    acts.save(link, overwrite=True)  # asked: the link itself is replaced, what it pointed to is not created
    assert not link.is_symlink() and not (tmp_path / "missing").exists()
