"""Token views for SAE training (issue 33): token ids stored beside token activations, the flat
``store.tokens(layer)`` view (padding and chosen special tokens left out), ragged rows through a
DataLoader, and the shuffled, resumable token stream: its order equals a shuffle computed here
by hand from the same seed, a restart from ``state_dict()`` gives the same remaining tokens,
and at most one window of tokens is read into memory at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hookscope.errors import StoreError
from hookscope.store import pad_rows
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from hookscope.store.tokens import TokenStream

BOS, SEQ, ROWS = 1, 9, 37


class _Tokens(Dataset[dict[str, torch.Tensor]]):
    """Rows of 2..SEQ real tokens starting with BOS; odd rows padded on the left, even on the
    right (pad id 0)."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = 2 + (i * 5) % (SEQ - 1)
        real = torch.cat([torch.tensor([BOS]), 2 + torch.randint(0, 60, (n - 1,),
                                                                 generator=torch.Generator().manual_seed(i))])
        ids, mask = torch.zeros(SEQ, dtype=torch.int64), torch.zeros(SEQ, dtype=torch.int64)
        where = slice(SEQ - n, SEQ) if i % 2 else slice(0, n)
        ids[where], mask[where] = real, 1
        return {"input_ids": ids, "attention_mask": mask}


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 6), nn.Linear(6, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(dim=1))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, _Encoder]:
    torch.manual_seed(0)
    model, out = _Encoder(), tmp_path_factory.mktemp("tokens") / "store"
    extract(model, _Tokens(), ["embed", "head"], out, batch_size=4, shard_bytes=1500,
            progress=False)
    return out, model


def _real(i: int) -> torch.Tensor:
    item = _Tokens()[i]
    return item["input_ids"][item["attention_mask"].bool()]


def test_token_ids_are_stored_aligned_with_the_token_rows(made: tuple[Path, _Encoder]) -> None:
    store = open_store(made[0])
    assert len(store.shards) > 3 and store.columns["token"].ragged
    ids = store.token_ids
    assert ids is not None and len(ids) == ROWS
    weight = made[1].embed.weight.detach()
    for i in range(ROWS):
        assert torch.equal(ids[i], _real(i))
        assert torch.equal(store["embed"][i], weight[_real(i)])  # an embedding row is its id's
    assert "tokens: token ids" in repr(store)
    assert store.labels is None and torch.equal(store.ids, torch.arange(ROWS))


def test_the_flat_token_view_leaves_out_padding_and_chosen_tokens(
        made: tuple[Path, _Encoder]) -> None:
    store, weight = open_store(made[0]), made[1].embed.weight.detach()
    every = torch.cat([_real(i) for i in range(ROWS)])
    view = store.tokens("embed")
    assert len(view) == len(every) and torch.equal(view[:], weight[every])
    assert view.ids is not None and torch.equal(view.ids, every)
    no_bos = store.tokens("embed", exclude=[BOS])
    kept = every[every != BOS]
    assert len(no_bos) == len(every) - ROWS == len(kept)
    assert torch.equal(no_bos[:], weight[kept]) and torch.equal(no_bos.ids, kept)  # type: ignore[arg-type]
    assert torch.equal(no_bos[5], weight[kept[5]]) and torch.equal(no_bos[-1], weight[kept[-1]])
    assert torch.equal(no_bos[10:30], weight[kept[10:30]])
    rows = torch.cat([torch.full((len(_real(i)) - 1,), i) for i in range(ROWS)])
    assert torch.equal(no_bos.rows, rows)
    with pytest.raises(StoreError, match=r"layer 'head' is not ragged .* store\['head'\]"):
        store.tokens("head")


def test_ragged_rows_through_a_dataloader(made: tuple[Path, _Encoder]) -> None:
    store, weight = open_store(made[0]), made[1].embed.weight.detach()
    with pytest.raises(StoreError, match=r"layer 'embed' is ragged: .*stack expects each tensor "
                                         r"to be equal size.*ragged=True\), "
                                         r"collate_fn=hookscope.store.pad_rows"):
        store.dataset("embed")
    loader = DataLoader(store.dataset("embed", ragged=True), batch_size=5, collate_fn=pad_rows)
    padded, mask = next(iter(loader))
    longest = max(len(_real(i)) for i in range(5))
    assert padded.shape == (5, longest, 6) and mask.shape == (5, longest)
    for i in range(5):
        n = len(_real(i))
        assert mask[i].tolist() == [True] * n + [False] * (longest - n)
        assert torch.equal(padded[i, :n], weight[_real(i)]) and not padded[i, n:].any()
    assert len(list(DataLoader(store.dataset("head"), batch_size=8))) == 5  # fixed: as before
    for wrong in (["head"], 0, None):  # the attack: a list was a raw "unhashable type: 'list'"
        with pytest.raises(StoreError, match=r"a store's layer is named by a str; .*'embed'"):
            store.dataset(wrong)  # type: ignore[arg-type]


def _by_hand(tokens: torch.Tensor, seed: int, block: int, buffer: int) -> torch.Tensor:
    """The stream's order (TokenStream's docstring), computed from the same seed with numpy."""
    n = len(tokens)
    blocks = np.random.default_rng([seed, 0]).permutation(-(-n // block))
    per, order = buffer // block, []
    for w in range(0, len(blocks), per):
        window = np.concatenate([np.arange(b * block, min(b * block + block, n))
                                 for b in blocks[w:w + per]])
        order.append(window[np.random.default_rng([seed, 0, w // per]).permutation(len(window))])
    return tokens[torch.from_numpy(np.concatenate(order))]


def _read(stream: TokenStream, batches: int | None = None) -> torch.Tensor:
    got = []
    for k, batch in enumerate(DataLoader(stream, batch_size=7)):
        got.append(batch)
        if batches is not None and k + 1 == batches:
            break
    return torch.cat(got)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), block=st.integers(1, 40), per=st.integers(1, 5),
       cut=st.integers(1, 20), exclude=st.sampled_from([(), (BOS,)]))
def test_the_stream_order_resume_and_memory_bound(made: tuple[Path, _Encoder], seed: int,
                                                  block: int, per: int, cut: int,
                                                  exclude: tuple[int, ...]) -> None:
    view = open_store(made[0]).tokens("embed", exclude=exclude)
    every = view[:]
    expected = _by_hand(every, seed, block, block * per)
    stream = view.stream(buffer_tokens=block * per, block_tokens=block, seed=seed)
    reads: list[tuple[int, int]] = []
    read = view.read

    def counted(indices: np.ndarray) -> torch.Tensor:
        reads.append((stream.position, len(indices)))
        return read(indices)

    view.read = counted  # type: ignore[method-assign]
    assert torch.equal(_read(stream), expected)
    assert sorted(expected.sum(dim=1).tolist()) == sorted(every.sum(dim=1).tolist())
    # memory: a window's blocks are read when the window before it is used up, never more
    # than buffer_tokens of them, and every token is read once
    windows = [sum(len(b) for b in w) for w in stream.windows()]
    starts = np.cumsum([0, *windows[:-1]]).tolist()
    assert max(n for _, n in reads) <= block and sum(n for _, n in reads) == len(every)
    assert sorted({at for at, _ in reads}) == starts and max(windows) <= block * per
    for at in starts:
        assert sum(n for p, n in reads if p == at) == windows[starts.index(at)]
    # resume: a stream restarted from the state after `cut` batches of 7 gives the rest
    first = view.stream(buffer_tokens=block * per, block_tokens=block, seed=seed)
    head = _read(first, cut)
    state = first.state_dict()
    assert state == {"seed": seed, "epoch": 0, "position": len(head)}
    again = open_store(made[0]).tokens("embed", exclude=exclude).stream(
        buffer_tokens=block * per, block_tokens=block, seed=0)
    again.load_state_dict(state)
    assert torch.equal(torch.cat([head, _read(again)]), expected)
    # batches made by the stream itself: the same tokens in the same order, resumable too
    batched = view.stream(buffer_tokens=block * per, block_tokens=block, seed=seed,
                          batch_size=cut)
    parts = list(DataLoader(batched, batch_size=None))
    assert [len(p) for p in parts[:-1]] == [cut] * (len(parts) - 1) and 0 < len(parts[-1]) <= cut
    assert torch.equal(torch.cat(parts), expected)
    batched.load_state_dict({**batched.state_dict(), "position": cut * (len(parts) // 2)})
    assert torch.equal(torch.cat(list(batched)), expected[cut * (len(parts) // 2):])


def test_stream_arguments_are_checked(made: tuple[Path, _Encoder]) -> None:
    view = open_store(made[0]).tokens("embed")
    with pytest.raises(ValueError, match=r"buffer_tokens \(4\) must hold at least one block"):
        view.stream(buffer_tokens=4, block_tokens=8)
    with pytest.raises(ValueError, match=r"block_tokens must be a positive int"):
        view.stream(block_tokens=0)
    other: Any = view.stream(seed=3)
    other.set_epoch(1)
    assert other.state_dict() == {"seed": 3, "epoch": 1, "position": 0}
    assert not torch.equal(_read(other), _read(view.stream(seed=3)))
