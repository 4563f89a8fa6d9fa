"""hookscope.extract: stored rows equal plain PyTorch, for every data form, reduce and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import hookscope
from hookscope.errors import ExtractError, SelectorError, StoreExistsError
from hookscope.store.extraction import extract
from tests.models import LeNet, MaskedTokens, ModuleListBlocks, TupleOutput


def _sentences(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 50, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def _token_batches(sentences: list[torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded tokenizer-like batches: ``input_ids`` and ``attention_mask`` (batch, seq)."""
    batches = []
    for i in range(0, len(sentences), size):
        group = sentences[i:i + size]
        seq = max(len(s) for s in group)
        ids = torch.zeros(len(group), seq, dtype=torch.int64)
        mask = torch.zeros(len(group), seq, dtype=torch.int64)
        for row, s in enumerate(group):
            ids[row, :len(s)], mask[row, :len(s)] = s, 1
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def _plain_mix(model: MaskedTokens, sentence: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.mix(model.embed(sentence))  # (tokens, 8), no padding anywhere


def test_rows_equal_plain_forward_across_many_shards(tmp_path: Path) -> None:
    model = LeNet().eval()
    images = torch.randn(50, 3, 32, 32)
    store = extract(model, TensorDataset(images), ["conv2", "fc1"], tmp_path / "s", batch_size=8,
                    shard_bytes=20_000, progress=False)
    assert len(store) == 50 and len(store.shards) > 3
    assert store.layers["conv2"].shape == (16, 10, 10) and store.layers["fc1"].shape == (120,)
    for start in range(0, 50, 8):  # same batches as the extraction: bitwise equal
        with torch.no_grad(), hookscope.capture(model, "conv2", "fc1") as acts:
            model(images[start:start + 8])
        assert torch.equal(store["conv2"][start:start + 8], acts["conv2"])
        assert torch.equal(store["fc1"][start:start + 8], acts["fc1"])


def test_ragged_tokens_are_stored_without_padding(tmp_path: Path) -> None:
    model, sentences = MaskedTokens(50, 3), _sentences(13)
    store = extract(model, _token_batches(sentences, 4), "mix", tmp_path / "s", progress=False)
    assert store.layers["mix"].ragged and store.layers["mix"].shape == (None, 8)
    rows = store["mix"][:]
    assert [len(r) for r in rows] == [len(s) for s in sentences]
    for row, sentence in zip(rows, sentences):
        torch.testing.assert_close(row, _plain_mix(model, sentence), rtol=1e-6, atol=1e-6)
    total_tokens = sum(len(s) for s in sentences)
    assert store.nbytes < total_tokens * 8 * 4 + 4096  # padding would cost 13 * 8 rows more


@pytest.mark.parametrize("reduce", ["mean", "first", "last"])
def test_named_reductions_honour_the_attention_mask(tmp_path: Path, reduce: str) -> None:
    model, sentences = MaskedTokens(50, 3), _sentences(10)
    store = extract(model, _token_batches(sentences, 4), "mix", tmp_path / "s", reduce=reduce,
                    progress=False)
    expected = {"mean": lambda t: t.mean(0), "first": lambda t: t[0], "last": lambda t: t[-1]}
    for i, sentence in enumerate(sentences):
        torch.testing.assert_close(store["mix"][i], expected[reduce](_plain_mix(model, sentence)),
                                   rtol=1e-5, atol=1e-6)


def test_mean_over_pixels_callable_reduce_and_dtype(tmp_path: Path) -> None:
    model = LeNet().eval()
    images = torch.randn(12, 3, 32, 32)
    with torch.no_grad(), hookscope.capture(model, "conv2") as acts:
        model(images)
    mean = extract(model, [images[:6], images[6:]], "conv2", tmp_path / "mean", reduce="mean",
                   progress=False)
    torch.testing.assert_close(mean["conv2"][:], acts["conv2"].mean(dim=(2, 3)))
    peak = extract(model, [images[:6], images[6:]], "conv2", tmp_path / "max", progress=False,
                   reduce=lambda t: t.amax(dim=(2, 3)), dtype=torch.float16)
    assert peak.layers["conv2"].dtype == torch.float16
    assert torch.equal(peak["conv2"][:], acts["conv2"].amax(dim=(2, 3)).half())


def test_every_data_form_gives_the_same_rows(tmp_path: Path) -> None:
    model = LeNet().eval()
    images, labels = torch.randn(10, 3, 32, 32), torch.arange(10)
    forms = {
        "dataloader": DataLoader(TensorDataset(images, labels), batch_size=5),
        "dataset": TensorDataset(images, labels),  # items (image, label), batched here
        "tensors": [images[:5], images[5:]],
        "generator": (images[i:i + 5] for i in (0, 5)),
        "dicts": [{"x": images[:5]}, {"x": images[5:]}],  # model(**batch)
    }
    stores = {name: extract(model, data, "fc2", tmp_path / name, batch_size=5, progress=False)
              for name, data in forms.items()}
    first = stores["dataloader"]["fc2"][:]
    assert first.shape == (10, 10)
    assert all(torch.equal(s["fc2"][:], first) for s in stores.values())


def test_model_mode_is_restored_and_no_hooks_remain(tmp_path: Path) -> None:
    model = LeNet().train()
    extract(model, [torch.randn(2, 3, 32, 32)], "fc1", tmp_path / "s", progress=False)
    assert model.training and not hookscope.hooks(model)


# ----------------------------------------------------------- bad input: nothing is written
def _nothing_written(out: Path) -> bool:
    return not out.exists()


class BrokenImages(Dataset[torch.Tensor]):
    """Like an image folder whose file 1 cannot be decoded."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1:
            raise OSError("cannot identify image file 'cat-1.jpg'")
        return torch.zeros(3, 32, 32)


def test_unknown_layer_fails_before_any_file(tmp_path: Path) -> None:
    out = tmp_path / "s"
    with pytest.raises(SelectorError, match="conv3"):
        extract(LeNet(), [torch.randn(2, 3, 32, 32)], "conv3", out, progress=False)
    assert _nothing_written(out)


def test_container_fails_before_any_file(tmp_path: Path) -> None:
    out = tmp_path / "s"
    with pytest.raises(SelectorError, match=r"pos_block\.\*"):
        extract(ModuleListBlocks(), [torch.randn(2, 8, 6, 6)], "pos_block", out, progress=False)
    assert _nothing_written(out)


def test_unreadable_input_fails_before_any_file(tmp_path: Path) -> None:
    out = tmp_path / "s"
    with pytest.raises(OSError, match="cat-1.jpg"):
        extract(LeNet(), BrokenImages(), "fc1", out, batch_size=2, progress=False)
    assert _nothing_written(out)


def test_existing_output_fails_and_stays_untouched(tmp_path: Path) -> None:
    out = tmp_path / "s"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    with pytest.raises(StoreExistsError, match=r"resume=True \(--resume\).*overwrite=True"):
        extract(LeNet(), [torch.randn(2, 3, 32, 32)], "fc1", out, progress=False)
    assert [p.name for p in out.iterdir()] == ["manifest.json"]
    assert (out / "manifest.json").read_text() == "{}"


def test_tuple_output_asks_for_a_part(tmp_path: Path) -> None:
    out = tmp_path / "s"
    with pytest.raises(ExtractError, match=r"name the part to keep, e\.g\. 'lstm\[0\]'"):
        extract(TupleOutput(), [torch.randn(2, 5, 4)], "lstm", out, progress=False)
    assert _nothing_written(out)
    store = extract(TupleOutput(), [torch.randn(2, 5, 4)], "lstm[0]", out, progress=False)
    assert store.layers["lstm[0]"].shape == (5, 6)


def test_shuffled_loader_and_bad_reduce_are_refused(tmp_path: Path) -> None:
    shuffled = DataLoader(TensorDataset(torch.randn(4, 3, 32, 32)), shuffle=True)
    with pytest.raises(ExtractError, match="pass shuffle=False"):
        extract(LeNet(), shuffled, "fc1", tmp_path / "a", progress=False)
    with pytest.raises(ExtractError,
                       match="reduce='max' is not a reduction: use one of 'mean', 'first', 'last'"):
        extract(LeNet(), [torch.randn(2, 3, 32, 32)], "fc1", tmp_path / "b", reduce="max")
    assert _nothing_written(tmp_path / "a") and _nothing_written(tmp_path / "b")


def test_rows_that_change_shape_name_the_batch_and_the_fix(tmp_path: Path) -> None:
    encoder = nn.Sequential(nn.Linear(4, 4))
    batches = [torch.randn(2, 3, 4), torch.randn(2, 5, 4)]  # sequences without a mask
    with pytest.raises(ExtractError, match=r"\(3, 4\) float32 and are \(5, 4\) float32 in "
                                           r"batch 1.*reduce='mean'"):
        extract(encoder, batches, "0", tmp_path / "s", progress=False)


def test_resume_of_a_finished_store_changes_nothing(tmp_path: Path) -> None:
    model, data = LeNet().eval(), [torch.randn(2, 3, 32, 32)] * 3
    out = tmp_path / "s"
    extract(model, data, "fc1", out, progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    store = extract(model, data, "fc1", out, resume=True, progress=False)
    assert len(store) == 6 and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ExtractError, match=r"reduce \(--reduce\) was None, now 'mean'.*overwrite=True"):
        extract(model, data, "fc1", out, resume=True, reduce="mean", progress=False)
