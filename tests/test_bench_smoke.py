"""Smoke test of the benchmark runner (bench/): it runs end to end on tiny models, without peers.

Nothing here is timed; the figures only have to exist and be consistent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench_main(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.__main__ import main

    return main


def test_quick_run_writes_results_and_catches_in_place_overwrites(bench_main, tmp_path):
    threads = torch.get_num_threads()
    rc = bench_main(["--quick", "--in-process", "--no-peers", "--threads", "1",
                     "--only", "resnet", "dispatch", "--out", str(tmp_path)])

    assert rc == 0
    assert torch.get_num_threads() == threads
    results = json.loads((tmp_path / "results.json").read_text())
    [resnet] = results["workloads"]

    def case(prefix: str) -> dict:
        [found] = [c for c in resnet["cases"] if c["name"].startswith(prefix)]
        return found

    assert all(len(case["times_s"]) == 3 and case["ratio"] > 0 for case in resnet["cases"])
    assert resnet["cases"][0]["name"] == "bare forward"
    # ReLU(inplace=True) and += overwrite what plain detach() hooks kept; hookscope's values are right
    plain, ours = case("plain hooks detach(), every"), case("hookscope, every module (")
    assert plain["values"]["wrong"] > 0
    assert ours["values"] == {"checked": plain["values"]["checked"], "wrong": 0, "refused": 0}
    assert case("hookscope, every module, first capture")["values"] == ours["values"]
    assert case("plain hooks clone(), every")["values"]["wrong"] == 0
    # float16 keeps half the bytes of one float32 copy per output
    copies, half = case("plain hooks clone(), every"), case("hookscope dtype=float16, every")
    assert half["tensor_mib"] == pytest.approx(copies["tensor_mib"] / 2)
    assert all("rss_peak_mib" in case["memory"] for case in resnet["cases"])
    dispatch = results["dispatch"]
    assert set(dispatch["per_call_us"]) == {"bare hook, steady", "hookscope, steady",
                                            "bare hook, per capture", "hookscope, per capture"}
    # a ratio of two small timing differences: its sign is noise on a busy machine (a quick run
    # measured -0.11 under load), so the smoke test checks that it was computed, not its value
    assert math.isfinite(dispatch["ratio_steady"])
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| bare forward |" in text and "## Per-call dispatch" in text
    assert "per-call dispatch <= 1.15x a bare hook" in text
    assert "| CNN every module <= 1.05x plain detach hooks |" in text
    assert "| CNN first capture within 1.05x of later captures |" in text
