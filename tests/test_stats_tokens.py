"""stats counts the real tokens of each value by its layout (``engine.values.layout``), as every other
verb does: the query axis of ``scaled_dot_product_attention``'s ``(batch, heads, query,
head_dim)``, never its heads (a batch whose length equals the head count had its heads dropped
as padding, with no error), and a padded batch without a mask is refused, not counted."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hookscope
from hookscope.errors import PositionError
from tests.models import padding_mask, tiny_gpt2
from tests.test_layouts import PlainSDPA

SDPA = "transformer.h.0.attn::scaled_dot_product_attention"
BLOCK = "transformer.h.1.mlp"


@functools.cache
def _model() -> Any:
    return tiny_gpt2().eval()  # 4 heads


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(3, 5), st.booleans(), st.data())
def test_stats_count_the_real_tokens_of_each_layout(rows: int, seq: int, left: bool,
                                                    data: st.DataObject) -> None:
    lengths = [data.draw(st.integers(1, seq)) for _ in range(rows)]
    mask = padding_mask(lengths, seq, left)
    ids = torch.randint(1, 60, (rows, seq), generator=torch.Generator().manual_seed(seq))
    model = _model()
    results = hookscope.stats(model, [{"input_ids": ids, "attention_mask": mask}], [SDPA, BLOCK])
    plain_block: list[torch.Tensor] = []
    handle = model.transformer.h[1].mlp.register_forward_hook(
        lambda m, a, o: plain_block.append(o.detach()))
    try:
        with torch.no_grad(), PlainSDPA() as plain:
            model(input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    real = mask.bool()
    sdpa = plain.outputs[0].transpose(1, 2)[real]  # (tokens, heads, head_dim)
    block = plain_block[0][real]  # (tokens, d_model)
    for key, kept in ((SDPA, sdpa), (BLOCK, block)):
        assert int(results[key].count.sum()) == kept.numel()
        torch.testing.assert_close(float(results[key].mean), float(kept.double().mean()))
        torch.testing.assert_close(float(results[key].max), float(kept.max()))


@pytest.mark.parametrize("reduce", ["first", "last", "mean"])
def test_token_verbs_refuse_a_padded_batch_without_its_mask(reduce: str, tmp_path: Path) -> None:
    """stats, capture's and extract's token reductions (extract took the padding for the last
    token, with no error): refused, no store left behind; a batch without padding runs."""
    ids = torch.tensor([[5, 6, 7, 0, 0, 0], [5, 6, 7, 8, 9, 10]])  # pad id 0 (tiny_gpt2)
    model = _model()
    fix = r"pass the tokenizer's attention_mask"
    with pytest.raises(PositionError, match=fix):
        hookscope.stats(model, [{"input_ids": ids}], BLOCK)
    with pytest.raises(PositionError, match=fix):
        with torch.no_grad(), hookscope.capture(model, BLOCK, reduce=reduce):
            model(input_ids=ids)
    with pytest.raises(PositionError, match=fix):
        hookscope.extract(model, [{"input_ids": ids}], BLOCK, tmp_path / "store", reduce=reduce,
                          progress=False)
    assert list(tmp_path.iterdir()) == []
    one_row = hookscope.stats(model, [{"input_ids": ids[1:]}], BLOCK)  # no padding: counted
    assert int(one_row[BLOCK].count.sum()) == 6 * 32
    store = hookscope.extract(model, [{"input_ids": ids[1:]}], BLOCK, tmp_path / "one", reduce=reduce,
                              progress=False)
    assert tuple(store[BLOCK][:].shape) == (1, 32)
