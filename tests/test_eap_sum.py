"""Edge attribution patching's score is a sum over the batch's rows, the positions and the
channels (issue 45, item 4): ``per_position=True`` keeps the per-position scores, which sum to
``scores``; the edge ``input -> m0`` (block 0's MLP input) is checked against a hand
computation with plain hooks on a tiny GPT-2 built from its config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0,
        eos_token_id=0)).eval()


CLEAN = torch.tensor([[3, 9, 14, 2], [4, 1, 22, 7]])
CORRUPTED = torch.tensor([[3, 30, 14, 2], [4, 1, 35, 7]])


def _metric(out: object) -> torch.Tensor:
    return (out.logits[:, -1, 5] - out.logits[:, -1, 7]).mean()  # type: ignore[attr-defined]


def _by_hand(model: nn.Module) -> torch.Tensor:
    """``(seq,)``: sum over rows and channels of (embeddings clean - corrupted) times d metric /
    d (block 0's MLP norm's input, as the MLP reads it) on the corrupted run, by plain hooks."""
    kept: dict[str, torch.Tensor] = {}
    handle = model.transformer.drop.register_forward_hook(
        lambda m, a, out: kept.__setitem__("emb", out.detach()))
    with torch.no_grad():
        model(CLEAN)
    clean = kept["emb"]

    def pre(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # a zero added to the norm's input: its gradient is the MLP's reading alone, not the
        # residual stream's skip path around it
        kept["mlp_in"] = torch.zeros_like(args[0], requires_grad=True)
        return (args[0] + kept["mlp_in"], *args[1:])
    pre_handle = model.transformer.h[0].ln_2.register_forward_pre_hook(pre)
    try:
        _metric(model(CORRUPTED)).backward()
    finally:
        handle.remove()
        pre_handle.remove()
        model.zero_grad(set_to_none=True)
    grad = kept["mlp_in"].grad
    assert grad is not None
    return ((clean - kept["emb"]).double() * grad.double()).sum(dim=(0, 2))


@pytest.mark.parametrize("steps", [None, 3])
def test_the_scores_are_the_per_position_scores_summed(gpt2: nn.Module, steps: int | None) -> None:
    edges = hookscope.edge_attribution_patching(gpt2, CLEAN, CORRUPTED, _metric, steps=steps,
                                                per_position=True)
    assert edges.position_scores is not None
    assert edges.position_scores.shape == (*edges.scores.shape, 4)
    torch.testing.assert_close(edges.position_scores.sum(-1), edges.scores, equal_nan=True,
                               rtol=1e-12, atol=1e-12)
    plain = hookscope.edge_attribution_patching(gpt2, CLEAN, CORRUPTED, _metric, steps=steps)
    assert plain.position_scores is None
    torch.testing.assert_close(plain.scores, edges.scores, equal_nan=True, rtol=1e-12, atol=1e-12)


def test_the_input_to_mlp_edge_sums_over_rows_and_positions_by_hand(gpt2: nn.Module) -> None:
    edges = hookscope.edge_attribution_patching(gpt2, CLEAN, CORRUPTED, _metric, per_position=True)
    assert edges.position_scores is not None
    at = (edges.upstream.index("input"), edges.downstream.index("m0"))
    expected = _by_hand(gpt2)
    torch.testing.assert_close(edges.position_scores[at], expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(edges.scores[at], expected.sum(), rtol=1e-5, atol=1e-7)
    # the tokens differ at positions 1 and 2 only: the other positions add nothing
    assert expected[[0, 3]].abs().max() < 1e-12 < expected[[1, 2]].abs().min()


def test_per_position_must_be_a_bool(gpt2: nn.Module) -> None:
    with pytest.raises(hookscope.HookscopeError, match="per_position"):
        hookscope.edge_attribution_patching(gpt2, CLEAN, CORRUPTED, _metric,
                                            per_position="yes")  # type: ignore[arg-type]
