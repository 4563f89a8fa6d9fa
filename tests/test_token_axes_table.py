"""Every row of ``engine.values.layout.TOKEN_AXES`` (modules whose tokens are not dim 1: torch's
sequence-first attention, transformer layers and RNNs, 1-D convolutions) read by every verb that
takes tokens: capture's reductions, stats, extract, ablate/steer/patch at positions, patching_sweep and
attribution_patching, each against plain PyTorch (a forward hook indexing the module's output
by hand), on padded and unpadded batches. Before the table, each verb took the batch of a
``(seq, batch, d)`` output for its tokens and the channels of a ``(batch, channels, length)``
one, with no error."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.engine import TOKEN_AXES
from hookscope.errors import PositionError
from tests.models import padding_mask

D, VOCAB = 8, 20


class SequenceFirst(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)`` through one module ``block``
    of the kind ``kind``, called in its own layout; ``attention_mask`` (1 = real token) reaches
    the attention kinds as their key padding mask."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, D)
        self.block: nn.Module = {
            "encoder": lambda: nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0),
            "attention": lambda: nn.MultiheadAttention(D, 2),
            "rnn": lambda: nn.LSTM(D, D),
            "conv": lambda: nn.Conv1d(D, D, 3, padding=1),
        }[kind]()
        self.out = nn.Linear(D, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(input_ids)  # (batch, seq, d)
        padding = None if attention_mask is None else attention_mask == 0
        if self.kind == "conv":
            x = self.block(x.transpose(1, 2)).transpose(1, 2)  # (batch, d, seq) inside
        elif self.kind == "encoder":
            x = self.block(x.transpose(0, 1), src_key_padding_mask=padding).transpose(0, 1)
        elif self.kind == "attention":
            s = x.transpose(0, 1)  # (seq, batch, d)
            x = self.block(s, s, s, key_padding_mask=padding)[0].transpose(0, 1)
        else:
            x = self.block(x.transpose(0, 1))[0].transpose(0, 1)
        return self.out(x)  # type: ignore[no-any-return]


KINDS = ("encoder", "attention", "rnn", "conv")
#: the record each kind's verbs select: the part of the output that holds the tokens
SELECT = {"encoder": "block", "attention": "block[0]", "rnn": "block[0]", "conv": "block"}
MODELS = {kind: SequenceFirst(kind).eval() for kind in KINDS}


def tokens(kind: str, value: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: a ``(batch, seq, d)`` view of the selected value (writes go through)."""
    return value.transpose(1, 2) if kind == "conv" else value.transpose(0, 1)


def by_hand(kind: str, ids: torch.Tensor, mask: torch.Tensor | None,
            change: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, selected value as (batch, seq, d))`` with ``change`` applied in place to the
    ``(batch, seq, d)`` view of the selected value, by a plain forward hook."""
    model, seen = MODELS[kind], []

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        value = (output[0] if isinstance(output, tuple) else output).clone()
        if change is not None:
            change(tokens(kind, value))
        seen.append(tokens(kind, value))
        return (value, *output[1:]) if isinstance(output, tuple) else value
    handle = model.block.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask)
    finally:
        handle.remove()
    return logits, seen[0]


def real(mask: torch.Tensor | None, rows: int, seq: int) -> list[list[int]]:
    """The real token indices of each row."""
    if mask is None:
        return [list(range(seq))] * rows
    return [torch.nonzero(row).flatten().tolist() for row in mask]


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    rows, seq = draw(st.integers(1, 3)), draw(st.integers(2, 5))
    if rows == seq:  # a square output would hide a batch taken for tokens
        seq += 1
    padding = draw(st.sampled_from([None, "left", "right"]))
    mask = None
    if padding is not None:
        mask = padding_mask([draw(st.integers(1, seq)) for _ in range(rows)], seq, padding == "left")
    torch.manual_seed(draw(st.integers(0, 99)))
    return {"kind": draw(st.sampled_from(KINDS)), "ids": torch.randint(1, VOCAB, (rows, seq)),
            "other": torch.randint(1, VOCAB, (rows, seq)), "mask": mask,
            "position": draw(st.sampled_from([0, -1, 1, -2]))}


def _fits(case: dict[str, Any]) -> bool:
    return all(-len(r) <= case["position"] < len(r) for r in real(case["mask"], *case["ids"].shape))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_verb_reads_the_token_axis_of_the_row(case: dict[str, Any]) -> None:
    kind, ids, mask, p = case["kind"], case["ids"], case["mask"], case["position"]
    model, key, kwargs = MODELS[kind], SELECT[kind], {"attention_mask": case["mask"]}
    _, plain = by_hand(kind, ids, mask)
    picked = real(mask, *ids.shape)
    firsts = torch.stack([plain[r, picked[r][0]] for r in range(len(picked))])
    lasts = torch.stack([plain[r, picked[r][-1]] for r in range(len(picked))])
    means = torch.stack([plain[r, picked[r]].mean(0) for r in range(len(picked))])
    for reduce, expected in (("first", firsts), ("last", lasts), ("mean", means)):
        with torch.no_grad(), hookscope.capture(model, key, reduce=reduce) as acts:
            model(ids, **kwargs)
        torch.testing.assert_close(acts[key], expected, msg=f"capture reduce={reduce}")
    batch = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
    running = hookscope.stats(model, [batch], key)[key]
    kept = torch.cat([plain[r, picked[r]] for r in range(len(picked))])  # (tokens, d)
    assert int(running.count.sum()) == kept.numel()
    torch.testing.assert_close(float(running.mean), float(kept.double().mean()), msg="stats")
    if not _fits(case):
        return
    cells = [(r, picked[r][p]) for r in range(len(picked))]

    def zero(view: torch.Tensor) -> None:
        for r, c in cells:
            view[r, c] = 0
    with torch.no_grad(), hookscope.ablate(model, key, positions=p, attention_mask=mask):
        got = model(ids, **kwargs)
    torch.testing.assert_close(got, by_hand(kind, ids, mask, zero)[0], msg="ablate")
    vector = torch.arange(D, dtype=torch.float32)

    def add(view: torch.Tensor) -> None:
        for r, c in cells:
            view[r, c] += vector
    steering = vector[:, None] if kind == "conv" else vector  # per channel, as on feature maps
    with torch.no_grad(), hookscope.steer(model, {key: steering}, positions=p, attention_mask=mask):
        got = model(ids, **kwargs)
    torch.testing.assert_close(got, by_hand(kind, ids, mask, add)[0], msg="steer")
    with torch.no_grad(), hookscope.capture(model, key) as source:
        model(case["other"], **kwargs)
    _, other = by_hand(kind, case["other"], mask)

    def put(view: torch.Tensor) -> None:
        for r, c in cells:
            view[r, c] = other[r, c]
    with torch.no_grad(), hookscope.patch(model, source=source, layers=key, positions=p):
        got = model(ids, **kwargs)
    torch.testing.assert_close(got, by_hand(kind, ids, mask, put)[0], msg="patch")


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum()


@pytest.mark.parametrize("kind", KINDS)
def test_sweeps_patch_each_token(kind: str) -> None:
    """patching_sweep's cell j is the metric with token j of every row patched from the clean
    run; attribution_patching's is its first-order estimate, each by hand."""
    torch.manual_seed(3)
    clean, corrupted = torch.randint(1, VOCAB, (2, 5)), torch.randint(1, VOCAB, (2, 5))
    model, key = MODELS[kind], SELECT[kind]
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers=key, metric=_metric,
                                     progress=False)
    _, clean_value = by_hand(kind, clean, None)
    expected = []
    for j in range(5):
        def put(view: torch.Tensor, j: int = j) -> None:
            view[:, j] = clean_value[:, j]
        expected.append(float(_metric(by_hand(kind, corrupted, None, put)[0])))
    assert sweep.positions == list(range(5))
    torch.testing.assert_close(sweep.values[0].double(), torch.tensor(expected, dtype=torch.float64))
    atp = hookscope.attribution_patching(model, clean, corrupted, _metric, layers=key)
    grads: list[torch.Tensor] = []
    zero: list[torch.Tensor] = []

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        value = output[0] if isinstance(output, tuple) else output
        zero.append(torch.zeros_like(value, requires_grad=True))
        value = value + zero[0]
        return (value, *output[1:]) if isinstance(output, tuple) else value
    handle = model.block.register_forward_hook(hook)
    try:
        metric = _metric(model(corrupted))
        grads = list(torch.autograd.grad(metric, zero))
    finally:
        handle.remove()
    _, corrupted_value = by_hand(kind, corrupted, None)
    change = (clean_value - corrupted_value).double() * tokens(kind, grads[0]).double()
    torch.testing.assert_close(atp.values[0], change.sum(dim=(0, 2)) + float(metric.detach()),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_extract_stores_tokens_of_each_row(kind: str, tmp_path: Any) -> None:
    """extract reduce='last' and reduce=None with a padded batch: the rows plain PyTorch gives."""
    torch.manual_seed(4)
    ids, mask = torch.randint(1, VOCAB, (2, 5)), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    _, plain = by_hand(kind, ids, mask)
    key = SELECT[kind]
    batches = [{"input_ids": ids, "attention_mask": mask}]
    store = hookscope.extract(MODELS[kind], batches, key, tmp_path / "last", reduce="last",
                              progress=False)
    torch.testing.assert_close(torch.as_tensor(store[key][:]), torch.stack([plain[0, 2], plain[1, 4]]))
    store = hookscope.extract(MODELS[kind], batches, key, tmp_path / "all", progress=False)
    torch.testing.assert_close(torch.as_tensor(store[key][1]), plain[1])
    torch.testing.assert_close(torch.as_tensor(store[key][0]), plain[0, :3])


def test_every_row_has_a_model_here() -> None:
    """A new row of TOKEN_AXES needs a kind in this file's zoo."""
    covered = {type(MODELS[kind].block) for kind in KINDS}
    for row in TOKEN_AXES:
        assert any(issubclass(t, row.types) for t in covered), row.kind


def test_an_rnn_final_state_has_no_tokens() -> None:
    """(layers, batch, hidden): refused by positions and by a token reduction, with the fix."""
    model, ids = MODELS["rnn"], torch.randint(1, VOCAB, (2, 5))
    with pytest.raises(PositionError, match=r"select the part that holds the tokens, e.g. 'block\[0\]'"):
        with torch.no_grad(), hookscope.capture(model, "block[1][0]", reduce="last"):
            model(ids)
    with pytest.raises(PositionError, match=r"'block\[1\]\[0\]', shape \(1, 2, 8\), has no token axis"):
        with torch.no_grad(), hookscope.ablate(model, "block", positions=-1):
            model(ids)


@pytest.mark.parametrize("kind", KINDS)
def test_compare_reads_the_real_tokens_of_each_row(kind: str) -> None:
    """Model B differs from A only where its block's output holds padding: every layer agrees."""
    model, key = MODELS[kind], SELECT[kind]
    twin = copy.deepcopy(model)
    mask = padding_mask([5, 2, 3], 5, left=True)

    def pad_noise(module: nn.Module, args: Any, output: Any) -> Any:
        value = (output[0] if isinstance(output, tuple) else output).clone()
        tokens(kind, value)[mask == 0] += 1.0
        return (value, *output[1:]) if isinstance(output, tuple) else value
    handle = twin.block.register_forward_hook(pad_noise)
    ids = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(5))
    try:
        result = hookscope.compare(model, twin, ids, attention_mask=mask, layers=[key, "out"])
        plain = hookscope.compare(model, twin, ids, layers=[key])  # no mask: padding is compared
    finally:
        handle.remove()
    assert [d.path for d in result.diffs] == [key, "out", ""]
    assert all(d.max_abs == 0.0 and d.close for d in result.diffs), result.diffs
    assert plain.diffs[0].max_abs == pytest.approx(1.0, abs=1e-5)
