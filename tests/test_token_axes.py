"""positions= means tokens on every address: on ``path::scaled_dot_product_attention`` (output
``(batch, heads, query, head_dim)``) the edits and sweeps index the query axis, never the heads;
``heads=`` selects heads; a function's value of unknown layout needs ``seq_dim=`` (issue 25).

Every expected value is computed by wrapping ``F.scaled_dot_product_attention`` by hand (the
GPT-2 of transformers calls it through ``torch.nn.functional`` at call time) and editing the
tensor it returns with plain indexing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import PositionError
from tests.functional_models import EagerSelfAttention
from tests.models import tiny_gpt2

transformers = pytest.importorskip("transformers")

SDPA = "transformer.h.0.attn::scaled_dot_product_attention"
IDS = torch.tensor([[3, 9, 14, 2, 8], [4, 1, 22, 7, 30]])  # 5 tokens; 4 heads


def by_hand(model: nn.Module, ids: dict[str, torch.Tensor], change: Callable[[torch.Tensor], Any],
            monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """Logits with ``change`` applied in place to the value of the first SDPA call (layer 0)."""
    original = F.scaled_dot_product_attention
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            out = out.clone()
            change(out)
        return out

    with monkeypatch.context() as patched:
        patched.setattr(torch.nn.functional, "scaled_dot_product_attention", wrapped)
        with torch.no_grad():
            logits = model(**ids).logits
    assert len(calls) == 2  # both layers ran SDPA
    return logits


def test_steer_last_position_is_the_last_token_not_the_last_head(monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    model, vector = tiny_gpt2(pad=False), torch.randn(8)
    with hookscope.steer(model, {SDPA: vector}, positions=-1), torch.no_grad():
        got = model(input_ids=IDS).logits

    def change(out: torch.Tensor) -> None:
        assert out.shape == (2, 4, 5, 8)
        out[:, :, -1] += vector  # the last query (token), every head
    torch.testing.assert_close(got, by_hand(model, {"input_ids": IDS}, change, monkeypatch))


@settings(max_examples=6, deadline=None)
@given(heads=st.lists(st.integers(-4, 3), min_size=1, max_size=3, unique_by=lambda h: h % 4),
       position=st.integers(-5, 4))
def test_ablate_heads_at_a_position_of_a_left_padded_batch(heads: list[int], position: int) -> None:
    model = tiny_gpt2(pad=False)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # row 1 has 3 real tokens
    ids = {"input_ids": IDS, "attention_mask": mask}
    real = [list(range(5)), [2, 3, 4]]
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not -3 <= position < 3:  # row 1 lacks it
            with hookscope.ablate(model, SDPA, positions=position, heads=heads), \
                    pytest.raises(PositionError, match=f"position {position} does not exist in "
                                                       f"batch row 1, which has 3 real tokens"):
                model(**ids)
            return
        with hookscope.ablate(model, SDPA, positions=position, heads=heads), torch.no_grad():
            got = model(**ids).logits

        def change(out: torch.Tensor) -> None:
            for row in range(2):
                out[row, heads, real[row][position]] = 0
        torch.testing.assert_close(got, by_hand(model, ids, change, monkeypatch))


def test_patch_heads_from_a_prompt_of_another_length(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_gpt2(pad=False)
    clean = torch.tensor([[5, 6, 7, 8, 9, 10]])  # 6 tokens
    with hookscope.capture(model, SDPA) as acts, torch.no_grad():
        model(input_ids=clean)
    source = acts[SDPA]
    corrupted = IDS[:1]
    with hookscope.patch(model, source=acts, layers=SDPA, positions=[-1], heads=[2, 0]), \
            torch.no_grad():
        got = model(input_ids=corrupted).logits

    def change(out: torch.Tensor) -> None:
        out[:, [2, 0], -1] = source[:, [2, 0], -1]
    torch.testing.assert_close(got, by_hand(model, {"input_ids": corrupted}, change, monkeypatch))
    with hookscope.patch(model, source=acts, layers=SDPA, positions=-1, heads=9), pytest.raises(
            PositionError, match="head 9 does not exist in 'transformer.h.0.attn::scaled_dot_"
                                 "product_attention', which has 4 heads: use -4 … 3"):
        model(input_ids=corrupted)


def test_heads_on_a_module_output_is_refused_naming_the_sdpa_address() -> None:
    model = tiny_gpt2(pad=False)
    with hookscope.ablate(model, "transformer.h.0.attn[0]", heads=1), pytest.raises(
            PositionError, match=r"heads= on 'transformer.h.0.attn\[0\]', shape \(2, 5, 32\): "
                                 r".*select the attention's 'transformer.h.0.attn::scaled_dot_"
                                 r"product_attention'"):
        model(input_ids=IDS)


class EagerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = EagerSelfAttention(d=16, heads=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def test_a_function_of_unknown_layout_needs_seq_dim() -> None:
    model, x = EagerModel().eval(), torch.randn(2, 5, 16)
    with hookscope.ablate(model, "attn::softmax", positions=-1), pytest.raises(
            PositionError, match=r"positions on 'attn::softmax': it is the value of the function "
                                 r"softmax, shape \(2, 4, 5, 5\).*give seq_dim=N"):
        model(x)
    with hookscope.ablate(model, "attn::softmax", positions=-1, seq_dim=2), torch.no_grad():
        got = model(x)
    attn = model.attn
    with torch.no_grad():  # the same forward by hand, query -1 of the probabilities zeroed
        q, k, v = attn.split(x)
        probs = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(dim=-1)
        probs[:, :, -1] = 0
        expected = attn.out((probs @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, expected)
    with hookscope.ablate(model, "attn::softmax", positions=0, seq_dim=0), pytest.raises(
            PositionError, match=r"seq_dim=0 is not a token axis of 'attn::softmax', shape "
                                 r"\(2, 4, 5, 5\): give a dim in 0 … 3 other than 0, the batch"):
        model(x)


def sdpa_sweep_by_hand(model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor,
                       metric: Callable[[Any], torch.Tensor], position: int, head: int | None,
                       monkeypatch: pytest.MonkeyPatch) -> float:
    with hookscope.capture(model, SDPA) as acts, torch.no_grad():
        model(input_ids=clean)
    source = acts[SDPA]

    def change(out: torch.Tensor) -> None:
        heads = slice(None) if head is None else head
        out[:, heads, position] = source[:, heads, position]
    logits = by_hand(model, {"input_ids": corrupted}, change, monkeypatch)
    return float(metric(transformers.modeling_outputs.CausalLMOutput(logits=logits)))


def metric(output: Any) -> torch.Tensor:
    return (output.logits[:, -1, 5] - output.logits[:, -1, 7]).mean()


def test_sweep_over_sdpa_covers_tokens_and_each_head(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_gpt2(pad=False)
    clean, corrupted = IDS, torch.tensor([[3, 9, 40, 2, 8], [4, 1, 41, 7, 30]])
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers=SDPA, metric=metric,
                                     batch_size=3, progress=False)
    assert sweep.positions == [0, 1, 2, 3, 4]  # the 5 tokens, not the 4 heads
    expected = [sdpa_sweep_by_hand(model, clean, corrupted, metric, p, None, monkeypatch)
                for p in range(5)]
    torch.testing.assert_close(sweep.values, torch.tensor([expected], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    by_head = hookscope.patching_sweep(model, clean, corrupted, layers=SDPA, metric=metric,
                                       positions=[2, -1], heads=True, progress=False)
    assert by_head.values.shape == (1, 2, 4) and by_head.heads == [0, 1, 2, 3]
    expected_heads = [[sdpa_sweep_by_hand(model, clean, corrupted, metric, p, h, monkeypatch)
                       for h in range(4)] for p in (2, -1)]
    torch.testing.assert_close(by_head.values, torch.tensor([expected_heads], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    assert by_head.table().splitlines()[4].startswith(f"{SDPA} head 3")
    with pytest.raises(PositionError, match=r"heads= on 'transformer.h.0.mlp'"):
        hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.0.mlp",
                                 metric=metric, heads=True, progress=False)


def test_sweep_names_the_positions_a_longer_corrupted_input_leaves_out() -> None:
    model = tiny_gpt2(pad=False)
    clean, corrupted = IDS[:1], torch.tensor([[3, 9, 40, 2, 8, 11]])
    with pytest.warns(UserWarning, match=r"covers positions 0 … 4: the corrupted input has 6 "
                                         r"tokens and the clean one 5, so positions 5 … 5"):
        sweep = hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.0",
                                         metric=metric, progress=False)
    assert sweep.positions == [0, 1, 2, 3, 4]


def test_normalized_metric_and_token_labels(tmp_path: Any) -> None:
    model = tiny_gpt2(pad=False)
    clean, corrupted = IDS[:1], torch.tensor([[3, 9, 40, 2, 8]])
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.*",
                                     metric=metric, progress=False)
    expected = (sweep.values - sweep.corrupted) / (sweep.clean - sweep.corrupted)
    torch.testing.assert_close(sweep.normalized(), expected)
    assert sweep.normalized()[1, 4].item() == pytest.approx(1.0, abs=1e-4)  # last block, last token
    png = sweep.plot(tmp_path / "s.png", tokens=list("abcde"), normalized=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(hookscope.HookscopeError, match="tokens has 2 labels for 5 positions"):
        sweep.plot(tmp_path / "t.png", tokens=["a", "b"])

