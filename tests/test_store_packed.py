"""Packed windows (issue 49 item 3): ``(batch, seq)`` token ids without an attention mask, as
SAE training data is usually cut, given as a tensor or as a dict holding ``input_ids`` only,
are stored with their ids, so ``store.tokens(layer)`` flattens them and a token stream reads
them. Values are checked against the embedding table indexed by the ids (plain torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hookscope.errors import StoreError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store

SEQ, WINDOWS, VOCAB = 6, 23, 40
IDS = torch.randint(0, VOCAB, (WINDOWS, SEQ), generator=torch.Generator().manual_seed(1))


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class _Dicts(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return WINDOWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": IDS[i]}


@pytest.fixture(scope="module", params=["tensor", "dict"])
def made(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    torch.manual_seed(0)
    model, out = _Embed(), tmp_path_factory.mktemp("packed") / "store"
    data: Any = TensorDataset(IDS) if request.param == "tensor" else _Dicts()
    extract(model, data, "embed", out, batch_size=4, shard_bytes=500, progress=False)
    return out, model.embed.weight.detach()


def test_packed_windows_keep_their_ids_and_flatten(made: tuple[Path, torch.Tensor]) -> None:
    folder, weight = made
    store = open_store(folder)
    assert len(store.shards) > 2 and not store.layers["embed"].ragged
    assert torch.equal(store["embed"][:], weight[IDS])  # the rows are the windows, as before
    view = store.tokens("embed")
    assert len(view) == WINDOWS * SEQ
    assert torch.equal(view[:], weight[IDS.reshape(-1)])
    assert torch.equal(view.ids, IDS.reshape(-1))  # type: ignore[arg-type]
    assert torch.equal(view.rows, torch.arange(WINDOWS).repeat_interleave(SEQ))
    kept = store.tokens("embed", exclude=[0, 1, 2])
    keep = ~torch.isin(IDS.reshape(-1), torch.tensor([0, 1, 2]))
    assert torch.equal(kept[:], weight[IDS.reshape(-1)[keep]])


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, WINDOWS * SEQ), length=st.integers(0, 40))
def test_any_span_of_tokens_crosses_rows_and_shards(made: tuple[Path, torch.Tensor], start: int,
                                                    length: int) -> None:
    folder, weight = made
    view = open_store(folder).tokens("embed")
    flat = weight[IDS.reshape(-1)]
    assert torch.equal(view[start:start + length], flat[start:start + length])


def test_the_stream_reads_every_packed_token_once(made: tuple[Path, torch.Tensor]) -> None:
    folder, weight = made
    stream = open_store(folder).tokens("embed").stream(buffer_tokens=16, block_tokens=4, seed=2)
    got = torch.cat(list(DataLoader(stream, batch_size=5)))
    flat = weight[IDS.reshape(-1)]
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, flat.tolist()))


def test_windows_of_another_length_than_the_layer_have_no_token_view(tmp_path: Path) -> None:
    """A layer whose rows are not per token (a mean over the window) keeps no ids and is
    refused by name."""
    model = nn.Sequential(nn.Embedding(VOCAB, 4))
    store = extract(model, TensorDataset(IDS), "0", tmp_path / "s", reduce="mean",
                    batch_size=4, progress=False)
    assert "token" not in store.columns
    with pytest.raises(StoreError, match=r"layer '0' is not ragged.*no token ids"):
        store.tokens("0")


def test_a_token_probe_reads_packed_windows(made: tuple[Path, torch.Tensor]) -> None:
    """A label per token that its embedding's feature 0 decides (computed from the table): a
    probe of each token finds it (accuracy 1 on held-out tokens, the majority below 0.8)."""
    from hookscope.store import probe

    folder, weight = made
    labels = (weight[IDS.reshape(-1), 0] > 0).long().tolist()
    result = probe(folder, tokens=True, labels=labels, max_iter=50)
    assert result["embed"].accuracy == 1.0 and result["embed"].chance < 0.8
    assert result.train_rows + result.test_rows == WINDOWS * SEQ
