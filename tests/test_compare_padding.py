"""compare reads each output's real tokens by its layout and the run's attention mask, as every
verb does: what padding holds is not compared. GPT-2 with SDPA against the same weights with
eager attention on a padded batch agree to 1e-7 on every real token, but their padding rows
differ by 1e-2, so every layer from the first attention on was reported as diverging."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hookscope
from tests.models import padding_mask, tiny_gpt2

transformers = pytest.importorskip("transformers")

LAYERS = ["transformer.h.*.attn.c_proj", "transformer.h.*.mlp", "lm_head"]


@functools.cache
def _pair() -> tuple[Any, Any]:
    sdpa = tiny_gpt2()
    eager = tiny_gpt2()
    eager.config._attn_implementation = "eager"
    for layer in eager.transformer.h:
        layer.attn.config._attn_implementation = "eager"
    return sdpa, eager


def _outputs(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain PyTorch: each selected module's output, by forward hooks."""
    seen: dict[str, torch.Tensor] = {}
    handles = [module.register_forward_hook(
        lambda m, a, o, name=name: seen.__setitem__(name, o.detach()))
        for name, module in model.named_modules()
        if name == "lm_head" or name.endswith(("attn.c_proj", ".mlp"))]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3), st.integers(3, 6), st.booleans(), st.sampled_from([None, "auto"]), st.data())
def test_compare_reads_the_real_tokens_of_a_padded_batch(rows: int, seq: int, left: bool, pair: Any,
                                                         data: st.DataObject) -> None:
    """By names, and by pair='auto' (each pair's accumulated and local difference)."""
    lengths = [seq] + [data.draw(st.integers(1, seq)) for _ in range(rows - 1)]
    mask = padding_mask(lengths, seq, left)
    ids = torch.randint(1, 60, (rows, seq), generator=torch.Generator().manual_seed(seq))
    sdpa, eager = _pair()
    result = hookscope.compare(sdpa, eager, input_ids=ids, attention_mask=mask, layers=LAYERS,
                               pair=pair)
    a, b = _outputs(sdpa, ids, mask), _outputs(eager, ids, mask)
    real = mask.bool()
    assert {d.path for d in result.diffs} >= set(a)
    for diff in result.diffs:
        if diff.path not in a:
            continue
        expected = float((a[diff.path][real].double() - b[diff.path][real].double()).abs().max())
        assert diff.shape == tuple(a[diff.path].shape)
        assert diff.max_abs == pytest.approx(expected, abs=1e-12)
        assert diff.close
    assert result.first_divergent is None
    for paired in result.pairs:  # pair="auto": B's module on A's inputs is exact
        assert paired.local is not None and paired.local.close and paired.accumulated.close
