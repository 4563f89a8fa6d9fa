"""hookscope.probe: logistic probes per layer of a store, checked against scikit-learn's
LogisticRegression and on a planted signal; the control task (Hewitt and Liang 2019)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import hookscope
from hookscope.cli.main import main
from hookscope.errors import StoreError
from hookscope.store.probes import probe

sklearn_linear = pytest.importorskip("sklearn.linear_model")


class Pick(nn.Module):
    def __init__(self, first: int, stop: int) -> None:
        super().__init__()
        self.first, self.stop = first, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.first:self.stop] * 1.0


class Planted(nn.Module):
    """Column 0 of the input carries the label; 'noise_a' and 'noise_b' never see it."""

    def __init__(self) -> None:
        super().__init__()
        self.noise_a, self.carry, self.noise_b = Pick(1, 5), Pick(0, 5), Pick(5, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.noise_a(x), self.carry(x), self.noise_b(x)], 1)


def planted_store(tmp_path: Path, rows: int = 600, signal: float = 3.0, noise: float = 0.0,
                  classes: int = 2) -> tuple[hookscope.Store, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, classes, (rows,), generator=g)
    x = torch.randn(rows, 9, generator=g)
    x[:, 0] = signal * (y.double() - (classes - 1) / 2).float() + noise * torch.randn(rows, generator=g)
    store = hookscope.extract(Planted(), TensorDataset(x, y), ["noise_a", "carry", "noise_b"],
                              tmp_path / "store", batch_size=64, progress=False)
    return store, x, y


def test_planted_signal_is_found_at_its_layer_and_chance_elsewhere(tmp_path: Path) -> None:
    store, _, y = planted_store(tmp_path)
    result = probe(store, chunk=100)  # 480 training rows read 100 at a time
    assert [p.layer for p in result.layers] == ["noise_a", "carry", "noise_b"]
    assert (result.train_rows, result.test_rows) == (480, 120)
    assert result["carry"].accuracy == 1.0
    for layer in ("noise_a", "noise_b"):
        assert 0.35 <= result[layer].accuracy <= 0.65, result[layer]
    assert result["carry"].selectivity >= 0.35  # the control task is at chance on held-out rows
    assert 0.35 <= result["carry"].control_accuracy <= 0.65
    assert result["carry"].features == 5 and result.classes == [0, 1]


@pytest.mark.parametrize("classes", [2, 3])
def test_accuracy_equals_sklearn_within_one_point(tmp_path: Path, classes: int) -> None:
    from sklearn.preprocessing import StandardScaler
    store, x, y = planted_store(tmp_path, rows=500, signal=1.0, noise=1.0, classes=classes)
    result = probe(store, ["carry"], chunk=64, seed=3)
    order = torch.randperm(500, generator=torch.Generator().manual_seed(3))
    test, train = order[:100].sort().values, order[100:].sort().values
    features = x[:, 0:5].double().numpy()
    scaler = StandardScaler().fit(features[train])
    reference = sklearn_linear.LogisticRegression(C=1.0, max_iter=1000).fit(
        scaler.transform(features[train]), y[train].numpy())
    expected = reference.score(scaler.transform(features[test]), y[test].numpy())
    got = result["carry"].accuracy
    assert 1 / classes + 0.1 < expected < 0.95  # the premise: a layer neither trivial nor empty
    assert abs(got - expected) <= 0.01, (got, expected)


def test_control_types_share_a_label_and_bad_inputs_are_refused(tmp_path: Path) -> None:
    store, _, y = planted_store(tmp_path, rows=200)
    types = (torch.arange(200) % 4).tolist()  # 4 types: the control task is learnable only by type
    result = probe(store, ["noise_a"], control_types=types)
    assert result.layers[0].control_accuracy <= 1.0
    with pytest.raises(StoreError, match="3 labels for 200 rows"):
        probe(store, labels=[0, 1, 0])
    with pytest.raises(StoreError, match="has no layer|fixed-shape"):
        probe(store, ["nope"])


def test_cli_probe_prints_one_row_per_layer_and_draws(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    planted_store(tmp_path)
    assert main(["probe", str(tmp_path / "store"), "--plot", str(tmp_path / "probe.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["layer", "accuracy", "control", "selectivity", "train", "chance",
                                "features"]
    assert [line.split()[:2] for line in lines[1:]][1] == ["carry", "1"]
    assert (tmp_path / "probe.png").stat().st_size > 0
