"""Errors that misled new users (issue 25): each now says what happened and the fix."""

from __future__ import annotations

import pytest
import torch

import hookscope
from hookscope.errors import CaptureError
from tests.models import tiny_gpt2

transformers = pytest.importorskip("transformers")


def test_run_refuses_a_capture_option_given_as_a_model_keyword() -> None:
    model, ids = tiny_gpt2(n_head=2), torch.tensor([[3, 9, 14, 2, 8]])
    with pytest.raises(CaptureError, match=(
            r"hookscope.run got grads=True as a keyword: .*GPT2LMHeadModel.forward has no "
            r"parameter 'grads'.*options=\{'grads': True\}; for a keyword of the model's own, "
            r"call it inside the block")):
        hookscope.run(model, ids, layers="transformer.h.0", grads=True)
    _, acts = hookscope.run(model, ids, layers="transformer.h.0", options={"grads": True})
    assert acts["transformer.h.0"].shape == (1, 5, 32)


def test_lm_head_under_generate_says_it_ran_on_the_last_token_only() -> None:
    model, ids = tiny_gpt2(n_head=2), torch.tensor([[1, 2, 3, 4]])
    with hookscope.capture_generation(model, "lm_head") as generation:
        model.generate(ids, max_new_tokens=3, do_sample=False)
    with pytest.raises(CaptureError, match=r"'lm_head' returned \(1, 1, 60\) at step 0, which fed "
                                           r"4 tokens: it ran on the last 1 token\(s\) only.*"
                                           r"logits_to_keep=0"):
        generation.aligned("lm_head")
    with hookscope.capture_generation(model, "lm_head") as generation:
        sequence = model.generate(ids, max_new_tokens=3, do_sample=False, logits_to_keep=0)
    assert generation.aligned("lm_head").shape == (1, sequence.shape[1] - 1, 60)
