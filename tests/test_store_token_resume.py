"""Token streams that resume under any loader (issue 49 item 2): stopped after any batch, with
0 to 2 worker processes, then resumed from ``state_dict()`` in a new stream (0 to 2 workers
again), every token of the epoch is seen exactly once, in the order the seed gives (computed
here by hand); a look at the first batch consumes nothing; a finished pass moves on to the next
epoch by itself; a plain ``DataLoader`` with workers, whose progress the stream cannot see, is
refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from hookscope.errors import StoreError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from hookscope.store.tokens import TokenView
from tests.test_store_tokens import _Encoder, _Tokens

BLOCK, BUFFER = 8, 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("resume") / "store"
    extract(_Encoder(), _Tokens(), ["embed"], out, batch_size=4, shard_bytes=1500, progress=False)
    return out


def _view(folder: Path) -> TokenView:
    return open_store(folder).tokens("embed")


def _by_hand(tokens: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """The stream's order for ``epoch`` (TokenStream's docstring), with numpy."""
    n = len(tokens)
    blocks = np.random.default_rng([seed, epoch]).permutation(-(-n // BLOCK))
    per, order = BUFFER // BLOCK, []
    for w in range(0, len(blocks), per):
        window = np.concatenate([np.arange(b * BLOCK, min(b * BLOCK + BLOCK, n))
                                 for b in blocks[w:w + per]])
        order.append(window[np.random.default_rng([seed, epoch, w // per]).permutation(len(window))])
    return tokens[torch.from_numpy(np.concatenate(order))]


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(seed=3, batch=5, stop=4, workers=2, again=1, peek=True)
@example(seed=4, batch=7, stop=2, workers=1, again=2, peek=False)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 40), stop=st.integers(1, 12),
       workers=st.integers(0, 2), again=st.integers(0, 2), peek=st.booleans())
def test_stop_anywhere_resume_and_see_each_token_once(folder: Path, seed: int, batch: int,
                                                      stop: int, workers: int, again: int,
                                                      peek: bool) -> None:
    view = _view(folder)
    expected = _by_hand(view[:], seed, 0)
    stream = view.stream(buffer_tokens=BUFFER, block_tokens=BLOCK, seed=seed, batch_size=batch)
    loader = stream.loader(num_workers=workers)
    if peek:
        assert torch.equal(next(iter(loader)), expected[:batch])  # a look consumes nothing
    seen = []
    for part in loader:  # a training loop that saves its state after `stop` steps
        seen.append(part)
        if len(seen) == stop:
            break
    state = stream.state_dict()
    head = torch.cat(seen)
    finished = len(head) == len(expected)
    assert state == {"seed": seed, "epoch": 0, "position": len(head)}
    fresh = _view(folder).stream(buffer_tokens=BUFFER, block_tokens=BLOCK, seed=1,
                                 batch_size=batch)
    fresh.load_state_dict(state)
    rest = list(fresh.loader(num_workers=again))
    tail = torch.cat(rest) if rest else expected[:0]
    if finished:  # the pass had ended: the resumed stream reads the next epoch, whole
        assert torch.equal(head, expected) and torch.equal(tail, _by_hand(view[:], seed, 1))
        assert fresh.state_dict() == {"seed": seed, "epoch": 1, "position": len(expected)}
    else:
        assert torch.equal(torch.cat([head, tail]), expected)  # each token once, in order
        assert all(len(p) == batch for p in rest[:-1])


def test_a_peek_consumes_nothing_and_epochs_advance_by_themselves(folder: Path) -> None:
    view = _view(folder)
    every = view[:]
    stream = view.stream(buffer_tokens=BUFFER, block_tokens=BLOCK, seed=5)
    loader = DataLoader(stream, batch_size=7)
    first = next(iter(loader))
    assert torch.equal(first, _by_hand(every, 5, 0)[:7])
    assert torch.equal(torch.cat(list(loader)), _by_hand(every, 5, 0))  # from the start again
    assert stream.state_dict() == {"seed": 5, "epoch": 0, "position": len(every)}
    second = torch.cat(list(loader))  # no set_epoch: the next epoch, not an empty pass
    assert torch.equal(second, _by_hand(every, 5, 1))
    assert stream.state_dict() == {"seed": 5, "epoch": 1, "position": len(every)}
    stream.set_epoch(0)
    assert torch.equal(torch.cat(list(loader)), _by_hand(every, 5, 0))


def test_a_plain_dataloader_with_workers_is_refused(folder: Path) -> None:
    stream = _view(folder).stream(buffer_tokens=BUFFER, block_tokens=BLOCK, seed=0, batch_size=4)
    with pytest.raises(StoreError, match=r"num_workers=2\) would lose its place.*"
                                         r"stream.loader\(num_workers=2\)"):
        next(iter(DataLoader(stream, batch_size=None, num_workers=2)))
    assert stream.state_dict()["position"] == 0
    with pytest.raises(StoreError, match="makes its own batches"):
        _view(folder).stream(seed=0).loader(num_workers=1)
    with pytest.raises(StoreError, match=r"num_workers must be an int >= 0"):
        stream.loader(num_workers=-1)
    with pytest.raises(StoreError, match=r"\['batch_size'\].*leave them out"):
        stream.loader(num_workers=1, batch_size=3)
