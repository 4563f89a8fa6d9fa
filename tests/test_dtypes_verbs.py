"""Every dtype family a module can return, through every verb (issue 20, part 4).

For each (dtype, verb) the verb either gives plain PyTorch's values or raises a
``HookscopeError`` whose message names the dtype; never a raw torch/safetensors error.
The model's middle module returns ``x.to(dtype)`` (or ``quantize_per_tensor(x)``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import HookscopeError
from tests.models import FLOAT8

QUANTIZED = [torch.quint8, torch.qint8, torch.qint32]
INTEGER = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
           torch.uint16, torch.uint32, torch.uint64]
DTYPES = [*QUANTIZED, *FLOAT8, *INTEGER, torch.bool, torch.complex64, torch.complex128,
          torch.bfloat16, torch.float16]
VERBS = ["save_load", "stats", "compare", "steer", "ablate", "extract"]


class ToDtype(nn.Module):
    """Returns ``x`` (float32, ``(batch, 4)``) as ``dtype``: quantized (per tensor, or per
    channel along dim 1), complex (x - 1j x) or cast."""

    def __init__(self, dtype: torch.dtype, per_channel: bool = False):
        super().__init__()
        self.dtype, self.per_channel = dtype, per_channel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return convert(x, self.dtype, self.per_channel)


class Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


# per-channel quantization along dim 1: a scale and a zero point per column (quint8's are
# inside 0..255; the signed types' zero points are 0)
CHANNEL_SCALES = torch.tensor([0.1, 0.05, 0.2, 0.1], dtype=torch.float64)
CHANNEL_ZEROS = {torch.quint8: torch.tensor([10, 0, 5, 3])}


def convert(x: torch.Tensor, dtype: torch.dtype, per_channel: bool = False) -> torch.Tensor:
    if per_channel:
        return torch.quantize_per_channel(x, CHANNEL_SCALES, CHANNEL_ZEROS.get(
            dtype, torch.zeros(4, dtype=torch.long)), 1, dtype)
    if dtype in QUANTIZED:
        return torch.quantize_per_tensor(x, 0.1, 10 if dtype == torch.quint8 else 0, dtype)
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    return (x * 3).abs().to(dtype) if dtype.is_signed is False or dtype == torch.bool else (x * 3).to(dtype)


def model(dtype: torch.dtype, per_channel: bool = False) -> nn.Sequential:
    return nn.Sequential(nn.Identity(), ToDtype(dtype, per_channel), nn.Identity())


def requantize_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (float) quantized with ``like``'s scheme, scales and zero points."""
    if like.qscheme() == torch.per_channel_affine:
        return torch.quantize_per_channel(value, like.q_per_channel_scales(),
                                          like.q_per_channel_zero_points(), like.q_per_channel_axis(),
                                          like.dtype)
    return torch.quantize_per_tensor(value, like.q_scale(), like.q_zero_point(), like.dtype)


def values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as float64 (quantized dequantized, complex as real/imag pairs)."""
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to(torch.float64)


def run_verb(verb: str, dtype: torch.dtype, x: torch.Tensor, tmp: Path,
             per_channel: bool = False) -> None:
    """Run ``verb`` on the model and assert its values equal plain PyTorch's."""
    m = model(dtype, per_channel)
    expected = m[1](x)  # plain PyTorch's output of the module
    if verb == "save_load":
        with hookscope.capture(m, "1") as acts:
            m(x)
        assert torch.equal(values(acts["1"]), values(expected))
        acts.save(tmp / "a.safetensors")
        loaded = hookscope.load(tmp / "a.safetensors")["1"]
        kept = torch.float32 if dtype in QUANTIZED else dtype  # quantized: kept dequantized
        assert loaded.dtype == kept and torch.equal(values(loaded), values(expected))
    elif verb == "stats":
        result = hookscope.stats(m, [x], "1")["1"]
        assert int(result.count) == x.numel()
        ref = values(expected)
        assert float(result.max) == float(ref.max()) and float(result.min) == float(ref.min())
        assert abs(float(result.mean) - float(ref.mean())) < 1e-9 * max(1.0, float(ref.abs().max()))
    elif verb == "compare":
        diff = hookscope.compare(m, model(dtype, per_channel), x, layers="1")["1"]
        assert diff.max_abs == 0.0 and diff.close
        shifted = nn.Sequential(Shift(), ToDtype(dtype, per_channel), nn.Identity())  # module 1 sees x + 1
        other = hookscope.compare(m, shifted, x, layers="1")
        assert other["1"].max_abs == float((values(m[1](x + 1)) - values(expected)).abs().max())
    elif verb == "steer":
        vector = torch.full((4,), 0.5)
        with hookscope.steer(m, {"1": vector}):
            out = m(x)
        plain = expected.dequantize() if expected.is_quantized else expected
        want = (plain.float() + vector).to(plain.dtype) if dtype in FLOAT8 else plain + vector.to(plain.dtype)
        got = out.dequantize() if out.is_quantized else out
        if dtype in QUANTIZED:  # returned quantized with the output's parameters
            want = requantize_like(want, expected).dequantize()
        assert out.dtype == dtype and torch.equal(values(got), values(want))
    elif verb == "ablate":
        with hookscope.ablate(m, "1"):
            out = m(x)
        assert out.dtype == dtype and torch.equal(values(out), torch.zeros(values(expected).shape,
                                                                              dtype=torch.float64))
    else:
        store = hookscope.extract(m, [x], "1", tmp / "store", progress=False)
        rows = store["1"][:]
        assert isinstance(rows, torch.Tensor) and torch.equal(values(rows), values(expected))


def outcome(verb: str, dtype: torch.dtype, x: torch.Tensor, tmp: Path) -> str:
    """"ok", or "refused" when a HookscopeError naming the dtype was raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_verb(verb, dtype, x, tmp)
        except HookscopeError as err:
            assert str(dtype) in str(err), f"{verb} on {dtype}: the error does not name it: {err}"
            return "refused"
    return "ok"


# what each verb does per dtype family: the table of the report, held here
REFUSED = {
    ("stats", torch.complex64), ("stats", torch.complex128), ("save_load", torch.complex128),
    *(("steer", d) for d in [*INTEGER, torch.bool]),
    *(("extract", d) for d in [*FLOAT8, torch.uint16, torch.uint32, torch.uint64,
                               torch.complex64, torch.complex128]),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), verb=st.sampled_from(VERBS),
       x=st.lists(st.floats(-4, 4, width=32), min_size=8, max_size=8))
def test_every_dtype_every_verb_gives_torchs_values_or_names_the_dtype(
        dtype: torch.dtype, verb: str, x: list[float], tmp_path_factory: pytest.TempPathFactory) -> None:
    inputs = torch.tensor(x, dtype=torch.float32).reshape(2, 4)
    got = outcome(verb, dtype, inputs, tmp_path_factory.mktemp("dv"))
    assert got == ("refused" if (verb, dtype) in REFUSED else "ok"), (verb, dtype)


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_on_every_dtype(verb: str, tmp_path: Path) -> None:
    """Every dtype per verb, deterministic (the property test varies the values too)."""
    x = torch.linspace(-2, 2, 8).reshape(2, 4)
    for i, dtype in enumerate(DTYPES):
        expected = "refused" if (verb, dtype) in REFUSED else "ok"
        assert outcome(verb, dtype, x, tmp_path / str(i)) == expected, (verb, dtype)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_per_channel_quantized_outputs_through_every_verb(dtype: torch.dtype, tmp_path: Path) -> None:
    """Quantized per channel (a scale and zero point per column): every verb gives plain
    PyTorch's values; steer returns it quantized with the output's own per-channel parameters."""
    x = torch.linspace(-2, 2, 8).reshape(2, 4)
    assert model(dtype, per_channel=True)(x).qscheme() == torch.per_channel_affine  # the premise
    for verb in VERBS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates quantized tensors
            run_verb(verb, dtype, x, tmp_path / verb, per_channel=True)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_kinds_are_noted_and_an_edit_is_requantized_like_the_output(
        dtype: torch.dtype, per_channel: bool) -> None:
    m, x = model(dtype, per_channel), torch.linspace(-2, 2, 8).reshape(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        expected = m[1](x)
        with hookscope.capture(m, "1") as acts:
            m(x)
        with hookscope.edit(m, {"1": lambda output: output * 2}):
            out = m(x)
        want = requantize_like(expected.dequantize() * 2, expected)
    scheme = ("per-channel scales along dim 1" if per_channel
              else f"scale 0.1, zero point {expected.q_zero_point()}")
    assert acts.records.notes["1"] == f"{dtype} ({scheme}), kept dequantized as torch.float32"
    assert torch.equal(acts["1"], expected.dequantize())
    assert (out.dtype, out.qscheme()) == (dtype, expected.qscheme())
    assert torch.equal(out.dequantize(), want.dequantize())
