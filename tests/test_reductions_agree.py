"""One table of reduction names (issue 19): ``capture(reduce=name)``, ``extract(reduce=name)``
and ``--reduce`` read ``REDUCTIONS``, and a name gives the same rows everywhere: padding is left
out by the attention mask the model is called with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookscope
from hookscope.cli.main import build_parser
from hookscope.record.reductions import NAMES, REDUCTIONS, reduction
from tests.models import MaskedTokens, padding_mask


def _hand(model: MaskedTokens, ids: torch.Tensor, mask: torch.Tensor, name: str) -> torch.Tensor:
    """Each row's real tokens through embed and mix, reduced in plain torch: ``(batch, 8)``."""
    rows = []
    with torch.no_grad():
        for row in range(ids.shape[0]):
            tokens = model.mix(model.embed(ids[row][mask[row].bool()]))  # (real tokens, 8)
            rows.append({"mean": tokens.mean(0), "first": tokens[0], "last": tokens[-1]}[name])
    return torch.stack(rows)


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
@pytest.mark.parametrize("name", NAMES)
def test_capture_and_extract_give_the_same_rows(tmp_path: Path, name: str, left: bool) -> None:
    torch.manual_seed(0)
    model = MaskedTokens(30, 2).eval()
    mask = padding_mask([2, 5, 3], 5, left)
    ids = torch.randint(1, 30, (3, 5)) * mask
    expected = _hand(model, ids, mask, name)
    with torch.no_grad(), hookscope.capture(model, "mix", reduce=name) as by_keyword:
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad(), hookscope.capture(model, "mix", reduce=name) as by_position:
        model(ids, mask)
    store = hookscope.extract(model, [{"input_ids": ids, "attention_mask": mask}], "mix",
                              tmp_path / "s", reduce=name, progress=False)
    assert by_keyword["mix"].shape == (3, 8)
    torch.testing.assert_close(by_keyword["mix"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(by_position["mix"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(store["mix"][:], expected, rtol=1e-5, atol=1e-6)


def test_without_a_mask_every_position_counts() -> None:
    model, ids = MaskedTokens(30, 2).eval(), torch.randint(1, 30, (2, 4))
    with torch.no_grad():
        hidden = model.mix(model.embed(ids))
        with hookscope.capture(model.mix, "(root)", reduce="last") as acts:
            model.mix(model.embed(ids))
    torch.testing.assert_close(acts["(root)"], hidden[:, -1])


def test_one_table_of_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert NAMES == tuple(REDUCTIONS) == ("mean", "first", "last")
    assert all(reduction(name) is REDUCTIONS[name] for name in NAMES)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["extract", "m", "x", "--out", "o", "--reduce", "bogus"])
    listed = ", ".join(repr(n) for n in ("none", *NAMES))
    assert f"(choose from {listed})" in capsys.readouterr().err
