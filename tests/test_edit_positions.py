"""positions= in steer, ablate and patch: counted among real tokens when the model is called
with an attention mask (right- or left-padded), absolute on request; patch maps positions and
layers between runs of different lengths. Values are checked against plain forward hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import EditError, PositionError
from tests.models import padding_mask


class Tagger(nn.Module):
    """Token model taking an attention mask, like a transformers encoder: (batch, seq) -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.mix = nn.Linear(4, 4)
        self.mix2 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.mix2(self.mix(self.emb(input_ids))))


def with_hook(model: Tagger, module: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    handle = module.register_forward_hook(lambda mod, a, output: fn(output.clone()))
    try:
        return model(*args, **kwargs)
    finally:
        handle.remove()


RIGHT = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
IDS = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])


def test_steer_last_position_of_right_padded_batch_is_the_last_real_token() -> None:
    """Issue 15: positions=[-1] edited the padding column 4 of row 0; now column 2."""
    model, v = Tagger(), torch.tensor([1.0, -2.0, 3.0, 0.5])

    def expected_edit(output: torch.Tensor) -> torch.Tensor:
        output[0, 2] += v
        output[1, 4] += v
        return output

    expected = with_hook(model, model.mix, expected_edit, IDS, attention_mask=RIGHT)
    with hookscope.steer(model, {"mix": v}, positions=[-1]) as edit:
        got = model(IDS, attention_mask=RIGHT)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert edit.counts == {"mix": 1}
    with hookscope.steer(model, {"mix": v}, positions=[-1]):
        positional = model(IDS, RIGHT)  # the mask passed by position is found by name too
    torch.testing.assert_close(positional, expected, rtol=0, atol=0)


def test_left_padding_and_absolute_positions() -> None:
    model, v = Tagger(), torch.ones(4)
    left, ids = RIGHT.flip(1), IDS.flip(1)

    def first_real(output: torch.Tensor) -> torch.Tensor:
        output[0, 2] += v
        output[1, 0] += v
        return output

    def absolute_zero(output: torch.Tensor) -> torch.Tensor:
        output[:, 0] += v
        return output

    with hookscope.steer(model, {"mix": v}, positions=0):
        got = model(ids, attention_mask=left)
    torch.testing.assert_close(got, with_hook(model, model.mix, first_real, ids, attention_mask=left),
                               rtol=0, atol=0)
    with hookscope.steer(model, {"mix": v}, positions=0, absolute=True):
        got = model(ids, attention_mask=left)
    torch.testing.assert_close(got, with_hook(model, model.mix, absolute_zero, ids), rtol=0, atol=0)
    # an explicit mask wins over none given to the model
    with hookscope.steer(model, {"mix": v}, positions=0, attention_mask=left):
        got = model(ids)
    torch.testing.assert_close(got, with_hook(model, model.mix, first_real, ids), rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.booleans(), st.data())
def test_ablate_zero_at_positions_never_touches_padding(lengths: list[int], left: bool,
                                                        data: st.DataObject) -> None:
    model = Tagger()
    seq = max(lengths)
    mask = padding_mask(lengths, seq, left)
    ids = torch.randint(1, 20, mask.shape) * mask
    p = data.draw(st.integers(-min(lengths), min(lengths) - 1))

    def zero_at(output: torch.Tensor) -> torch.Tensor:
        for row, n in enumerate(lengths):
            output[row, (seq - n if left else 0) + p % n] = 0
        return output

    with torch.no_grad():
        expected = with_hook(model, model.mix, zero_at, ids, attention_mask=mask)
        with hookscope.ablate(model, "mix", positions=p):
            got = model(ids, attention_mask=mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_patch_last_token_between_prompts_of_different_lengths() -> None:
    model = Tagger()
    clean_ids = torch.tensor([[3, 4, 5, 6, 7]])
    corrupt_ids = torch.tensor([[9, 8, 2]])
    with hookscope.capture(model, "mix") as clean:
        model(clean_ids)
    source = clean["mix"]

    def last_from_clean(output: torch.Tensor) -> torch.Tensor:
        output[:, 2] = source[:, 4]
        output[:, 0] = source[:, 1]
        return output

    expected = with_hook(model, model.mix, last_from_clean, corrupt_ids)
    with hookscope.patch(model, source=clean, layers="mix", positions={-1: -1, 0: 1}):
        got = model(corrupt_ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(EditError, match="give positions=... to patch chosen positions"):
        with hookscope.patch(model, source=clean, layers="mix"):
            model(corrupt_ids)


def test_patch_padded_source_counts_its_own_real_tokens() -> None:
    model = Tagger()
    with hookscope.capture(model, "mix") as clean:
        model(IDS, attention_mask=RIGHT)
    source = clean["mix"]
    corrupt = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def last(output: torch.Tensor) -> torch.Tensor:
        output[0, 2] = source[0, 2]  # row 0 of the source has 3 real tokens
        output[1, 2] = source[1, 4]
        return output

    expected = with_hook(model, model.mix, last, corrupt)
    with hookscope.patch(model, source=clean, layers="mix", positions=-1, source_attention_mask=RIGHT):
        got = model(corrupt)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_patch_from_another_layer() -> None:
    model = Tagger()
    x = torch.tensor([[1, 2, 3]])
    with hookscope.capture(model, "mix") as source:
        model(x)
    taken = source["mix"]
    expected = with_hook(model, model.mix2, lambda out: taken.clone(), x)
    with hookscope.patch(model, source=source, layers={"mix2": "mix"}):
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with hookscope.patch(model, source=source, layers="mix2", source_layers="mix"):
        again = model(x)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    with pytest.raises(EditError, match="one source pattern per pattern"):
        hookscope.patch(model, source=source, layers=["mix2", "head"], source_layers="mix")
    with pytest.raises(EditError, match=r"'mix\*' selects 2 modules but its source 'head' selects 1"):
        hookscope.patch(model, source=source, layers={"mix*": "head"})


def test_missing_position_names_the_row() -> None:
    model = Tagger()
    with pytest.raises(PositionError, match=r"position 3 does not exist in batch row 0, which has 3 real"):
        with hookscope.steer(model, {"mix": torch.ones(4)}, positions=3):
            model(IDS, attention_mask=RIGHT)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_patch_maps_positions_between_differently_padded_runs(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 3))
    src_lengths = data.draw(st.lists(st.integers(1, 5), min_size=batch, max_size=batch))
    dst_lengths = data.draw(st.lists(st.integers(1, 5), min_size=batch, max_size=batch))
    src_seq = max(src_lengths) + data.draw(st.integers(0, 1))
    src_mask = padding_mask(src_lengths, src_seq, data.draw(st.booleans()))
    dst_mask = padding_mask(dst_lengths, max(dst_lengths), data.draw(st.booleans()))
    p = data.draw(st.integers(-min(dst_lengths), min(dst_lengths) - 1))
    q = data.draw(st.integers(-min(src_lengths), min(src_lengths) - 1))
    model = Tagger()
    src_ids, dst_ids = torch.randint(1, 20, src_mask.shape), torch.randint(1, 20, dst_mask.shape)
    with torch.no_grad():
        with hookscope.capture(model, "mix") as clean:
            model(src_ids, attention_mask=src_mask)
        source = clean["mix"]

        def by_hand(output: torch.Tensor) -> torch.Tensor:
            for row in range(batch):
                dst_real = dst_mask[row].nonzero().flatten().tolist()
                src_real = src_mask[row].nonzero().flatten().tolist()
                output[row, dst_real[p]] = source[row, src_real[q]]
            return output

        expected = with_hook(model, model.mix, by_hand, dst_ids, attention_mask=dst_mask)
        with hookscope.patch(model, source=clean, layers="mix", positions={p: q},
                             source_attention_mask=src_mask):
            got = model(dst_ids, attention_mask=dst_mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
