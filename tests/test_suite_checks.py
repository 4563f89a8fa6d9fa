"""The suite's own checks (tests/conftest.py): the hook-leak check sees modules however they were
made, and hypothesis is deterministic in CI while `make fuzz` draws ten times as many examples."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.conftest import FUZZ_FACTOR, _live_hooks


def _made_every_way() -> dict[str, nn.Module]:
    plain = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    saved = io.BytesIO()
    torch.save(plain, saved)
    saved.seek(0)
    return {"constructor": plain, "deepcopy": copy.deepcopy(plain),
            "pickle": torch.load(saved, weights_only=False),
            "fx": torch.fx.symbolic_trace(plain)}


@pytest.mark.parametrize("how", ["constructor", "deepcopy", "pickle", "fx"])
def test_a_hook_left_on_a_module_is_seen_however_the_module_was_made(how: str) -> None:
    module = _made_every_way()[how]
    before = _live_hooks()
    handle = module.register_forward_hook(lambda *args: None)
    pre = nn.Module.register_forward_pre_hook(module, lambda *args: None)
    assert len(_live_hooks() - before) == 2
    handle.remove()
    pre.remove()
    assert _live_hooks() == before


@pytest.mark.skipif(settings.get_current_profile_name() != "ci", reason="checks the CI profile")
def test_ci_profile_draws_the_same_examples_every_run() -> None:
    drawn: list[list[int]] = [[], []]
    for run in drawn:
        @settings(max_examples=7)
        @given(st.integers())
        def prop(value: int) -> None:
            run.append(value)  # noqa: B023 (each run's own list)

        prop()
    assert len(drawn[0]) == 7 and drawn[0] == drawn[1]
    assert settings.default.derandomize and settings.default.database is None


def test_fuzz_profile_draws_ten_times_each_tests_own_count(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_count.py").write_text(
        "from hypothesis import given, settings, strategies as st\n"
        "SEEN = []\n"
        "@settings(max_examples=3)\n@given(st.integers())\n"
        "def test_draw(v):\n    SEEN.append(v)\n"
        "def test_count():\n    print('COUNT', len(SEEN))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           "--hypothesis-profile=fuzz", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"COUNT {3 * FUZZ_FACTOR}" in done.stdout
