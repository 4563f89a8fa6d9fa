"""positions.py: positions counted among real tokens, padding never selected, absolute on request."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hookscope.errors import PositionError
from hookscope.record.positions import resolve_positions, take_positions
from tests.models import padding_mask


@st.composite
def padded_batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[int], bool]:
    """(attention mask, real lengths, left-padded?) for a batch padded on one side."""
    seq = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(1, seq), min_size=1, max_size=4))
    left = draw(st.booleans())
    return padding_mask(lengths, seq, left), lengths, left


@settings(max_examples=60, deadline=None)
@given(padded_batches(), st.data())
def test_int_positions_land_on_real_tokens_of_either_padding(batch: tuple[torch.Tensor, list[int], bool],
                                                              data: st.DataObject) -> None:
    mask, lengths, left = batch
    shortest = min(lengths)
    positions = data.draw(st.lists(st.integers(-shortest, shortest - 1), min_size=1, max_size=3))
    rows, columns = resolve_positions(positions, mask.shape, mask)
    seq = mask.shape[1]
    expected = [(row, (seq - n if left else 0) + p % n) for row, n in enumerate(lengths) for p in positions]
    assert list(zip(rows.tolist(), columns.tolist())) == expected
    assert bool(mask[rows, columns].all())  # never a padding position


def test_last_token_of_right_and_left_padded_rows() -> None:
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = right.flip(1)
    t = torch.arange(2 * 5).reshape(2, 5, 1).float()
    assert take_positions(t, -1, right).flatten().tolist() == [2.0, 9.0]
    assert take_positions(t, -1, left).flatten().tolist() == [4.0, 9.0]
    assert take_positions(t, 0, left).flatten().tolist() == [2.0, 5.0]
    assert take_positions(t, -1, right, absolute=True).flatten().tolist() == [4.0, 9.0]
    assert take_positions(t, -1).flatten().tolist() == [4.0, 9.0]


def test_slice_and_none_select_real_tokens_only() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rows, columns = resolve_positions(slice(-2, None), (2, 3), mask)
    assert list(zip(rows.tolist(), columns.tolist())) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    rows, columns = resolve_positions(None, (2, 3), mask)
    assert list(zip(rows.tolist(), columns.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]


def test_boolean_mask_positions() -> None:
    rows, columns = resolve_positions(torch.tensor([True, False, True]), (2, 3))
    assert list(zip(rows.tolist(), columns.tolist())) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(PositionError, match=r"row 0, position 2 .*absolute=True"):
        resolve_positions(torch.tensor([True, False, True]), (2, 3), mask)
    rows, _ = resolve_positions(torch.tensor([True, False, True]), (2, 3), mask, absolute=True)
    assert rows.tolist() == [0, 0, 1, 1]
    with pytest.raises(PositionError, match=r"shape \(seq,\) = \(3,\)"):
        resolve_positions(torch.tensor([True, False]), (2, 3))


def test_errors_name_the_row_and_the_fix() -> None:
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    with pytest.raises(PositionError, match=r"position 1 does not exist in batch row 0, which has 1 "
                                            r"real tokens \(of 3\)"):
        resolve_positions([1], (2, 3), mask)
    with pytest.raises(PositionError, match=r"mask has shape \(2, 3\) .* \(2, 4\).*absolute=True"):
        resolve_positions(-1, (2, 4), mask)
    with pytest.raises(PositionError, match="has shape \\(4,\\), without one"):
        resolve_positions(-1, (4,), None)
    with pytest.raises(PositionError, match="give an int, a list of ints"):
        resolve_positions(["a"], (2, 3), None)  # type: ignore[list-item]


def test_int_likes_and_ranges_are_positions() -> None:
    import numpy as np

    mask = torch.tensor([[1, 1, 0]])
    expected = ([0], [1])
    for form in (np.int64(-1), torch.tensor(-1), [np.int32(-1)], torch.tensor([-1]), range(1, 2)):
        rows, columns = resolve_positions(form, (1, 3), mask)  # type: ignore[arg-type]
        assert (rows.tolist(), columns.tolist()) == expected, form
    with pytest.raises(PositionError, match="give an int"):
        resolve_positions([True], (1, 3), mask)
    with pytest.raises(PositionError, match="give an int"):
        resolve_positions(1.0, (1, 3), mask)  # type: ignore[arg-type]
