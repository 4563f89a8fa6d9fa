"""The logit lens on GPT-2 and a Llama-like model from configs: each block's residual through the
model's own final norm and unembedding, computed by hand with plain forward hooks; the last block
equals the model's own log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope import CaptureError

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=60,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=60,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"gpt2": (_gpt2, "transformer.h", "transformer.ln_f"),
          "llama": (_llama, "model.layers", "model.norm")}


def _by_hand(model: nn.Module, blocks: str, norm: str, ids: torch.Tensor) -> torch.Tensor:
    kept: list[torch.Tensor] = []
    modules = list(model.get_submodule(blocks))
    handles = [m.register_forward_hook(
        lambda mod, a, o: kept.append(o[0] if isinstance(o, tuple) else o)) for m in modules]
    try:
        with torch.no_grad():
            model(input_ids=ids)
            readout = [model.lm_head(model.get_submodule(norm)(h)) for h in kept]
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(readout).log_softmax(dim=-1)


@settings(max_examples=4, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), batch=st.integers(1, 2), seq=st.integers(1, 6))
def test_every_block_read_through_the_models_own_head(name: str, batch: int, seq: int) -> None:
    build, blocks, norm = MODELS[name]
    model, ids = build(), torch.randint(0, 60, (batch, seq))
    lens = hookscope.logit_lens(model, ids)
    assert lens.layers == [f"resid_post.{i}" for i in range(3)]  # the names asked, by default
    assert lens.paths == {f"resid_post.{i}": f"{blocks}.{i}" for i in range(3)}
    assert lens.log_probs.shape == (3, batch, seq, 60) and lens.log_probs.dtype == torch.float32
    assert torch.allclose(lens.log_probs, _by_hand(model, blocks, norm, ids), atol=1e-5)
    with torch.no_grad():
        own = model(input_ids=ids).logits.log_softmax(dim=-1)
    assert (lens.log_probs[-1] - own).abs().max() <= 1e-5


def test_chosen_layers_top_k_table_and_plot(tmp_path: Path) -> None:
    model, ids = _gpt2(), torch.tensor([[5, 9, 2, 7]])
    lens = hookscope.logit_lens(model, ids, layers=["transformer.h.0", "transformer.h.2"],
                                plot=tmp_path / "lens.png")
    assert lens.layers == ["transformer.h.0", "transformer.h.2"]
    probabilities, token_ids = lens.top(3)
    expected = lens.log_probs.exp().sort(dim=-1, descending=True)
    assert torch.equal(probabilities, expected.values[..., :3])
    assert torch.equal(token_ids, expected.indices[..., :3])
    lines = lens.table(k=2, decode=lambda i: f"t{i}").splitlines()
    first = f"t{int(token_ids[0, 0, -1, 0])} ({float(probabilities[0, 0, -1, 0]):.3f})"
    assert len(lines) == 2 and lines[0].startswith("transformer.h.0") and first in lines[0]
    assert (tmp_path / "lens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_say_what_to_do() -> None:
    model, ids = _gpt2(), torch.tensor([[1, 2]])
    with pytest.raises(CaptureError, match=r"no unembedding .*AutoModelForCausalLM"):
        hookscope.logit_lens(model.transformer, ids)
    with pytest.raises(CaptureError, match=r"\(1, 2, 96\), not the \(batch, seq, 32\) residual"):
        hookscope.logit_lens(model, ids, layers="transformer.h.0.attn.c_attn")
