"""``compare(..., pair=...)``: origin vs propagation of an inline bug, name mappings with
placeholders, regex groups and transforms, tolerances by dtype, the CLI (the GPT-2 port cases of
the issue are in test_compare_ports.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from hookscope import compare
from hookscope.cli.main import main
from hookscope.diagnostics.comparison import TOLERANCES
from hookscope.errors import HookscopeError
from tests.gpt2_port import Port
from tests.models import tiny_gpt2

E, HEADS = 16, 2


LAYERS = 3
IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    return tiny_gpt2(n_layer=LAYERS, n_head=4)


def test_swapped_activation_first_difference_is_not_the_origin(gpt2: nn.Module) -> None:
    port = Port(gpt2, bugs={1: "relu"})
    result = compare(gpt2, port, IDS, pair="auto")
    first, origin = result.first_divergent, result.first_origin
    assert first is not None and origin is not None
    # the activation is computed inline: down_proj shows the difference first, but on GPT-2's
    # own input it is exact (propagation); the MLP around it is where the port differs (origin)
    assert first.path == "transformer.h.1.mlp.c_proj"
    assert (origin.path_a, origin.path_b) == ("transformer.h.1.mlp", "layers.1.mlp")
    by_a = {p.path_a: p for p in result.pairs}
    assert by_a["transformer.h.1.mlp.c_proj"].propagated
    assert by_a["transformer.h.2"].propagated and by_a["lm_head"].propagated
    assert not by_a["transformer.h.2.mlp"].origin
    # the local error of the MLP by hand: both MLPs on GPT-2's input of block 1's MLP
    block = gpt2.transformer.h[1]
    with torch.no_grad():
        h = gpt2(IDS, output_hidden_states=True).hidden_states[1]
        x = block.ln_2(h + block.attn(block.ln_1(h))[0])
        expected = (block.mlp(x) - port.layers[1].mlp(x)).abs().max().item()
    assert origin.local is not None
    assert origin.local.max_abs == pytest.approx(expected, rel=1e-4)
    assert origin.local.max_abs > 1e-3 and by_a["transformer.h.1.mlp.c_proj"].local.max_abs < 1e-5


class Heads(nn.Module):
    """``(B, T, E)`` to heads, ``(B, T, H, D)`` or with ``transposed`` ``(B, H, T, D)``."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(*x.shape[:2], HEADS, E // HEADS)
        return heads.transpose(1, 2) if self.transposed else heads


class Fused(nn.Module):
    """One QKV projection and a ``(B, T, H, D)`` head split."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.heads = Heads(transposed=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.qkv(x)[..., :E])


class Split(nn.Module):
    """Three projections and a ``(B, H, T, D)`` head split, the same weights as ``Fused``."""

    def __init__(self, fused: Fused, scale_k: float = 1.0) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.heads = Heads(transposed=True)
        with torch.no_grad():
            for i, layer in enumerate((self.q, self.k, self.v)):
                layer.weight.copy_(fused.qkv.weight[i * E:(i + 1) * E])
                layer.bias.copy_(fused.qkv.bias[i * E:(i + 1) * E])
            self.k.weight.mul_(scale_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.k(x), self.v(x)
        return self.heads(self.q(x))


def chunk(i: int):  # noqa: ANN201 - a transform: part i of a fused QKV output
    return lambda t: t[..., i * E:(i + 1) * E]


MAPPING = {"qkv": [("q", chunk(0)), ("k", chunk(1)), ("v", chunk(2))],
           "heads": ("heads", lambda t: t.transpose(1, 2))}


def test_mapping_with_transforms_fused_qkv_and_head_layout() -> None:
    torch.manual_seed(1)
    fused, x = Fused(), torch.randn(2, 5, E)
    result = compare(fused, Split(fused), x, pair=MAPPING)
    assert [(p.path_a, p.path_b) for p in result.pairs] == [
        ("qkv", "q"), ("qkv", "k"), ("qkv", "v"), ("heads", "heads")]
    assert all(p.accumulated.max_abs < 1e-6 and p.local is not None and p.local.max_abs < 1e-6
               for p in result.pairs)
    assert result.pairing is not None and result.pairing.confidence == 1.0
    broken = Split(fused, scale_k=2.0)
    result = compare(fused, broken, x, pair=MAPPING)
    k = result.pairs[1]
    expected = (fused.qkv(x)[..., E:2 * E] - broken.k(x)).abs().max().item()
    assert k.origin and k.local is not None and k.local.max_abs == pytest.approx(expected, rel=1e-5)
    assert result.first_origin is k and not result.pairs[3].origin


def test_placeholders_and_regex_groups_name_the_same_pairs(gpt2: nn.Module) -> None:
    port = Port(gpt2)
    braces = compare(gpt2, port, IDS, pair={"transformer.h.{i}.{part}": "layers.{i}.{part}"})
    regex = compare(gpt2, port, IDS, pair={r"re:transformer\.h\.(\d+)\.(\w+)": r"layers.\1.\2"})
    expected = [(f"transformer.h.{i}.mlp", f"layers.{i}.mlp") for i in range(LAYERS)]  # one name both have
    assert [(p.path_a, p.path_b) for p in braces.pairs] == expected
    assert [(p.path_a, p.path_b) for p in regex.pairs] == expected
    assert braces.first_divergent is None and braces.pairing is not None
    assert "transformer.h.0.ln_1:0" in braces.pairing.unpaired_a


def test_a_pairing_that_pairs_nothing_names_the_unpaired(gpt2: nn.Module) -> None:
    with pytest.raises(HookscopeError, match=r"paired 0 .*unpaired in A: \['transformer.wte:0'"):
        compare(gpt2, Port(gpt2), IDS, pair={"nothing.{i}": "layers.{i}"})
    with pytest.raises(HookscopeError, match="pair='auto' paired"):
        compare(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Conv1d(1, 1, 1)),
                torch.randn(1, 1, 4), pair="auto")


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_tolerance_follows_the_lower_precision(dtype: torch.dtype, name: str) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E))
    low = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E)).to(dtype)
    low.load_state_dict(model.state_dict())
    x = torch.randn(3, E)
    result = compare(model, low, x, pair="auto")
    assert [p.precision for p in result.pairs] == [name, name]
    assert (result.pairs[0].atol, result.pairs[0].rtol) == TOLERANCES[name]
    expected = (model[0](x) - low[0](x.to(dtype)).float()).abs().max().item()
    assert result.pairs[0].accumulated.max_abs == pytest.approx(expected, rel=1e-6)
    assert result.first_divergent is None  # within the format's tolerance
    strict = compare(model, low, x, pair="auto", tolerances={name: (1e-6, 1e-6)})
    assert strict.first_origin is not None and strict.first_origin.path_a == "0"
    assert math.isnan(strict.atol)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_dynamically_quantized_linear_is_int8() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(E, E), nn.ReLU(), nn.Linear(E, 4))
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    result = compare(model, quantized, torch.randn(3, E), pair="auto")
    assert [(p.path_a, p.precision) for p in result.pairs] == [
        ("0", "int8"), ("1", "float32"), ("2", "int8")]
    assert result.first_origin is None and 0 < result.pairs[0].local.max_abs < 5e-2


def linear_norm(eps: float = 1e-5) -> nn.Sequential:
    """Linear, GELU, LayerNorm with seeded weights (a model factory for the CLI specs)."""
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(E, E), nn.GELU(), nn.Linear(E, E), nn.LayerNorm(E, eps=eps))


def linear_norm_wrong_eps() -> nn.Sequential:
    return linear_norm(eps=0.5)


def test_cli_pair_auto_reports_the_origin_and_plots(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    spec = "tests.test_compare_pairing:linear_norm"
    assert main(["diff", spec, f"{spec}_wrong_eps", "--input", "randn:3,16", "--pair", "auto",
                 "--plot", str(tmp_path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_origin"] == "3" and data["confidence"] == 1.0
    assert [r["verdict"] for r in data["rows"]] == ["close", "close", "close", "origin"]
    with Image.open(tmp_path / "diff.png") as image:
        assert image.size == (1600, 800)


def linear_norm_longer() -> nn.Sequential:
    """linear_norm with one more layer: model B has a module model A lacks."""
    return nn.Sequential(*linear_norm(), nn.Linear(E, E))


def test_cli_pair_auto_names_the_unpaired_and_ends_with_a_verdict(
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = "tests.test_compare_pairing:linear_norm"
    assert main(["diff", spec, f"{spec}_longer", "--input", "randn:3,16", "--pair", "auto"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[-2].endswith("; unpaired in A: 0, in B: 1 (4:0)")  # path:call
    assert lines[-1] == "all 4 paired calls close (each within its tolerance)"
    assert main(["diff", spec, f"{spec}_wrong_eps", "--input", "randn:3,16", "--pair", "auto"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("first origin: 3 (B: 3), local max_abs ")
