"""hookscope.stats on real small models: values against numpy over the concatenated activations."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookscope
from hookscope.diagnostics.statistics import RunningStats, stats
from hookscope.errors import HookNeverFiredWarning, HookscopeError
from tests.models import InplaceRelu, LeNet, MlpStack, TupleOutput, UnusedBranch
from tests.reference import plain_capture

KEYS = ("mean", "std", "min", "max", "frac_zeros", "frac_nonfinite")


def _check_against_numpy(got: RunningStats, outputs: list[torch.Tensor], dim: int | None) -> None:
    stacked = np.concatenate([o.double().numpy() for o in outputs])
    rows = stacked.reshape(1, -1) if dim is None else np.moveaxis(stacked, dim, 0).reshape(
        stacked.shape[dim], -1)
    expected = {"mean": rows.mean(1), "std": rows.std(1), "min": rows.min(1), "max": rows.max(1),
                "frac_zeros": (rows == 0).mean(1), "frac_nonfinite": np.zeros(len(rows))}
    values = got.as_dict()
    for key in KEYS:
        np.testing.assert_allclose(np.atleast_1d(values[key]), expected[key], rtol=1e-9, err_msg=key)
    assert np.all(np.atleast_1d(values["count"]) == rows.shape[1])


def test_stats_over_batches_match_numpy_on_lenet() -> None:
    model = LeNet().eval()
    batches = [torch.randn(4, 3, 32, 32) for _ in range(5)]
    result = stats(model, batches, layers=["conv1", "conv2", "fc1"])
    assert list(result) == ["conv1", "conv2", "fc1"]
    # stats runs under no_grad: so does the reference (kernels may differ between grad modes)
    reference = [plain_capture(model, ["conv1", "conv2", "fc1"], b, grad_enabled=False)
                 for b in batches]
    for path in result:
        _check_against_numpy(result[path], [r[path][0] for r in reference], None)
    assert result["conv2"].as_dict()["count"] == 5 * 4 * 16 * 10 * 10


def test_per_channel_uses_dim_1_for_feature_maps_and_last_dim_for_tokens() -> None:
    cnn = LeNet().eval()
    batches = [torch.randn(2, 3, 32, 32) for _ in range(3)]
    got = stats(cnn, batches, layers="conv2", per_channel=True)["conv2"]
    outputs = [plain_capture(cnn, ["conv2"], b, grad_enabled=False)["conv2"][0] for b in batches]
    assert got.channel_dim == 1 and len(got.as_dict()["mean"]) == 16
    _check_against_numpy(got, outputs, 1)

    tokens = nn.Sequential(nn.Linear(4, 6), nn.GELU())  # (batch, seq, d_model) -> channel is d_model
    token_batches = [torch.randn(2, 5, 4) for _ in range(3)]
    got = stats(tokens, token_batches, layers="1", per_channel=True)["1"]
    outputs = [plain_capture(tokens, ["1"], b, grad_enabled=False)["1"][0] for b in token_batches]
    assert got.channel_dim == -1 and len(got.as_dict()["mean"]) == 6
    _check_against_numpy(got, outputs, -1)


def test_explicit_channel_dimension_for_conv1d() -> None:
    model = nn.Sequential(nn.Conv1d(2, 3, 3))  # (batch, channels, length) is 3-dim but not tokens
    batches = [torch.randn(2, 2, 9) for _ in range(2)]
    got = stats(model, batches, layers="0", per_channel=1)["0"]
    outputs = [plain_capture(model, ["0"], b, grad_enabled=False)["0"][0] for b in batches]
    _check_against_numpy(got, outputs, 1)


def test_values_are_taken_before_an_inplace_relu_changes_them() -> None:
    model = InplaceRelu().eval()
    batches = [torch.randn(2, 3, 6, 6) for _ in range(3)]
    got = stats(model, batches, layers="conv")["conv"].as_dict()
    assert got["min"] < 0  # ReLU(inplace=True) runs right after: zeros would show if read late
    assert got["frac_zeros"] == 0.0


def test_dead_relu_fraction_and_structured_output_part() -> None:
    model = TupleOutput().eval()
    batches = [torch.randn(2, 5, 4) for _ in range(2)]
    result = stats(model, batches, layers=["lstm[1][0]"])
    assert list(result) == ["lstm[1][0]"]
    h = [plain_capture(model, ["lstm"], b, grad_enabled=False)["lstm"][0][1][0] for b in batches]
    _check_against_numpy(result["lstm[1][0]"], h, None)
    relu = nn.Sequential(nn.Linear(3, 8), nn.ReLU())
    with torch.no_grad():
        relu[0].bias[:4] = -100.0  # 4 of 8 units can never be positive
    zeros = stats(relu, [torch.randn(10, 3)], layers="1", per_channel=True)["1"].as_dict()
    assert zeros["frac_zeros"][:4] == [1.0, 1.0, 1.0, 1.0]


def test_kwargs_and_tuple_batches_are_unpacked() -> None:
    model = UnusedBranch().eval()
    with pytest.warns(HookNeverFiredWarning, match="aux_head"):
        result = stats(model, [(torch.randn(2, 4),), {"x": torch.randn(3, 4)}],
                       layers=["head", "aux_head"])
    assert result["head"].as_dict()["count"] == 5 * 2
    assert result["aux_head"].as_dict()["count"] == 0


def test_a_tuple_batch_means_inputs_then_labels_as_in_extract(tmp_path: Path) -> None:
    model = MlpStack().eval()
    x, labels = torch.randn(6, 10), torch.arange(6)
    loader = DataLoader(TensorDataset(x, labels), batch_size=4)  # yields [inputs, labels]
    result = stats(model, loader, layers="fc1")["fc1"].as_dict()
    with torch.no_grad():
        expected = model.fc1(x).double()
    assert result["count"] == 6 * 20
    assert result["mean"] == pytest.approx(float(expected.mean()), rel=1e-6)
    stored = hookscope.extract(model, loader, "fc1", tmp_path / "s", progress=False)
    torch.testing.assert_close(stored["fc1"][:], model.fc1(x).detach())
    pair = stats(Pair2(), [((torch.ones(2, 3), torch.full((2, 3), 2.0)), labels[:2])],
                 layers="add")["add"].as_dict()
    assert (pair["count"], pair["mean"]) == (6, 3.0)  # ((a, b), labels): model(a, b)


class Pair2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add = nn.Identity()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.add(a + b)


def test_activations_are_not_kept() -> None:
    model = LeNet().eval()
    seen: list[weakref.ref[torch.Tensor]] = []
    handle = model.conv2.register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o)))
    try:
        result = stats(model, (torch.randn(2, 3, 32, 32) for _ in range(3)), layers="**")
    finally:
        handle.remove()
    gc.collect()
    assert len(seen) == 3 and all(ref() is None for ref in seen)
    assert all(s.mean.numel() == 1 for s in result.values())


def test_missing_channel_dimension_raises_and_removes_hooks() -> None:
    model = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(HookscopeError, match="pass per_channel=<the channel dimension>"):
        stats(model, [torch.randn(2, 3)], layers="0", per_channel=3)
