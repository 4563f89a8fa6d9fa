"""early_stop=True: the forward stops once every selected module has returned; records equal a
full run's; hooks removed; the model untouched; nothing blamed for modules skipped by the stop."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.cli.main import main
from hookscope.engine.early_stop import EarlyStop, StopForward


class Counted(nn.Sequential):
    """Six Linear(6, 6)+ReLU layers; ``ran`` lists the layers that ran, in order."""

    def __init__(self) -> None:
        super().__init__(*[nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(6)])
        self.ran: list[int] = []
        for i, layer in enumerate(self):
            layer.forward = self._counting(i, layer.forward)  # type: ignore[method-assign]

    def _counting(self, i: int, forward: object) -> object:
        def counted(x: torch.Tensor) -> torch.Tensor:
            self.ran.append(i)
            return forward(x)  # type: ignore[operator]
        return counted


def test_capture_stops_after_the_last_selected_module() -> None:
    model, x = Counted(), torch.randn(3, 6)
    with hookscope.capture(model, "1", "3.0") as full:
        expected = model(x)
    model.ran.clear()
    after_forward = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unfired warning for the layers skipped
        with hookscope.capture(model, "1", "3.0", early_stop=True) as acts:
            model(x)
            after_forward.append(1)  # not reached: the block ends at the stop
    assert model.ran == [0, 1, 2, 3]  # layers 4 and 5 never ran
    assert after_forward == []
    assert acts.counts == {"1": 1, "3.0": 1} and acts.unfired == {}
    torch.testing.assert_close(acts["1"], full["1"], rtol=0, atol=0)
    torch.testing.assert_close(acts["3.0"], full["3.0"], rtol=0, atol=0)
    model.ran.clear()
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # model untouched, runs whole
    assert model.ran == list(range(6))


def test_run_returns_none_and_edits_skipped_by_the_stop_are_not_blamed() -> None:
    model, x = Counted(), torch.randn(2, 6)
    output, acts = hookscope.run(model, x, layers="0", options={"early_stop": True})
    assert output is None and acts["0"].shape == (2, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hookscope.steer(model, {"5": torch.ones(6)}) as edit, \
                hookscope.capture(model, "2", early_stop=True):
            model(x)
    assert edit.counts == {"5": 0}
    assert "stopped early" in edit.unfired["5"]


def test_errors_and_other_exceptions_pass_through() -> None:
    model = Counted()
    with pytest.raises(hookscope.CaptureError, match="drop early_stop to record gradients"):
        hookscope.capture(model, "2", grads=True, early_stop=True)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        with hookscope.capture(model, "2", early_stop=True):
            model(torch.randn(2, 5))


def test_stats_and_extract_with_early_stop_equal_the_full_run(tmp_path: Path) -> None:
    model = Counted()
    batches = [torch.randn(4, 6) for _ in range(3)]
    full = hookscope.stats(model, batches, "1")
    model.ran.clear()
    stopped = hookscope.stats(model, batches, "1", early_stop=True)
    assert model.ran == [0, 1] * 3
    assert stopped["1"].as_dict() == full["1"].as_dict()
    data = torch.utils.data.TensorDataset(torch.cat(batches))
    whole = hookscope.extract(model, data, "2", tmp_path / "whole", batch_size=4, progress=False)
    model.ran.clear()
    early = hookscope.extract(model, data, "2", tmp_path / "early", batch_size=4, progress=False,
                              early_stop=True)
    assert model.ran == [0, 1, 2] * 3
    torch.testing.assert_close(early["2"][:], whole["2"][:], rtol=0, atol=0)


def test_cli_capture_early_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "efficientnet-lite0", "--input", "sample:chelsea", "--layers",
                 "_blocks.0", "--early-stop", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prediction"] == {"task": "none"}  # the head never ran: no classes to print
    assert [(r["path"], r["shape"]) for r in out["records"]] == [("_blocks.0", [1, 16, 112, 112])]


def test_cli_stats_and_extract_early_stop_equal_the_full_run(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    stops: list[int] = []  # passes cut short, counted where the stop is raised
    returned = EarlyStop._returned

    def counting(self: EarlyStop, module: nn.Module, args: object, output: object) -> None:
        try:
            returned(self, module, args, output)
        except StopForward:
            stops.append(1)
            raise
    monkeypatch.setattr(EarlyStop, "_returned", counting)
    common = ["tests.models:LeNet", "--layers", "conv1", "--input", "randn:3,3,32,32", "--json"]
    torch.manual_seed(0)
    assert main(["stats", *common]) == 0
    full = json.loads(capsys.readouterr().out)
    assert stops == []
    torch.manual_seed(0)
    assert main(["stats", *common, "--early-stop"]) == 0
    assert json.loads(capsys.readouterr().out) == full
    assert stops == [1]
    data = tmp_path / "images.pt"
    torch.save(torch.randn(4, 3, 32, 32), data)
    for name, flags in (("whole", []), ("early", ["--early-stop"])):
        torch.manual_seed(0)  # the same LeNet weights for both runs
        assert main(["extract", "tests.models:LeNet", "--data", str(data), "--layers", "conv1",
                     "--out", str(tmp_path / name), "--no-progress", *flags]) == 0
    capsys.readouterr()
    assert stops == [1, 1]  # one batch of 4 images, stopped once
    whole, early = hookscope.open_store(tmp_path / "whole"), hookscope.open_store(tmp_path / "early")
    torch.testing.assert_close(early["conv1"][:], whole["conv1"][:], rtol=0, atol=0)


def test_a_capture_open_across_passes_stops_each_one_at_its_boundary() -> None:
    model, xs = Counted(), [torch.randn(2, 6) for _ in range(3)]
    with hookscope.capture(model, "1", early_stop=True) as acts:
        for x in xs:
            with acts.forward_boundary():
                model(x)
    assert model.ran == [0, 1] * 3
    assert acts.counts == {"1": 3} and acts.unfired == {}
    for k, x in enumerate(xs):
        torch.testing.assert_close(acts["1", k], model[1](model[0](x)), rtol=0, atol=0)
