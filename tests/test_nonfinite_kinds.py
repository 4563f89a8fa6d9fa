"""Every non-finite kind through the verbs that handle them: +Inf, -Inf and NaN in a forward
output (capture, stats, find_nonfinite, compare, extract) and NaN/Inf made only by a backward
(capture's gradients, find_nonfinite(backward=True)); each against plain PyTorch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from tests.reference import plain_capture

KINDS = {"+inf": math.inf, "-inf": -math.inf, "nan": math.nan}
ROWS, COLS = 3, 4


class Put(nn.Module):
    """Writes ``value`` at ``cells`` (``(row, column)``) of a copy of its input."""

    def __init__(self, value: float, cells: list[tuple[int, int]]) -> None:
        super().__init__()
        self.value, self.cells = value, cells

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        for row, col in self.cells:
            y[row, col] = self.value
        return y


def exact(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


CELLS = st.lists(st.tuples(st.integers(0, ROWS - 1), st.integers(0, COLS - 1)), min_size=1,
                 max_size=5, unique=True)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(list(KINDS)), cells=CELLS, seed=st.integers(0, 100))
def test_a_forward_kind_through_every_verb(kind: str, cells: list[tuple[int, int]], seed: int,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(COLS, COLS), Put(KINDS[kind], cells), nn.Linear(COLS, 2))
    x = torch.randn(ROWS, COLS)
    plain = plain_capture(model, ["1"], x, grad_enabled=True)["1"][0]
    counts = (int(plain.isnan().sum()), int(plain.isposinf().sum()), int(plain.isneginf().sum()))
    assert sum(counts) == len(cells)  # the premise

    with hookscope.capture(model, "1") as acts:
        model(x)
    exact(acts["1"], plain)

    stats = hookscope.stats(model, [x], "1")["1"]  # non-finite values: counted, left out
    finite = plain[plain.isfinite()].double()
    assert (int(stats.count), int(stats.nonfinite)) == (plain.numel(), len(cells))
    torch.testing.assert_close(stats.mean, finite.mean())
    assert (float(stats.min), float(stats.max)) == (float(finite.min()), float(finite.max()))

    found = hookscope.find_nonfinite(model, x)
    assert found is not None and (found.path, found.bad_count) == ("1", len(cells))
    summary = found.outputs[0]
    assert (summary.nan, summary.posinf, summary.neginf) == counts
    assert [tuple(c) for c in found.first_bad] == sorted(cells)
    assert found.inputs[0].nonfinite == 0

    clean = nn.Sequential(model[0], nn.Identity(), model[2])
    diff = hookscope.compare(model, clean, x, layers="1")["1"]
    assert diff.max_abs == math.inf and not diff.close  # documented: inf, never float's max
    same = hookscope.compare(model, model, x, layers="1")["1"]
    assert same.max_abs == 0.0 and same.close  # NaN equals NaN, inf equals inf

    store = hookscope.extract(model, [x], "1", tmp_path_factory.mktemp("nf") / "s", progress=False)
    exact(store["1"][:], plain)  # kept as they are: nothing of the user's is changed


class Sqrt(nn.Module):
    """``sqrt(x)`` for ``x >= 0``: finite forward; the derivative ``1 / (2 sqrt(0))`` is
    infinite at 0 (signed as the incoming gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()


class MaskedLog(nn.Module):
    """``where(x > 0, log(x), 0)``: finite forward; the masked-out ``log`` still gets a zero
    gradient, and ``0 * (1 / x)`` at ``x == 0`` is NaN in its backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x.log(), torch.zeros_like(x))


BACKWARD_KINDS = {"inf": Sqrt, "nan": MaskedLog}


@pytest.mark.parametrize("kind", list(BACKWARD_KINDS))
@settings(max_examples=6, deadline=None)
@given(zeros=st.lists(st.integers(0, COLS - 1), min_size=1, max_size=3, unique=True))
def test_a_kind_made_only_by_the_backward(kind: str, zeros: list[int]) -> None:
    model = nn.Sequential(nn.Linear(COLS, COLS), BACKWARD_KINDS[kind](), nn.Linear(COLS, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)
        model[0].bias[zeros] = 0.0  # the columns where the backward goes non-finite
    x = torch.randn(ROWS, COLS)

    hidden = model[0](x)
    out = model[1](hidden)
    (plain_grad,) = torch.autograd.grad(model[2](out).sum(), hidden)
    assert bool(out.isfinite().all()) and not bool(plain_grad.isfinite().all())  # the premise

    assert hookscope.find_nonfinite(model, x) is None  # the forward is finite
    found = hookscope.find_nonfinite(model, x, backward=True)
    assert found is not None and (found.path, found.phase) == ("1", "backward")
    bad = ~plain_grad.isfinite()
    assert found.bad_count == int(bad.sum()) == ROWS * len(zeros)
    summary = found.outputs[0]
    assert (summary.nan, summary.posinf, summary.neginf) == (
        int(plain_grad.isnan().sum()), int(plain_grad.isposinf().sum()),
        int(plain_grad.isneginf().sum()))

    with hookscope.capture(model, "0", grads=True) as acts:
        model(x).sum().backward()
    exact(acts.grad("0"), plain_grad)
    assert int(hookscope.stats(model, [x], "1")["1"].nonfinite) == 0


def test_extract_keeps_every_kind_on_disk(tmp_path: Path) -> None:
    """A store's rows are the forward's values, NaN and both infinities included (read back
    from the shard, not from memory)."""
    cells = [(0, 0), (1, 1), (2, 2)]
    model = nn.Sequential(nn.Identity(), Put(math.nan, cells[:1]))
    x = torch.randn(ROWS, COLS)
    x[1, 1], x[2, 2] = math.inf, -math.inf
    hookscope.extract(model, [x], "1", tmp_path / "s", progress=False)
    rows = hookscope.open_store(tmp_path / "s")["1"][:]
    want = x.clone()
    want[0, 0] = math.nan
    exact(rows, want)
