"""Named reductions: which axis each uses, values equal to plain PyTorch, and token reductions
refused (with the reason, nothing written) on outputs that have no token axis."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.cli.main import main
from hookscope.errors import ExtractError
from hookscope.record.reductions import ReductionError, reduction
from hookscope.store.extraction import extract
from tests.models import LeNet


def test_mean_uses_tokens_pixels_or_nothing_by_shape() -> None:
    mean = reduction("mean")
    assert mean is not None
    tokens, maps, flat = torch.randn(2, 5, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 7)
    torch.testing.assert_close(mean(tokens, None), tokens.mean(dim=1))
    torch.testing.assert_close(mean(maps, None), maps.mean(dim=(2, 3)))
    assert torch.equal(mean(flat, None), flat)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(mean(tokens, mask)[0], tokens[0, :2].mean(dim=0))


def test_first_and_last_take_real_tokens_of_dim_1() -> None:
    first, last = reduction("first"), reduction("last")
    assert first is not None and last is not None
    tokens = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])  # right- and left-padded
    assert torch.equal(first(tokens, None), tokens[:, 0])
    assert torch.equal(last(tokens, None), tokens[:, -1])
    assert torch.equal(last(tokens, mask), torch.stack([tokens[0, 2], tokens[1, 4]]))
    assert torch.equal(first(tokens, mask), torch.stack([tokens[0, 0], tokens[1, 1]]))


@pytest.mark.parametrize(("shape", "why"), [((2, 10), "no token axis"), ((2,), "no token axis"),
                                            ((2, 3, 4, 4), "dim 1 is channels of a feature map")])
@pytest.mark.parametrize("name", ["first", "last"])
def test_token_reductions_refuse_outputs_without_a_token_axis(shape: tuple[int, ...], why: str,
                                                              name: str) -> None:
    pick = reduction(name)
    assert pick is not None
    with pytest.raises(ReductionError, match=rf"reduce='{name}' takes the {name} token of a "
                                             rf"\(batch, seq, features\) output, but this "
                                             rf"output is .*\({why}\); use reduce='mean'"):
        pick(torch.randn(*shape), None)


@pytest.mark.parametrize("layer", ["fc2", "conv1"])
def test_extract_last_of_logits_or_maps_refuses_and_writes_nothing(tmp_path: Path,
                                                                   layer: str) -> None:
    with pytest.raises(ExtractError, match=r"reduce='last' takes the last token"):
        extract(LeNet().eval(), TensorDataset(torch.randn(4, 3, 32, 32)), layer, tmp_path / "s",
                reduce="last", progress=False)
    assert not (tmp_path / "s").exists()


def test_unknown_reduction_is_refused_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ReductionError, match=r"reduce='max' is not a reduction"):
        reduction("max")
    with pytest.raises(ReductionError, match=r"reduce=3 is a int"):
        reduction(3)  # type: ignore[arg-type]


def test_help_says_which_axis_each_reduction_uses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["extract", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "mean: over dim 1 of (batch, seq, d) tokens, over dims 2.. (pixels) of (batch, c, h, w)" \
        in text
    assert "first/last: first (CLS) / last real token, dim 1 of (batch, seq, d) only" in text


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add = nn.Identity()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.add(a + b)


def test_extract_tuple_batches_are_inputs_then_labels(tmp_path: Path) -> None:
    a, b, labels = torch.randn(5, 3), torch.randn(5, 3), torch.arange(5)
    batches = [((a[:3], b[:3]), labels[:3]), ((a[3:], b[3:]), labels[3:])]
    store = extract(_Pair(), batches, "add", tmp_path / "s", progress=False)
    assert torch.equal(store["add"][:], a + b)


def test_capture_takes_the_named_reductions_of_extract() -> None:
    import hookscope

    model, x = LeNet().eval(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        conv2 = model.conv2(model.pool(torch.relu(model.conv1(x))))  # (2, 16, 10, 10)
        with hookscope.capture(model, "conv2", "fc1", reduce="mean") as acts:
            model(x)
    torch.testing.assert_close(acts["conv2"], conv2.mean(dim=(2, 3)))  # (2, 16): over pixels
    assert acts["fc1"].shape == (2, 120)  # (batch, features) kept as is


def test_capture_checks_reduce_when_built() -> None:
    import hookscope

    model = LeNet()
    with pytest.raises(ReductionError, match=r"reduce='avg' is not a reduction: use one of "
                                             r"'mean', 'first', 'last'"):
        hookscope.capture(model, "conv2", reduce="avg")
    with pytest.raises(ReductionError, match=r"reduce='last' takes the last token"), \
            hookscope.capture(model, "conv2", reduce="last"):
        model(torch.randn(1, 3, 32, 32))
