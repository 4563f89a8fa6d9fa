"""Parameters first: a module's own NaN/Inf parameter or buffer is named before its output, by
find_nonfinite, replay and the guard; guard="warn" writes one bundle per new finding."""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

import hookscope
from hookscope.diagnostics.nonfinite import find_nonfinite


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 8), act=nn.Tanh(), fc2=nn.Linear(8, 2)))


def test_a_nan_weight_is_named_with_its_count_before_the_output() -> None:
    model = mlp()
    with torch.no_grad():
        model.fc1.weight[0, :3] = float("nan")
    found = find_nonfinite(model, torch.randn(5, 4))
    assert found is not None
    assert (found.path, found.phase, found.op) == ("fc1", "forward", "linear")
    assert found.parameter_names == ["fc1.weight"]
    (weight,) = found.parameters
    assert (weight.label, weight.shape, weight.nan, weight.posinf, weight.neginf) == (
        "weight", (8, 4), 3, 0, 0)
    assert found.bad_count == 5  # row 0 of the weight: output column 0 of each of 5 rows
    text = str(found).splitlines()
    assert text[0] == ("non-finite parameter: weight of 'fc1' holds 3 NaN (Linear); "
                       "it made the output below")
    assert text[1].startswith("  param weight: [8, 4] float32")
    assert text[2].startswith("first non-finite output: 'fc1' (Linear)")


def test_an_inf_buffer_and_a_nan_bias_are_both_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).eval()
    with torch.no_grad():
        model[1].running_var[1] = float("inf")  # var inf: x / sqrt(inf) = 0, finite: not the cause
        model[1].running_mean[2] = float("-inf")  # x - (-inf) = +inf: the output is not finite
        model[1].bias[0] = float("nan")
    found = find_nonfinite(model, torch.randn(4, 3))
    assert found is not None and found.path == "1"
    assert found.parameter_names == ["1.bias", "1.running_mean", "1.running_var"]
    counts = [(s.nan, s.posinf, s.neginf) for s in found.parameters]
    assert counts == [(1, 0, 0), (0, 0, 1), (0, 1, 0)]
    assert str(found).splitlines()[0] == (
        "non-finite parameter: bias of '1' holds 1 NaN; running_mean of '1' holds 1 -Inf; "
        "running_var of '1' holds 1 +Inf (BatchNorm1d); it made the output below")


def test_finite_parameters_leave_the_origin_as_before() -> None:
    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Log())
    found = find_nonfinite(model, torch.randn(6, 4))
    assert found is not None and (found.path, found.parameters) == ("1", ())
    assert str(found).startswith("first non-finite output: '1' (Log)")


def test_a_nan_in_the_parent_weight_not_the_child_names_the_child_that_holds_it() -> None:
    """Only the module's own tensors (recurse=False) are named: the root holds none."""
    model = mlp()
    with torch.no_grad():
        model.fc2.bias[1] = float("nan")
    found = find_nonfinite(model, torch.randn(2, 4))
    assert found is not None and found.path == "fc2" and found.parameter_names == ["fc2.bias"]
    assert found.bad_count == 2


def test_guard_warn_writes_one_bundle_per_new_finding_over_23_steps(tmp_path: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookscope.monitor(model, every=0, optimizer=optimizer, run_dir=tmp_path,
                               guard="warn") as mon:
            for step in range(23):
                if step == 3:
                    with torch.no_grad():
                        model.fc1.weight[0, :3] = float("nan")
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
    fired = [w for w in caught if w.category is hookscope.NonFiniteStepWarning]
    assert len(fired) == 1  # 20 steps fired (3..22), one finding
    assert "non-finite parameter: weight of 'fc1' holds 3 NaN (Linear)" in str(fired[0].message)
    bundles = sorted(p.name for p in tmp_path.glob("nonfinite-step-*.safetensors"))
    assert bundles == ["nonfinite-step-3.safetensors"]
    assert [e["step"] for e in mon.events] == list(range(3, 23))
    first, *later = mon.events
    assert (first["module"], first["direction"], first["op"], first["parameters"]) == (
        "fc1", "forward", "linear", ["fc1.weight"])
    assert first["bundle"] == str(tmp_path / "nonfinite-step-3.safetensors") and "same_as_step" not in first
    assert all(e["same_as_step"] == 3 and e["bundle"] is None and e["module"] == "fc1"
               for e in later)
    assert later[0]["parameters"] == ["fc1.weight", "fc1.bias"]  # step 3's update spread the NaN
    written = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r for r in written if r["event"] == "nonfinite"] == mon.events
    again = hookscope.replay(tmp_path / "nonfinite-step-3.safetensors", mlp())
    assert again is not None and again.parameter_names == ["fc1.weight"]
    assert again.parameters[0].nan == 3


def test_a_second_different_finding_gets_its_own_bundle(tmp_path: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # "skip": no update spreads the NaN, the weights stay as injected
        with hookscope.monitor(model, every=0, optimizer=optimizer, run_dir=tmp_path,
                               guard="skip") as mon:
            for step in range(6):
                with torch.no_grad():
                    if step == 1:
                        model.fc2.bias[0] = float("nan")
                    if step == 4:
                        model.fc1.bias[0] = float("inf")
                optimizer.zero_grad()
                model(x).square().sum().backward()
                optimizer.step()
    assert len([w for w in caught if w.category is hookscope.NonFiniteStepWarning]) == 2
    assert sorted(p.name for p in tmp_path.glob("nonfinite-step-*.safetensors")) == [
        "nonfinite-step-1.safetensors", "nonfinite-step-4.safetensors"]
    assert [(e["step"], e["module"], e.get("same_as_step")) for e in mon.events] == [
        (1, "fc2", None), (2, "fc2", 1), (3, "fc2", 1), (4, "fc1", None), (5, "fc1", 4)]
