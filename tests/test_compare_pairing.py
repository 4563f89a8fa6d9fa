"""``compare(..., pair=...)``: GPT-2 from transformers against a hand-written port with other
module names (auto pairing, origin vs propagation), name mappings with transforms, tolerances
by dtype."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from hookscope import compare
from hookscope.cli.main import main
from hookscope.diagnostics.compare import TOLERANCES
from hookscope.errors import HookscopeError

E, HEADS, LAYERS = 16, 2, 3


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_embd=E, n_head=HEADS, vocab_size=40, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p.view(b, t, HEADS, E // HEADS).transpose(1, 2)
                   for p in self.qkv(x).split(E, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, E))


class MLP(nn.Module):
    def __init__(self, activation: str) -> None:
        super().__init__()
        self.fc_in, self.fc_out, self.activation = nn.Linear(E, 4 * E), nn.Linear(4 * E, E), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        return self.fc_out(F.relu(h) if self.activation == "relu" else F.gelu(h, approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, activation: str, eps: float) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(E), Attention()
        self.norm2, self.mlp = nn.LayerNorm(E, eps=eps), MLP(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Port(nn.Module):
    """A hand-written GPT-2 with other names; ``bugs={i: "relu"}`` swaps block i's activation,
    ``{i: "eps"}`` gives its second LayerNorm eps 0.1."""

    def __init__(self, reference: GPT2LMHeadModel, bugs: dict[int, str] | None = None) -> None:
        super().__init__()
        bugs = bugs or {}
        self.embed_tokens, self.embed_positions = nn.Embedding(40, E), nn.Embedding(16, E)
        self.layers = nn.ModuleList(
            Layer("relu" if bugs.get(i) == "relu" else "gelu", 0.1 if bugs.get(i) == "eps" else 1e-5)
            for i in range(LAYERS))
        self.final_norm, self.lm_head = nn.LayerNorm(E), nn.Linear(E, 40, bias=False)
        self.load_state_dict(port_state(reference))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(torch.arange(input_ids.shape[1])[None])
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))


def port_state(reference: GPT2LMHeadModel) -> dict[str, torch.Tensor]:
    """GPT-2's weights under the port's names (Conv1D keeps its weight transposed)."""
    state = reference.state_dict()
    names = {"transformer.wte": "embed_tokens", "transformer.wpe": "embed_positions",
             "transformer.ln_f": "final_norm", "lm_head": "lm_head"}
    for i in range(LAYERS):
        names |= {f"transformer.h.{i}.{a}": f"layers.{i}.{b}" for a, b in [
            ("ln_1", "norm1"), ("ln_2", "norm2"), ("attn.c_attn", "attn.qkv"),
            ("attn.c_proj", "attn.out"), ("mlp.c_fc", "mlp.fc_in"), ("mlp.c_proj", "mlp.fc_out")]}
    out = {}
    for a, b in names.items():
        for field in ("weight", "bias"):
            if f"{a}.{field}" in state:
                value = state[f"{a}.{field}"]
                conv = ".attn.c_" in a or ".mlp.c_" in a
                out[f"{b}.{field}"] = value.t() if conv and field == "weight" else value
    return out


IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


def block_input(model: GPT2LMHeadModel, i: int) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, output_hidden_states=True).hidden_states[i]


def test_auto_pairs_every_block_of_a_correct_port() -> None:
    model = gpt2()
    result = compare(model, Port(model), IDS, pair="auto")
    pairs = {(p.path_a, p.path_b) for p in result.pairs}
    for i in range(LAYERS):
        assert {(f"transformer.h.{i}", f"layers.{i}"),
                (f"transformer.h.{i}.ln_1", f"layers.{i}.norm1"),
                (f"transformer.h.{i}.attn.c_attn", f"layers.{i}.attn.qkv"),
                (f"transformer.h.{i}.mlp", f"layers.{i}.mlp"),
                (f"transformer.h.{i}.mlp.c_proj", f"layers.{i}.mlp.fc_out")} <= pairs
    assert ("lm_head", "lm_head") in pairs and ("transformer.wte", "embed_tokens") in pairs
    assert len(result.pairs) == 4 + 9 * LAYERS  # wte, wpe, ln_f, lm_head; 9 per block
    # unpaired: GPT-2's dropouts, its activation modules (the port's are inline) and its
    # transformer container (the port has no such level)
    assert result.pairing is not None
    assert set(result.pairing.unpaired_b) == set()
    unpaired = {u.rsplit(":", 1)[0] for u in result.pairing.unpaired_a}
    assert "transformer" in unpaired and "transformer.h.0.mlp.act" in unpaired
    calls_a = len(result.pairs) + len(result.pairing.unpaired_a)
    assert result.pairing.confidence == pytest.approx(2 * len(result.pairs) / (calls_a + len(result.pairs)))
    assert result.first_divergent is None and result.first_origin is None
    assert all(p.precision == "float32" and p.atol == 1e-5 for p in result.pairs)


def test_swapped_activation_first_difference_is_not_the_origin() -> None:
    model = gpt2()
    port = Port(model, bugs={1: "relu"})
    result = compare(model, port, IDS, pair="auto")
    first, origin = result.first_divergent, result.first_origin
    assert first is not None and origin is not None
    # the activation is computed inline: fc_out shows the difference first, but on GPT-2's own
    # input it is exact (propagation); the MLP around it is where the port differs (origin)
    assert first.path == "transformer.h.1.mlp.c_proj"
    assert (origin.path_a, origin.path_b) == ("transformer.h.1.mlp", "layers.1.mlp")
    by_a = {p.path_a: p for p in result.pairs}
    assert by_a["transformer.h.1.mlp.c_proj"].propagated
    assert by_a["transformer.h.2"].propagated and by_a["lm_head"].propagated
    assert not by_a["transformer.h.2.mlp"].origin
    # the local error of the MLP by hand: both MLPs on GPT-2's input of block 1's MLP
    block = model.transformer.h[1]
    with torch.no_grad():
        h = block_input(model, 1)
        x = block.ln_2(h + block.attn(block.ln_1(h))[0])
        expected = (block.mlp(x) - port.layers[1].mlp(x)).abs().max().item()
    assert origin.local is not None
    assert origin.local.max_abs == pytest.approx(expected, rel=1e-4)
    assert origin.local.max_abs > 1e-3 and by_a["transformer.h.1.mlp.c_proj"].local.max_abs < 1e-5


def test_layernorm_eps_is_first_difference_and_origin() -> None:
    model = gpt2()
    result = compare(model, Port(model, bugs={2: "eps"}), IDS, pair="auto")
    assert result.first_divergent is not None and result.first_origin is not None
    assert result.first_divergent.path == "transformer.h.2.ln_2"
    assert result.first_origin.path_b == "layers.2.norm2"
    block = model.transformer.h[2]
    with torch.no_grad():
        h = block_input(model, 2)
        x = h + block.attn(block.ln_1(h))[0]
        ln = block.ln_2
        expected = (ln(x) - F.layer_norm(x, (E,), ln.weight, ln.bias, eps=0.1)).abs().max().item()
    assert result.first_origin.local.max_abs == pytest.approx(expected, rel=1e-4)


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


def test_placeholders_and_regex_groups_name_the_same_pairs() -> None:
    model = gpt2()
    port = Port(model)
    braces = compare(model, port, IDS, pair={"transformer.h.{i}.ln_{n}": "layers.{i}.norm{n}"})
    regex = compare(model, port, IDS, pair={r"re:transformer\.h\.(\d+)\.ln_(\d)": r"layers.\1.norm\2"})
    expected = [(f"transformer.h.{i}.ln_{n}", f"layers.{i}.norm{n}") for i in range(LAYERS)
                for n in (1, 2)]
    assert [(p.path_a, p.path_b) for p in braces.pairs] == expected
    assert [(p.path_a, p.path_b) for p in regex.pairs] == expected
    assert braces.first_divergent is None


def test_a_pairing_that_pairs_nothing_names_the_unpaired() -> None:
    model = gpt2()
    with pytest.raises(HookscopeError, match=r"paired 0 .*unpaired in A: \['transformer.wte:0'"):
        compare(model, Port(model), IDS, pair={"nothing.{i}": "layers.{i}"})
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
