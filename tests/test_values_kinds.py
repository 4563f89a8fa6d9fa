"""Values of every kind of model: quantized outputs (shared/cases/32), lazy modules
(shared/cases/34), functorch transforms (issue 10 "Values")."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import hookscope
from hookscope.diagnostics.module_tree import format_tree
from hookscope.errors import CaptureError, FusedModuleWarning


# ------------------------------------------------------------------ case 32: quantized modules
class QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.relu = nn.ReLU()
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.relu(self.bn(self.conv(self.quant(x)))))


def quantized_model() -> nn.Module:
    """Eager-mode post-training quantization as in the case: fuse, prepare, calibrate, convert."""
    model = QNet().eval()
    model.qconfig = tq.get_default_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = tq.fuse_modules(model, [["conv", "bn", "relu"]])
        prepared = tq.prepare(fused)
        prepared(torch.randn(8, 1, 8, 8))
        return tq.convert(prepared)


def _plain_output(model: nn.Module, path: str, x: torch.Tensor) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(path).register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return seen[0]


def test_32_stats_of_a_quantized_output_are_those_of_its_dequantized_values() -> None:
    model, x = quantized_model(), torch.randn(2, 1, 8, 8)
    reference = _plain_output(model, "conv", x)
    assert reference.dtype == torch.quint8
    values = reference.dequantize().double()
    got = hookscope.stats(model, [x], layers="conv").get("conv")
    assert got is not None
    summary = got.as_dict()
    assert summary["count"] == values.numel() == 2 * 2 * 6 * 6
    assert summary["mean"] == pytest.approx(float(values.mean()), rel=1e-9)
    assert summary["max"] == pytest.approx(float(values.max()), rel=1e-9)


def test_32_capture_keeps_dequantized_values_notes_the_dtype_and_saves(tmp_path: Path) -> None:
    model, x = quantized_model(), torch.randn(2, 1, 8, 8)
    reference = _plain_output(model, "conv", x)
    with torch.no_grad(), hookscope.capture(model, "conv", "quant") as acts:
        model(x)
    assert acts["conv"].dtype == torch.float32 and torch.equal(acts["conv"], reference.dequantize())
    assert acts.records.notes["conv"] == (f"torch.quint8 (scale {reference.q_scale():.6g}, zero point "
                                          f"{reference.q_zero_point()}), kept dequantized as torch.float32")
    acts.save(tmp_path / "q.safetensors")
    loaded = hookscope.load(tmp_path / "q.safetensors")
    assert torch.equal(loaded["conv"], reference.dequantize())


def test_32_compare_diffs_quantized_outputs_by_value() -> None:
    model, x = quantized_model(), torch.randn(1, 1, 8, 8)
    other = quantized_model()  # calibrated on other data: other scales, other values
    result = hookscope.compare(model, other, x, layers="conv")
    diff = result["conv"]
    a, b = _plain_output(model, "conv", x).dequantize(), _plain_output(other, "conv", x).dequantize()
    assert diff.shape == (1, 2, 6, 6)
    assert diff.max_abs == pytest.approx(float((a - b).abs().max()), rel=1e-6)


def test_32_ablate_and_edits_work_on_quantized_outputs_and_requantize() -> None:
    model, x = quantized_model(), torch.randn(1, 1, 8, 8)
    with torch.no_grad(), hookscope.ablate(model, "conv"):
        out = model(x)
    assert torch.equal(out, torch.zeros(1, 2, 6, 6))  # zeros through dequant
    reference = _plain_output(model, "conv", x)
    with torch.no_grad(), hookscope.edit(model, {"conv": lambda output: output * 2}):
        doubled = model(x)
    expected = torch.quantize_per_tensor(reference.dequantize() * 2, reference.q_scale(),
                                         reference.q_zero_point(), torch.quint8).dequantize()
    assert torch.equal(doubled, expected)


def test_32_tree_shows_the_quantized_dtype() -> None:
    model, x = quantized_model(), torch.randn(1, 1, 8, 8)
    rows = {row.path: row for row in hookscope.tree(model, x)}
    assert rows["conv"].class_name == "ConvReLU2d" and rows["conv"].outputs == ("1x2x6x6 quint8",)
    assert rows["bn"].class_name == "Identity"


def test_32_selecting_a_fused_away_module_warns_and_names_the_fused_one() -> None:
    model, x = quantized_model(), torch.randn(1, 1, 8, 8)
    with pytest.warns(FusedModuleWarning, match=r"'bn' is an nn\.Identity left by fuse_modules: "
                                                 r"'conv' \(ConvReLU2d\) now computes it.*Select 'conv'"):
        with hookscope.capture(model, "bn", "conv") as acts:
            model(x)
    assert torch.equal(acts["bn"], acts["conv"])  # the Identity returns the fused output


# ------------------------------------------------------------------ case 34: lazy modules
def _lazy() -> nn.Sequential:
    return nn.Sequential(nn.LazyConv2d(8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))


def test_34_tree_without_input_lists_lazy_modules_with_unknown_parameters() -> None:
    rows = {row.path: row for row in hookscope.tree(_lazy())}
    assert list(rows) == ["", "0", "1", "2", "3"]
    assert (rows["0"].params, rows["0"].own_params, rows[""].params) == (None, None, None)
    assert rows["1"].params == 0
    assert "lazy: parameters are created by the first forward; give an input" in rows["0"].note
    text = format_tree(list(rows.values()))
    assert "  0     LazyConv2d  ?       ?  # lazy" in text


def test_34_tree_with_input_materialises_them_and_capture_sees_the_first_call() -> None:
    model = _lazy()
    rows = {row.path: row for row in hookscope.tree(model, torch.randn(2, 3, 8, 8))}
    assert rows["0"].class_name == "Conv2d" and rows["0"].params == 8 * 3 * 3 * 3 + 8
    assert rows[""].params == 3114 and rows["0"].note == ""
    fresh = _lazy()
    x = torch.randn(2, 3, 8, 8)
    with hookscope.capture(fresh, "0", "3") as acts:
        out = fresh(x)
    assert acts["0"].shape == (2, 8, 6, 6) and torch.equal(acts["3"], out.detach())


# ------------------------------------------------------------------ functorch transforms
def test_vmap_inside_a_capture_raises_naming_the_transform() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    with pytest.raises(CaptureError, match=r"'0' ran inside torch\.func\.vmap.*dead wrapper.*Fix: "
                                           r"call the model on the whole batch without vmap"):
        with hookscope.capture(model, "0"):
            torch.func.vmap(model)(torch.randn(4, 3))
    assert not model[0]._forward_hooks


def test_grad_transform_inside_a_capture_raises_naming_the_transform() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    with pytest.raises(CaptureError, match=r"ran inside a torch\.func gradient transform"):
        with hookscope.capture(model, "0"):
            torch.func.grad(lambda x: model(x).sum())(torch.randn(3))


def test_functional_call_captures_the_real_batch_with_the_given_parameters() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    params = {k: torch.zeros_like(v) + 0.5 for k, v in model.named_parameters()}
    x = torch.randn(4, 3)
    with hookscope.capture(model, "0") as acts:
        out = torch.func.functional_call(model, params, (x,))
    assert torch.equal(acts["0"], torch.nn.functional.linear(x, params["0.weight"], params["0.bias"]))
    assert torch.equal(out, torch.relu(acts["0"]))
