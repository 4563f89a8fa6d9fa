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


class Lookup(nn.Module):
    """A token's activation: its embedding plus a jitter by position (two tokens of one id
    differ), or (``noise``) fresh noise that never sees the token."""

    def __init__(self, seed: int, noise: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.noise, self.g = noise, g
        self.register_buffer("table", torch.randn(30, 6, generator=g))
        self.register_buffer("jitter", 0.5 * torch.randn(16, 6, generator=g))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.noise:
            return torch.randn(*ids.shape, 6, generator=self.g)
        return self.table[ids] + self.jitter[: ids.shape[1]]


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.carry, self.noise = Lookup(0), Lookup(1, noise=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.carry(input_ids) + self.noise(input_ids)


def token_store(tmp_path: Path) -> hookscope.Store:
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(12):
        ids = torch.randint(1, 30, (4, 16), generator=g)
        mask = (torch.arange(16) < torch.randint(6, 17, (4, 1), generator=g)).long()
        batches.append({"input_ids": ids * mask, "attention_mask": mask})
    return hookscope.extract(TokenModel(), batches, ["carry", "noise"], tmp_path / "tokens",
                             progress=False)


def test_token_view_probe_planted_signal(tmp_path: Path) -> None:
    """A label carried by feature 0 of each token of 'carry' is read at 1.0 there, at chance from
    'noise'; the examples are the tokens of the token view (padding never stored)."""
    store = token_store(tmp_path)
    view = store.tokens("carry")
    labels = (view[0:len(view)][:, 0] > 0).long()
    result = probe(store, labels=labels, tokens=True, chunk=100)
    assert [p.layer for p in result.layers] == ["carry", "noise"]
    assert result.train_rows + result.test_rows == len(view) == int(view.rows.bincount().sum())
    assert result["carry"].accuracy >= 0.98 and result["carry"].features == 6
    assert 0.35 <= result["noise"].accuracy <= 0.65


def test_token_view_probe_equals_sklearn_within_one_point(tmp_path: Path) -> None:
    from sklearn.preprocessing import StandardScaler
    store = token_store(tmp_path)
    features = store.tokens("carry")[0:len(store.tokens("carry"))].double()
    g = torch.Generator().manual_seed(5)
    labels = (features[:, 0] + features[:, 1] + 1.2 * torch.randn(len(features), generator=g,
                                                                   dtype=torch.float64) > 0).long()
    result = probe(store, ["carry"], labels=labels, tokens=True, chunk=64, seed=3)
    n = len(features)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    test, train = order[:round(n * 0.2)].sort().values, order[round(n * 0.2):].sort().values
    scaler = StandardScaler().fit(features[train].numpy())
    reference = sklearn_linear.LogisticRegression(C=1.0, max_iter=1000).fit(
        scaler.transform(features[train].numpy()), labels[train].numpy())
    expected = reference.score(scaler.transform(features[test].numpy()), labels[test].numpy())
    assert 0.6 < expected < 0.95  # the premise: a layer neither trivial nor empty
    assert abs(result["carry"].accuracy - expected) <= 0.01, (result["carry"].accuracy, expected)


def test_token_view_probe_refusals_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = token_store(tmp_path)
    count = len(store.tokens("carry"))
    with pytest.raises(StoreError, match="pass tokens=True to probe the tokens of a ragged layer"):
        probe(store, ["carry"], labels=[0, 1] * (count // 2))
    with pytest.raises(StoreError, match=f"3 labels for {count} tokens: pass one label per token"):
        probe(store, labels=[0, 1, 0], tokens=True)
    rows, _, _ = planted_store(tmp_path)
    with pytest.raises(StoreError, match=r"probe\(tokens=True\) reads ragged \(per-token\) layers"):
        probe(rows, ["carry"], tokens=True)
    labels = (torch.arange(count) % 2).tolist()
    torch.save(torch.tensor(labels), tmp_path / "labels.pt")
    assert main(["probe", str(tmp_path / "tokens"), "--tokens", "--layers", "carry",
                 "--labels", str(tmp_path / "labels.pt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "carry" and lines[1].split()[-1] == "6"
