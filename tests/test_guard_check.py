"""The guard's cheap checks (``gradients_finite``, ``finite``) and ``RunningStats``' finite fast
path, over kinds of tensors, against numpy's ``isfinite`` and numpy statistics."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.diagnostics.statistics import RunningStats
from hookscope.train.guard import extremes_finite, finite, gradients_finite

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIAL = [float("nan"), float("inf"), float("-inf")]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of a float dtype and shape, values of a drawn scale (huge ones overflow a
    norm), with or without a NaN/+-Inf somewhere."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    big = 1e300 if dtype == torch.float64 else torch.finfo(dtype).max  # float64: sums stay finite
    scale = draw(st.sampled_from([1.0, 1e-3, big / 2, big]))
    values = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale
    tensor = values.to(dtype)
    if tensor.numel() and draw(st.booleans()):
        index = draw(st.integers(0, tensor.numel() - 1))
        tensor.view(-1)[index] = draw(st.sampled_from(SPECIAL))
    return tensor


def _numpy_finite(tensor: torch.Tensor) -> bool:
    return bool(np.isfinite(tensor.double().numpy()).all())


@given(tensors())
def test_finite_equals_numpy(tensor: torch.Tensor) -> None:
    assert finite(tensor) is _numpy_finite(tensor)


@given(st.lists(tensors(), min_size=0, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6))
def test_gradients_finite_equals_numpy_over_every_gradient(grads: list[torch.Tensor],
                                                          without: list[bool]) -> None:
    params = []
    for grad, none in zip(grads, without, strict=False):
        p = nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype))
        p.grad = None if none else grad
        params.append(p)
    expected = all(_numpy_finite(p.grad) for p in params if p.grad is not None)
    assert gradients_finite(params) is expected


def test_the_guard_stays_quiet_on_finite_gradients_whose_norm_overflows() -> None:
    """float32 gradients of 1e30: finite, but their squares (1e60) overflow the fused norm; the
    guard confirms tensor by tensor and lets the step go on."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hookscope.monitor(model, every=0, optimizer=optimizer) as mon:
            optimizer.zero_grad()
            (model(x).sum() * 1e30).backward()
            assert torch.isinf(torch.nn.utils.get_total_norm([model.weight.grad]))
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            optimizer.step()
    assert mon.events == []


@given(tensors(), st.sampled_from([None, 0, -1]))
def test_running_stats_equal_numpy_over_finite_and_nonfinite_kinds(tensor: torch.Tensor,
                                                                    channel_dim: int | None) -> None:
    assume(channel_dim is None or tensor.dim() > 0)  # per channel needs a dimension (else refused)
    running = RunningStats(channel_dim)
    running.update(tensor)
    values = tensor.double().numpy()
    channels = 1 if channel_dim is None else values.shape[channel_dim]
    rows = (values if channel_dim is None else np.moveaxis(values, channel_dim, 0)).reshape(
        channels, values.size // channels if channels else 0)
    got = running.as_dict()
    if channel_dim is not None:  # one entry a channel, none for none (a bug: reshape's -1)
        assert len(got["count"]) == channels
    with np.errstate(over="ignore"):  # numpy's std of values near float64's max overflows, as ours
        if channel_dim is None:
            got = {key: [value] for key, value in got.items()}
        for c, row in enumerate(rows):
            kept = row[np.isfinite(row)]
            count = row.size
            assert got["count"][c] == count
            if count:
                assert got["frac_zeros"][c] == np.mean(row == 0)
                assert got["frac_nonfinite"][c] == np.mean(~np.isfinite(row))
            else:
                assert np.isnan(got["frac_zeros"][c]) and np.isnan(got["frac_nonfinite"][c])
            if kept.size == 0:
                assert all(np.isnan(got[key][c]) for key in ("mean", "std", "min", "max"))
                continue
            assert got["min"][c] == kept.min() and got["max"][c] == kept.max()
            assert got["mean"][c] == pytest.approx(kept.mean(), rel=1e-12, abs=0)
            assert got["std"][c] == pytest.approx(kept.std(), rel=1e-9, abs=1e-300)


def test_extremes_finite_over_dtypes_and_devices_is_every_pair_finite() -> None:
    """One sync per device over all pairs (it was two per pair): True exactly when every low
    and high is finite, whatever their dtypes."""
    finite = [(torch.tensor(-1.0), torch.tensor(2.0)),
              (torch.tensor(0.5, dtype=torch.float16), torch.tensor(3.0, dtype=torch.bfloat16))]
    assert extremes_finite(finite) and extremes_finite([])
    for bad in (math.inf, -math.inf, math.nan):
        for at in range(4):
            pairs = [list(pair) for pair in finite]
            pairs[at // 2][at % 2] = torch.tensor(bad, dtype=pairs[at // 2][at % 2].dtype)
            assert not extremes_finite([(low, high) for low, high in pairs])
