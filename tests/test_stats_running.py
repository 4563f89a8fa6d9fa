"""RunningStats against numpy over the concatenated data, and merge against one pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hookscope.diagnostics.statistics import RunningStats
from hookscope.errors import HookscopeError


def _batches(seed: int = 0, n: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(4, 3, 5, 5, generator=gen) * 3.0 + 2.0 for _ in range(n)]
    batches[1][0, 0, 0, 0] = float("nan")
    batches[2][1, 2, 3, 4] = float("inf")
    batches[2][0, 1, 0, 0] = float("-inf")
    batches[3][:, 1] = torch.relu(batches[3][:, 1] - 2.0)  # many exact zeros in channel 1
    return batches


def _numpy_reference(values: np.ndarray) -> dict[str, float]:
    finite = values[np.isfinite(values)]
    return {"count": values.size, "mean": finite.mean(), "std": finite.std(), "min": finite.min(),
            "max": finite.max(), "frac_zeros": np.mean(values == 0),
            "frac_nonfinite": np.mean(~np.isfinite(values))}


def test_whole_tensor_statistics_match_numpy_over_concatenated_batches() -> None:
    batches = _batches()
    running = RunningStats()
    for batch in batches:
        running.update(batch)
    concatenated = np.concatenate([b.double().numpy().ravel() for b in batches])
    expected = _numpy_reference(concatenated)
    got = running.as_dict()
    assert got["count"] == 6 * 4 * 3 * 5 * 5 and int(running.nonfinite) == 3
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=0), key


@pytest.mark.parametrize("channel_dim", [1, -1])
def test_per_channel_statistics_match_numpy(channel_dim: int) -> None:
    batches = _batches(seed=1)
    running = RunningStats(channel_dim=channel_dim)
    for batch in batches:
        running.update(batch)
    stacked = np.concatenate([b.double().numpy() for b in batches])  # (24, 3, 5, 5)
    rows = np.moveaxis(stacked, channel_dim, 0).reshape(stacked.shape[channel_dim], -1)
    got = running.as_dict()
    assert len(got["mean"]) == rows.shape[0]
    for c, row in enumerate(rows):
        for key, value in _numpy_reference(row).items():
            assert got[key][c] == pytest.approx(value, rel=1e-9, abs=0), (key, c)


def test_merge_equals_one_pass() -> None:
    batches = _batches(seed=2)
    one_pass, left, right = RunningStats(1), RunningStats(1), RunningStats(1)
    for i, batch in enumerate(batches):
        one_pass.update(batch)
        (left if i < 2 else right).update(batch)
    merged = left.merge(right).as_dict()
    expected = one_pass.as_dict()
    assert merged["count"] == expected["count"]
    for key in ("mean", "std", "min", "max", "frac_zeros", "frac_nonfinite"):
        np.testing.assert_allclose(merged[key], expected[key], rtol=1e-12)


def test_stable_for_large_offset_small_spread() -> None:
    # Naive sum-of-squares in float64 loses every digit here (1e9**2 = 1e18 >> 2**53).
    gen = torch.Generator().manual_seed(3)
    batches = [1e9 + torch.randn(1000, generator=gen, dtype=torch.float64) for _ in range(20)]
    running = RunningStats()
    for batch in batches:
        running.update(batch)
    values = torch.cat(batches).numpy()
    assert running.as_dict()["std"] == pytest.approx(values.std(), rel=1e-9)
    assert running.as_dict()["mean"] == pytest.approx(values.mean(), rel=1e-15)


def test_all_non_finite_gives_nan_statistics_but_counts() -> None:
    running = RunningStats()
    running.update(torch.tensor([float("nan"), float("inf")]))
    got = running.as_dict()
    assert got["count"] == 2 and got["frac_nonfinite"] == 1.0
    assert all(np.isnan(got[k]) for k in ("mean", "std", "min", "max"))


def test_integer_tensors_are_counted_as_numbers() -> None:
    running = RunningStats()
    running.update(torch.tensor([0, 2, 4]))
    assert running.as_dict() == {"count": 3, "mean": 2.0, "std": pytest.approx(np.std([0, 2, 4])),
                                 "min": 0.0, "max": 4.0, "frac_zeros": pytest.approx(1 / 3),
                                 "frac_nonfinite": 0.0}


def test_channel_count_change_is_an_error() -> None:
    running = RunningStats(channel_dim=1)
    running.update(torch.zeros(2, 3))
    with pytest.raises(HookscopeError, match="cannot merge statistics over 4 channels into "
                                             "statistics over 3 channels"):
        running.update(torch.zeros(2, 4))


def test_missing_channel_dimension_says_which_to_pass() -> None:
    with pytest.raises(HookscopeError, match=r"pass per_channel=<the channel dimension>"):
        RunningStats(channel_dim=2).update(torch.zeros(4, 3))


def test_complex_tensor_is_refused_with_fix() -> None:
    with pytest.raises(HookscopeError, match=r"pass its \.real or \.abs\(\)"):
        RunningStats().update(torch.zeros(3, dtype=torch.complex64))


def test_public_names() -> None:
    import hookscope
    from hookscope.diagnostics.comparison import compare
    from hookscope.diagnostics.nonfinite import find_nonfinite
    from hookscope.diagnostics.statistics import stats

    assert (hookscope.stats, hookscope.compare, hookscope.find_nonfinite) == (stats, compare,
                                                                              find_nonfinite)
    assert hookscope.RunningStats is RunningStats
