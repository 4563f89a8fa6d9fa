"""Histograms: streamed with fixed edges, equal to torch.histc on the same values, in stats,
``hookscope stats --hist`` and the monitor's records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.cli.main import main
from hookscope.diagnostics.histogram import Histogram
from hookscope.diagnostics.statistics import stats
from hookscope.errors import ArgumentValueError, HookscopeError
from hookscope.train.report import draw_run
from tests.models import LeNet


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6), bins=st.integers(1, 40),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_streamed_counts_equal_histc_of_the_concatenation(sizes: list[int], bins: int, seed: int,
                                                          dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g, dtype=dtype) * 3 for n in sizes]
    whole = torch.cat(parts)
    lo, hi = -2.5, 4.0
    h = Histogram(bins, lo, hi)
    for part in parts:
        h.update(part)
    assert torch.equal(h.counts, torch.histc(whole, bins, lo, hi).long())
    assert h.below == int((whole < lo).sum()) and h.above == int((whole > hi).sum())
    assert int(h.counts.sum()) + h.below + h.above == whole.numel()


def test_nonfinite_are_counted_apart_and_edges_follow_histc() -> None:
    h = Histogram.spanning(4, 1.0, 1.0)  # one value: histc widens to [0, 2]
    h.update(torch.tensor([1.0, float("nan"), float("inf"), 2.0, 0.0, -0.5]))
    assert (h.lo, h.hi) == (0.0, 2.0)
    assert h.counts.tolist() == torch.histc(torch.tensor([1.0, 2.0, 0.0, -0.5]), 4, 0, 2).long().tolist()
    assert h.counts.tolist() == [1, 0, 1, 1] and (h.below, h.above, h.nonfinite) == (1, 0, 2)
    assert h.edges.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert (Histogram.spanning(3, float("inf"), float("-inf")).lo, Histogram.spanning(3, 0, 0).hi) == (-1, 1)
    with pytest.raises(ArgumentValueError, match="lo < hi"):
        Histogram(3, 2.0, 1.0)
    with pytest.raises(ArgumentValueError, match="bins"):
        Histogram(0, 0.0, 1.0)
    with pytest.raises(HookscopeError, match="same edges"):
        h.merge(Histogram(4, 0.0, 3.0))


def _outputs(model: nn.Module, batches: list[torch.Tensor], name: str) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = dict(model.named_modules())[name].register_forward_hook(
        lambda m, a, out: seen.append(out.detach().reshape(-1)))
    with torch.no_grad():
        for b in batches:
            model(b)
    handle.remove()
    return torch.cat(seen)


def test_stats_hist_two_passes_equal_histc_with_its_default_range() -> None:
    torch.manual_seed(0)
    model = LeNet().eval()
    batches = [torch.randn(n, 3, 32, 32) for n in (2, 3, 1)]
    result = stats(model, batches, layers=["conv2", "fc1"], hist=30)
    for name in ("conv2", "fc1"):
        values = _outputs(model, batches, name)
        h = result[name].histogram
        assert h is not None and (h.lo, h.hi) == (float(values.min()), float(values.max()))
        assert torch.equal(h.counts, torch.histc(values, 30).long())
        assert int(h.counts.sum()) == values.numel() == result[name].as_dict()["count"]
    plain = stats(model, batches, layers=["conv2", "fc1"])
    assert result["fc1"].as_dict() == plain["fc1"].as_dict() and plain["fc1"].histogram is None


def test_stats_hist_range_given_is_one_pass_and_counts_outside() -> None:
    torch.manual_seed(1)
    model = LeNet().eval()
    batches = [torch.randn(2, 3, 32, 32) for _ in range(3)]
    result = stats(model, iter(batches), layers="fc2", hist=8, hist_range=(-0.1, 0.1))
    values = _outputs(model, batches, "fc2")
    h = result["fc2"].histogram
    assert h is not None and torch.equal(h.counts, torch.histc(values, 8, -0.1, 0.1).long())
    assert (h.below, h.above) == (int((values < -0.1).sum()), int((values > 0.1).sum()))
    assert h.below + h.above > 0  # the premise: some values fall outside the range given


def test_stats_hist_arguments_are_checked_before_any_forward() -> None:
    model = LeNet()
    batches = [torch.randn(1, 3, 32, 32)]
    with pytest.raises(HookscopeError, match="one-pass iterator"):
        stats(model, iter(batches), hist=4)
    with pytest.raises(ArgumentValueError, match="without hist="):
        stats(model, batches, hist_range=(0, 1))
    with pytest.raises(ArgumentValueError, match="lo < hi"):
        stats(model, batches, hist=4, hist_range=(1, 1))


def test_cli_stats_hist_json_equals_histc(capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    assert main(["stats", "tests.models:LeNet", "--layers", "fc1", "--hist", "12", "--json",
                 "--input", "randn:2,3,32,32", "--input", "randn:1,3,32,32",
                 "--batch-size", "1"]) == 0
    data = json.loads(capsys.readouterr().out)["fc1"]["histogram"]
    torch.manual_seed(0)
    from hookscope.zoo.inputs import load_inputs
    from hookscope.zoo.models import load_model
    loaded = load_model("tests.models:LeNet")
    batches = [load_inputs([s], loaded).args[0] for s in ("randn:2,3,32,32", "randn:1,3,32,32")]
    values = _outputs(loaded.module, batches, "fc1")
    assert data["counts"] == torch.histc(values, 12).long().tolist()
    assert (data["lo"], data["hi"], data["below"], data["above"]) == (
        float(values.min()), float(values.max()), 0, 0)
    assert main(["stats", "tests.models:LeNet", "--layers", "fc1", "--hist", "5", "--hist-range",
                 "-1", "1", "--input", "randn:2,3,32,32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:5] == ["path", "lo", "hi", "below", "above"]
    assert lines[3].split()[:5] == ["fc1", "-1", "1", "0", "0"] and len(lines[3].split()[5]) == 5


def test_monitor_records_a_histogram_with_edges_fixed_at_the_first_sample(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(16, 4) * (1 + step) for step in range(4)]
    seen: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with hookscope.monitor(model, ["0"], every=2, optimizer=optimizer, run_dir=tmp_path,
                           hist=10) as mon:
        for x in xs:
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
    handle.remove()
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    hists = [r["activation_hist"] for r in records if r.get("module") == "0"]
    assert [r["step"] for r in records if r.get("module") == "0"] == [0, 2]
    lo, hi = float(seen[0].min()), float(seen[0].max())
    for h, values in zip(hists, (seen[0], seen[2]), strict=True):
        assert (h["lo"], h["hi"]) == (lo, hi)  # fixed at step 0's first call
        assert h["counts"] == torch.histc(values, 10, lo, hi).long().tolist()
        assert (h["below"], h["above"]) == (int((values < lo).sum()), int((values > hi).sum()))
    assert hists[1]["below"] + hists[1]["above"] > 0  # step 2's inputs are 3x wider
    assert mon.latest["0"]["activation_hist"] == hists[1]
    assert draw_run(tmp_path).exists()
