"""A NaN/Inf already in the model's input is the origin: ``find_nonfinite`` forward and
backward, ``hookscope nan`` and the training guard all name the input and the index."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.cli.main import main
from hookscope.diagnostics.nonfinite import find_nonfinite

VALUES = st.sampled_from([math.nan, math.inf, -math.inf])
CELLS = st.tuples(st.integers(0, 1), st.integers(0, 7))


def mlp() -> nn.Sequential:
    """The trial's model: its output is all NaN when one input cell is."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))


class KeywordAndTuple(nn.Module):
    """``forward(x, pair, *, bias)``: every input reaches the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], *,
                bias: torch.Tensor) -> torch.Tensor:
        return self.lin(x + pair[0] * pair[1] + bias)


def _inputs(where: str, cell: tuple[int, int], value: float) -> tuple[tuple, dict, str]:
    tensors = [torch.rand(2, 8) for _ in range(4)]
    index = {"args": 0, "tuple": 2, "kwarg": 3}[where]
    tensors[index][cell] = value
    label = {"args": "args[0]", "tuple": "args[1][1]", "kwarg": "kwargs['bias']"}[where]
    return (tensors[0], (tensors[1], tensors[2])), {"bias": tensors[3]}, label


@settings(max_examples=12, deadline=None)
@given(where=st.sampled_from(["args", "tuple", "kwarg"]), cell=CELLS, value=VALUES,
       backward=st.booleans())
def test_a_nonfinite_input_is_the_origin(where: str, cell: tuple[int, int], value: float,
                                         backward: bool) -> None:
    args, kwargs, label = _inputs(where, cell, value)
    model = KeywordAndTuple()
    assert not torch.isfinite(model(*args, **kwargs)).all()  # the model does spread it
    found = find_nonfinite(model, *args, backward=backward, **kwargs)
    assert found is not None
    assert (found.path, found.phase, found.bad_label, found.first_bad) == (
        "<input>", "forward", label, (cell,))
    summary = found.outputs[0]
    assert (summary.nan, summary.posinf, summary.neginf) == (
        int(math.isnan(value)), int(value == math.inf), int(value == -math.inf))
    assert str(found).startswith(f"the model's input is already non-finite: 1 NaN/Inf in {label}, "
                                 f"first at {list(cell)}")
    assert not model.lin._forward_hooks and not model.lin._forward_pre_hooks


def test_a_finite_input_still_finds_the_module() -> None:
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = math.inf  # finite input, the last Linear makes the Inf
    found = find_nonfinite(model, torch.rand(2, 8) + 1)
    assert found is not None and (found.path, found.op) == ("2", "linear")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cell=CELLS, value=VALUES)
def test_cli_nan_names_the_input_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            cell: tuple[int, int], value: float) -> None:
    x = torch.rand(2, 8)
    x[cell] = value
    torch.save(x, tmp_path / "x.pt")
    for extra in ([], ["--backward"]):
        code = main(["nan", "tests.test_nonfinite_inputs:mlp", "--input", str(tmp_path / "x.pt"),
                     *extra])
        out, err = capsys.readouterr()
        assert code == 1
        assert out.startswith("the model's input is already non-finite: 1 NaN/Inf in args[0], "
                              f"first at {list(cell)}")
        assert err.endswith("non-finite values start in the input args[0]\n")


def test_guard_says_the_batch_input_is_nonfinite(tmp_path: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(hookscope.NonFiniteStepError) as caught:
        with hookscope.monitor(model, ["0"], every=1, optimizer=optimizer, run_dir=tmp_path):
            for step in range(4):
                x = torch.rand(4, 8)
                if step == 2:
                    x[1, 5] = math.nan
                optimizer.zero_grad()
                model(x).pow(2).mean().backward()
                optimizer.step()
    message = str(caught.value)
    assert message.startswith("step 2: the model's input is already non-finite: 1 NaN/Inf in "
                              "args[0], first at [1, 5]")
    assert "<loss>" not in message
    assert (caught.value.origin.path, caught.value.step) == ("<input>", 2)  # type: ignore[attr-defined]


def test_monitor_report_names_the_input_and_prints_no_op_when_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    test_guard_says_the_batch_input_is_nonfinite(tmp_path)
    records = tmp_path / "records.jsonl"
    event = json.loads(records.read_text().splitlines()[-1])
    assert (event["module"], event["tensor"], event["op"]) == ("<input>", "args[0]", None)
    plain = {**event, "module": "2", "class": "Linear", "call": 0, "direction": "forward",
             "tensor": "output"}  # a module finding whose op is not known
    with records.open("a") as file:
        file.write(json.dumps(plain) + "\n")
    assert main(["monitor-report", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[:2] == [
        "step 2 (rank 0): the batch input args[0] is already non-finite (no module made it)",
        "step 2 (rank 0): non-finite forward in '2' (Linear), call 0, output"]


class AdditiveMask(nn.Module):
    """Attention scores plus an additive mask whose ``-inf`` hides the padded keys."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.score(x) + mask, dim=-1)


@pytest.mark.parametrize("backward", [False, True])
def test_an_inf_input_the_model_consumes_is_not_an_origin(backward: bool) -> None:
    torch.manual_seed(0)
    model, x = AdditiveMask(), torch.randn(2, 3, 4)
    mask = torch.zeros(2, 1, 4)
    mask[:, :, 3] = -math.inf  # key 3 is padding in every row
    assert torch.isfinite(model(x, mask)).all()  # plain PyTorch: nothing non-finite comes out
    assert find_nonfinite(model, x, mask, backward=backward) is None
    mask[0, 0, :] = -math.inf  # row 0 hides every key: softmax gives NaN, and the mask did it
    found = find_nonfinite(model, x, mask)
    assert found is not None and found.path == "<input>" and found.bad_label == "args[1]"
