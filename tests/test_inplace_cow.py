"""In-place writes after capture: copy-on-write, exact in every grad mode, from the first capture."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope

GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext}


class ClampAfter(nn.Module):
    """``lin``'s output is clamped in place by the parent: a write that changes values only when
    some value is above ``limit``."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.clamp_(max=self.limit)
        h += 1
        return h * 2


@pytest.mark.parametrize("mode", GRAD_MODES)
def test_clamp_that_changes_nothing_first_and_something_later_is_exact(mode: str) -> None:
    torch.manual_seed(0)
    model = ClampAfter(limit=1e6)
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    small, large = torch.full((2, 4), 0.5), torch.full((2, 4), 3.0)
    model.limit = 1.0  # the first batch clips nothing, the second clips everything
    with GRAD_MODES[mode](), hookscope.capture(model, "lin") as acts:
        out_small = model(small)
        out_large = model(large)
    assert torch.equal(acts["lin", 0], small) and torch.equal(acts["lin", 1], large)
    assert torch.equal(out_small.detach(), (small + 1) * 2)
    assert torch.equal(out_large.detach(), torch.full((2, 4), 4.0))  # the model saw its own write
    for batch in (large, small):  # a new capture, batches the other way round
        with GRAD_MODES[mode](), hookscope.capture(model, "lin") as again:
            model(batch)
        assert torch.equal(again["lin"], batch)


@pytest.mark.parametrize("mode", GRAD_MODES)
def test_only_written_tensors_are_copied(mode: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Tanh())
    live: dict[str, torch.Tensor] = {}
    handles = [model[i].register_forward_hook(
        lambda m, a, o, i=i: live.__setitem__(str(i), o)) for i in (0, 2)]
    try:
        with GRAD_MODES[mode](), hookscope.capture(model, "0", "2") as acts:
            model(torch.randn(3, 4))
    finally:
        for handle in handles:
            handle.remove()
    # '0' was written by the in-place ReLU: the writer got its own copy, the record kept the
    # value; '2' was only read: it still shares memory with what the model made
    assert not torch._C._is_cow_tensor(live["0"]) and torch._C._is_cow_tensor(live["2"])
    assert bool((acts["0"] < 0).any()) and torch.equal(live["0"], acts["0"].clamp(min=0))
    assert torch.equal(acts["2"], live["2"].detach())


def test_first_capture_copies_nothing_that_is_not_written() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    seen: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        with torch.inference_mode(), hookscope.capture(model, "0") as acts:
            model(torch.randn(2, 4))
    finally:
        handle.remove()
    assert torch._C._is_cow_tensor(seen[0]) and torch._C._is_cow_tensor(acts["0"])


def test_two_models_never_influence_each_other() -> None:
    torch.manual_seed(3)
    writes = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    reads = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(5, 4)
    with torch.inference_mode():
        expected = writes[0](x).clone(), reads[0](x).clone()
        for order in ((writes, reads), (reads, writes)):
            for model in order:
                with hookscope.capture(model, "0") as acts:
                    model(x)
                assert torch.equal(acts["0"], expected[0 if model is writes else 1])


def test_clone_true_copies_at_once_and_clone_false_keeps_references() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    seen: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        with torch.no_grad():
            with hookscope.capture(model, "0", clone=True) as copied:
                model(torch.randn(2, 4))
            with hookscope.capture(model, "0", clone=False) as referenced:
                model(torch.randn(2, 4))
    finally:
        handle.remove()
    assert copied["0"].data_ptr() != seen[0].data_ptr() and not torch._C._is_cow_tensor(copied["0"])
    assert referenced["0"].data_ptr() == seen[1].data_ptr()


class Writer(nn.Module):
    """Writes the output of ``lin`` in place ``how`` after it returns."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.how == "setitem":
            h[0] = 7.0
        elif self.how == "view":
            h.view(-1)[:2].mul_(3)
        elif self.how == "out":
            torch.add(h.detach(), 1, out=h.detach())  # out= refuses tensors that need grad
        elif self.how == "functional":
            torch.nn.functional.relu(h, inplace=True)
        elif self.how == "iadd":
            h += x
        elif self.how == "copy":
            h.copy_(x)
        elif self.how == "index":
            h.index_fill_(1, torch.tensor([0]), -1.0)
        return h


@settings(max_examples=30, deadline=None)
@given(how=st.sampled_from(["setitem", "view", "out", "functional", "iadd", "copy", "index"]),
       mode=st.sampled_from(list(GRAD_MODES)), rows=st.integers(1, 4))
def test_every_kind_of_in_place_write_leaves_the_record_exact(how: str, mode: str, rows: int) -> None:
    model = Writer(how)
    x = torch.randn(rows, 3)
    with GRAD_MODES[mode]():
        expected = model.lin(x).detach().clone()
        with hookscope.capture(model, "lin") as acts:
            out = model(x)
    assert torch.equal(acts["lin"], expected)
    assert not torch.equal(out.detach(), expected) or how == "functional"
