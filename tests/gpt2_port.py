"""A hand-written GPT-2 for the port-checking tests of ``compare(..., pair=...)``: other module
names (``layers.{i}.self_attn.{q,k,v,o}_proj``), three projections where transformers' GPT-2 has
one fused ``c_attn`` ``Conv1D``, the activation inline, no dropout modules; the weights of a
``GPT2LMHeadModel`` copied in. ``bugs={i: kind}`` injects one mistake into block ``i``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor
#: the bugs a block can have: its first LayerNorm with eps=1.0 (GPT-2's is 1e-5: large enough
#: to change every output by ~1e-2), heads split as (D, H) instead of (H, D) (a transposed
#: head layout), ReLU instead of GPT-2's tanh GELU
BUGS = ("eps", "heads", "relu")


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, transposed_heads: bool) -> None:
        super().__init__()
        self.heads, self.transposed_heads = heads, transposed_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width) for _ in range(4))

    def split(self, x: Tensor) -> Tensor:
        """``(B, T, E)`` to ``(B, H, T, D)``; with the bug, features grouped as ``(D, H)``."""
        b, t, e = x.shape
        if self.transposed_heads:
            return x.view(b, t, e // self.heads, self.heads).permute(0, 3, 1, 2)
        return x.view(b, t, self.heads, e // self.heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (self.split(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(x.shape))


class MLP(nn.Module):
    def __init__(self, width: int, relu: bool) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.relu = relu

    def forward(self, x: Tensor) -> Tensor:
        h = self.up_proj(x)
        return self.down_proj(F.relu(h) if self.relu else F.gelu(h, approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, bug: str | None) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(width, eps=1.0 if bug == "eps" else 1e-5)
        self.self_attn = SelfAttention(width, heads, bug == "heads")
        self.post_attention_layernorm = nn.LayerNorm(width)
        self.mlp = MLP(width, bug == "relu")

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Port(nn.Module):
    """GPT-2 (``reference``: a ``GPT2LMHeadModel``) rewritten with the weights copied."""

    def __init__(self, reference: nn.Module, bugs: dict[int, str] | None = None) -> None:
        super().__init__()
        config, bugs = reference.config, bugs or {}
        width, vocab = config.n_embd, config.vocab_size
        self.embed_tokens = nn.Embedding(vocab, width)
        self.embed_positions = nn.Embedding(config.n_positions, width)
        self.layers = nn.ModuleList(Layer(width, config.n_head, bugs.get(i)) for i in range(config.n_layer))
        self.norm, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.load_state_dict(port_state(reference))
        self.eval()

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(torch.arange(input_ids.shape[1])[None])
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def port_state(reference: nn.Module) -> dict[str, Tensor]:
    """GPT-2's weights under the port's names: ``Conv1D`` keeps ``(in, out)`` weights (transposed
    for ``nn.Linear``), ``c_attn``'s columns are q, k, v one after the other."""
    state, width = reference.state_dict(), reference.config.n_embd
    out = {"embed_tokens.weight": state["transformer.wte.weight"],
           "embed_positions.weight": state["transformer.wpe.weight"],
           "norm.weight": state["transformer.ln_f.weight"], "norm.bias": state["transformer.ln_f.bias"],
           "lm_head.weight": state["lm_head.weight"]}
    for i in range(reference.config.n_layer):
        a, b = f"transformer.h.{i}.", f"layers.{i}."
        for name_a, name_b in [("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")]:
            out |= {f"{b}{name_b}.{f}": state[f"{a}{name_a}.{f}"] for f in ("weight", "bias")}
        for name_a, name_b in [("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"),
                               ("mlp.c_proj", "mlp.down_proj")]:
            out |= {f"{b}{name_b}.weight": state[f"{a}{name_a}.weight"].t(),
                    f"{b}{name_b}.bias": state[f"{a}{name_a}.bias"]}
        for k, name_b in enumerate(("q_proj", "k_proj", "v_proj")):
            columns = slice(k * width, (k + 1) * width)
            out |= {f"{b}self_attn.{name_b}.weight": state[f"{a}attn.c_attn.weight"][:, columns].t(),
                    f"{b}self_attn.{name_b}.bias": state[f"{a}attn.c_attn.bias"][columns]}
    return out
