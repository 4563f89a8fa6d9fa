"""attribution_patching: equal to (a_clean - a_corrupted) . d metric / d a computed by hand with
plain hooks; exact where the metric is linear in the layer; rank-correlated with the exact
patching_sweep on GPT-2 from a config and on MiniLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from hookscope.errors import EditError
from hookscope.zoo.models import LoadedModel
from tests.models import tiny_gpt2
from tests.reference import clean_values, logit_diff

CLEAN = {"input_ids": torch.tensor([[3, 9, 14, 2, 8], [4, 1, 22, 7, 30]])}
CORRUPTED = {"input_ids": torch.tensor([[3, 50, 40, 2, 8], [4, 1, 41, 7, 33]])}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation: Pearson's of the ranks, ties given their mean rank."""
    def ranks(v: torch.Tensor) -> torch.Tensor:
        v = v.flatten().double()
        return (v[:, None] > v[None]).sum(1) + ((v[:, None] == v[None]).sum(1) + 1) / 2
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def by_hand(model: nn.Module, blocks: list[nn.Module], metric: Any = logit_diff) -> torch.Tensor:
    """One backward through forward hooks that add a zero requiring grad to each block."""
    zeros: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros_like(output, requires_grad=True)
        zeros.append(zero)
        kept.append(output.detach())
        return output + zero
    handles = [block.register_forward_hook(hook) for block in blocks]
    try:
        value = metric(model(**CORRUPTED))
    finally:
        for handle in handles:
            handle.remove()
    grads = torch.autograd.grad(value, zeros)
    sources = clean_values(model, blocks, CLEAN)
    return torch.stack([((s - c) * g).sum(dim=(0, 2)) for s, c, g in zip(sources, kept, grads)]
                       ).double() + float(value.detach())


def test_gpt2_equals_the_first_order_term_by_hand(tmp_path: Path) -> None:
    model = tiny_gpt2(n_layer=3, pad=False)
    atp = hookscope.attribution_patching(model, CLEAN, CORRUPTED, logit_diff,
                                         layers="transformer.h.*", plot=tmp_path / "atp.png")
    assert atp.layers == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert atp.positions == [0, 1, 2, 3, 4] and atp.values.dtype == torch.float64
    torch.testing.assert_close(atp.values, by_hand(model, list(model.transformer.h)),
                               rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert atp.clean == pytest.approx(float(logit_diff(model(**CLEAN))), abs=1e-6)
        assert atp.corrupted == pytest.approx(float(logit_diff(model(**CORRUPTED))), abs=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert (tmp_path / "atp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpt2_ranks_agree_with_the_exact_sweep() -> None:
    model = tiny_gpt2(n_layer=3, pad=False)
    atp = hookscope.attribution_patching(model, CLEAN, CORRUPTED, logit_diff,
                                         layers="transformer.h.*")
    exact = hookscope.patching_sweep(model, CLEAN, CORRUPTED, layers="transformer.h.*",
                                     metric=logit_diff, progress=False)
    correlation = spearman(atp.values, exact.values)
    print(f"gpt2 AtP vs exact sweep: Spearman {correlation:.4f}")
    assert correlation > 0.95  # measured 0.996


class _Linear(nn.Module):
    """Embedding, two linear layers, a mean over the sequence: the metric is linear in both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.first, self.second = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(self.embed(input_ids))).mean(dim=1)


def test_linear_model_estimate_is_the_exact_sweep() -> None:
    model = _Linear().requires_grad_(False)  # frozen weights and integer inputs: nothing needed
    clean = {"input_ids": torch.tensor([[1, 2, 3, 4]])}
    corrupted = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    def metric(output: torch.Tensor) -> torch.Tensor:
        return (output[:, 0] - 2 * output[:, 2]).mean()
    atp = hookscope.attribution_patching(model, clean, corrupted, metric,
                                         layers=["embed", "first"], positions=[0, -1])
    exact = hookscope.patching_sweep(model, clean, corrupted, layers=["embed", "first"],
                                     metric=metric, positions=[0, -1], progress=False)
    torch.testing.assert_close(atp.values, exact.values, rtol=1e-5, atol=1e-6)
    assert not any(p.requires_grad for p in model.parameters())


def test_minilm_ranks_agree_with_the_exact_sweep(minilm: LoadedModel) -> None:
    model, tokenizer = minilm.module, minilm.tokenizer
    clean = dict(tokenizer(["the cat sat on the mat"], return_tensors="pt"))
    corrupted = dict(tokenizer(["the dog sat on the rug"], return_tensors="pt"))
    torch.manual_seed(0)
    direction = torch.randn(384)
    def metric(output: Any) -> torch.Tensor:
        return (output.last_hidden_state[:, 0] @ direction).mean()
    layers = ["encoder.layer.0", "encoder.layer.2", "encoder.layer.5"]
    atp = hookscope.attribution_patching(model, clean, corrupted, metric, layers=layers)
    exact = hookscope.patching_sweep(model, clean, corrupted, layers=layers, metric=metric,
                                     progress=False)
    correlation = spearman(atp.values, exact.values)
    print(f"MiniLM AtP vs exact sweep: Spearman {correlation:.4f}")
    assert correlation > 0.7  # measured 0.843


def test_errors_say_what_to_do() -> None:
    model = tiny_gpt2(n_layer=3, pad=False)
    with pytest.raises(EditError, match=r"metric returned float.*no \.item\(\)"):
        hookscope.attribution_patching(model, CLEAN, CORRUPTED, lambda out: logit_diff(out).item(),
                                       layers="transformer.h.0")
    with pytest.raises(EditError, match=r"a tensor of shape \(2, 5, 60\)"):
        hookscope.attribution_patching(model, CLEAN, CORRUPTED, lambda out: out.logits,
                                       layers="transformer.h.0")
    with pytest.raises(hookscope.ArgumentValueError, match=r"positions holds 9, but the input has 5 "
                                                         r"tokens"):  # at the call (issue 26)
        hookscope.attribution_patching(model, CLEAN, CORRUPTED, logit_diff,
                                       layers="transformer.h.0", positions=[9])
