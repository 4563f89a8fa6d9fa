"""An encoder-decoder's decoder runs on tokens of its own: its mask is ``decoder_attention_mask``
(or none), never the encoder's ``attention_mask``. Every verb read the root's mask for the
decoder's values too, and took its last columns as a KV cache's (``Layout.mask``): positions,
reductions and stats on the decoder counted the encoder's padding. The ``MaskWatcher`` now
watches each stack as it starts (``engine.values.layout.stacks``); each result is checked against a
plain forward hook on a tiny T5."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hookscope
from tests.models import padding_mask

transformers = pytest.importorskip("transformers")

DECODER, ENCODER = "decoder.block.0.layer.0", "encoder.block.0.layer.0"


@functools.cache
def _t5() -> Any:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                   num_decoder_layers=1, num_heads=4, decoder_start_token_id=0,
                                   pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config).eval()


def _plain(inputs: dict[str, torch.Tensor], path: str, cells: list[tuple[int, int]] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: ``(logits, output of path)`` with ``cells`` of that output zeroed."""
    model, seen = _t5(), []

    def hook(module: Any, args: Any, output: Any) -> Any:
        value = output[0].clone()
        for row, column in cells or []:
            value[row, column] = 0
        seen.append(value)
        return (value, *output[1:])
    handle = model.get_submodule(path).register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        handle.remove()
    return logits, seen[0]


def _real(mask: torch.Tensor | None, rows: int, seq: int) -> list[list[int]]:
    return [list(range(seq))] * rows if mask is None else [row.nonzero().flatten().tolist() for row in mask]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(4, 7), st.integers(2, 4), st.booleans(), st.sampled_from([0, -1]), st.data())
def test_each_stack_reads_its_own_tokens(source: int, target: int, decoder_mask: bool,
                                         position: int, data: st.DataObject) -> None:
    rows = 2
    mask = padding_mask([source, data.draw(st.integers(1, source))], source, left=False)
    ids = torch.randint(1, 40, (rows, source), generator=torch.Generator().manual_seed(source))
    inputs = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
              "decoder_input_ids": torch.randint(1, 40, (rows, target))}
    masks = {ENCODER: mask, DECODER: None}
    if decoder_mask:
        masks[DECODER] = padding_mask([target, data.draw(st.integers(1, target))], target, left=False)
        inputs["decoder_attention_mask"] = masks[DECODER]
    model = _t5()
    for path in (ENCODER, DECODER):
        seq = inputs["decoder_input_ids" if path == DECODER else "input_ids"].shape[1]
        real = _real(masks[path], rows, seq)
        cells = [(r, real[r][position]) for r in range(rows)]
        with torch.no_grad(), hookscope.ablate(model, f"{path}[0]", positions=position):
            got = model(**inputs).logits
        torch.testing.assert_close(got, _plain(inputs, path, cells)[0], msg=f"ablate {path}")
        with torch.no_grad(), hookscope.capture(model, f"{path}[0]", reduce="last") as acts:
            model(**inputs)
        plain = _plain(inputs, path)[1]
        last = torch.stack([plain[r, real[r][-1]] for r in range(rows)])
        torch.testing.assert_close(acts[f"{path}[0]"], last, msg=f"reduce='last' {path}")
        other = {**inputs, "decoder_input_ids": inputs["decoder_input_ids"].flip(1)}
        with torch.no_grad(), hookscope.capture(model, f"{path}[0]") as source:
            model(**other)
        with torch.no_grad(), hookscope.patch(model, source=source, positions=position):
            got = model(**inputs).logits
        donor = _plain(other, path)[1]

        def put(module: Any, args: Any, output: Any, cells: Any = cells, donor: Any = donor) -> Any:
            value = output[0].clone()
            for r, c in cells:
                value[r, c] = donor[r, c]
            return (value, *output[1:])
        handle = model.get_submodule(path).register_forward_hook(put)
        try:
            with torch.no_grad():
                expected = model(**inputs).logits
        finally:
            handle.remove()
        torch.testing.assert_close(got, expected, msg=f"patch {path}")
        running = hookscope.stats(model, [inputs], path)[path]
        kept = torch.cat([plain[r, real[r]] for r in range(rows)])
        assert int(running.count.sum()) == kept.numel(), path
        torch.testing.assert_close(float(running.mean), float(kept.double().mean()))


def test_extract_stores_the_decoder_tokens_by_its_own_mask(tmp_path: Any) -> None:
    """reduce='last' and ragged rows of a decoder layer: its last real token and its real
    tokens by ``decoder_attention_mask``; the encoder's by ``attention_mask``. The ``@token``
    column (the root's input_ids) is kept for encoder layers only (it labelled the decoder's
    tokens with the encoder's ids)."""
    mask = padding_mask([6, 2], 6, left=False)
    decoder_mask = padding_mask([2, 3], 3, left=False)
    inputs = {"input_ids": torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(1)),
              "attention_mask": mask, "decoder_input_ids": torch.tensor([[0, 5, 6], [0, 7, 8]]),
              "decoder_attention_mask": decoder_mask}
    for path, real in ((DECODER, decoder_mask), (ENCODER, mask)):
        plain = _plain(inputs, path)[1]
        key = f"{path}[0]"
        store = hookscope.extract(_t5(), [inputs], key, tmp_path / f"last{path}", reduce="last",
                                  progress=False)
        ends = real.sum(dim=1) - 1
        torch.testing.assert_close(torch.as_tensor(store[key][:]), plain[torch.arange(2), ends])
        store = hookscope.extract(_t5(), [inputs], key, tmp_path / f"all{path}", progress=False)
        for row in range(2):
            torch.testing.assert_close(torch.as_tensor(store[key][row]), plain[row, real[row].bool()])
        if path == ENCODER:  # the input_ids of the real tokens, one per stored token
            assert [t.tolist() for t in store.token_ids] == [
                inputs["input_ids"][row][mask[row].bool()].tolist() for row in range(2)]
        else:  # the decoder's tokens are not the input_ids: no column claims they are
            assert store.token_ids is None


def test_generation_edits_each_new_decoder_token() -> None:
    """Under generate()'s KV cache the decoder's one new token per forward is its last (the
    encoder's mask, whose last column is padding here, made it padding: refused)."""
    model = _t5()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0]])
    kwargs = {"input_ids": ids, "attention_mask": (ids != 0).long(), "max_new_tokens": 3,
              "min_new_tokens": 3, "do_sample": False, "output_scores": True,
              "return_dict_in_generate": True}
    vector = torch.linspace(-1, 1, 16)
    with torch.no_grad(), hookscope.steer(model, {f"{DECODER}[0]": vector}, positions=-1):
        got = model.generate(**kwargs).scores

    def add(module: Any, args: Any, output: Any) -> Any:
        value = output[0].clone()
        value[:, -1] += vector
        return (value, *output[1:])
    handle = model.get_submodule(DECODER).register_forward_hook(add)
    try:
        with torch.no_grad():
            expected = model.generate(**kwargs).scores
    finally:
        handle.remove()
    assert len(got) == len(expected) == 3
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, msg=f"step {step}")
