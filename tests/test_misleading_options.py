"""Errors and options that misled new users (issue 25, "Errors and options that mislead").

(``run(..., grads=True)`` and ``capture_generation(model, "lm_head")`` are held in
``test_newcomer_messages.py``.)
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import hookscope
from hookscope.errors import HookNeverFiredWarning
from tests.models import tiny_gpt2

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[3, 9, 14, 2, 8]])


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    return tiny_gpt2(n_head=2)


def _unfired_warnings(model: torch.nn.Module, *patterns: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookscope.capture(model, *patterns):
            model(IDS)
    return [str(w.message) for w in caught if issubclass(w.category, HookNeverFiredWarning)]


def test_a_glob_summarises_its_silent_members_in_one_line(gpt2: torch.nn.Module) -> None:
    (message,) = _unfired_warnings(gpt2, "**")
    first = message.splitlines()[0]
    assert first == ("2 modules that a pattern matched never ran (transformer.h.0.attn.attn_dropout, "
                     "transformer.h.1.attn.attn_dropout); nothing was recorded there (the reason "
                     "of each is in .unfired)")
    assert len(message.splitlines()) == 2  # and the on_unfired hint


def test_a_name_the_user_typed_still_warns_with_its_reason(gpt2: torch.nn.Module) -> None:
    (message,) = _unfired_warnings(gpt2, "**", "transformer.h.0.attn.attn_dropout")
    lines = message.splitlines()
    assert lines[0] == "1 selected module never ran, so no hook fired and nothing was recorded:"
    assert lines[1].startswith("  - transformer.h.0.attn.attn_dropout: transformer.h.0.attn.attn_dropout "
                               "(Dropout) was registered but never called")
    assert "1 module that a pattern matched never ran (transformer.h.1.attn.attn_dropout)" in message


def test_on_unfired_error_still_lists_every_reason(gpt2: torch.nn.Module) -> None:
    with pytest.raises(hookscope.HookNeverFiredError, match=r"(?s)2 selected modules never ran.*"
                                                            r"  - transformer.h.1.attn.attn_dropout: "):
        with hookscope.capture(gpt2, "**", on_unfired="error"):
            gpt2(IDS)


@pytest.mark.parametrize("reduce", ["mean", "last"])
def test_reduce_applies_to_gradients_with_the_mask(reduce: str) -> None:
    model = tiny_gpt2(n_head=2)
    ids = torch.tensor([[3, 9, 14, 2, 8], [0, 0, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # left padded
    with torch.enable_grad():
        with hookscope.capture(model, "transformer.h.0", grads=True) as whole:
            out = model(ids, attention_mask=mask)
        out.logits.sum().backward()
        with hookscope.capture(model, "transformer.h.0", grads=True, reduce=reduce) as acts:
            out = model(ids, attention_mask=mask)
            # a later forward with another mask must not change the first's (given: without
            # it, these left-padded ids are refused, engine.values.layout.check_no_unmasked_padding)
            model(ids[:, :3], attention_mask=mask[:, :3])
        out.logits.sum().backward()
    full = whole.grad("transformer.h.0")  # (2, 5, 32)
    if reduce == "mean":
        weight = mask[..., None].float()
        expected = (full * weight).sum(1) / weight.sum(1)
    else:
        expected = full[:, -1]  # the last real token of left-padded rows is the last column
    assert acts.grad("transformer.h.0").shape == acts["transformer.h.0", 0].shape == (2, 32)
    torch.testing.assert_close(acts.grad("transformer.h.0"), expected, rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)


def test_sweep_names_the_positions_left_out_and_why(gpt2: torch.nn.Module) -> None:
    clean, corrupted = IDS, torch.tensor([[3, 9, 14, 2, 8, 11]])
    with pytest.warns(UserWarning, match=r"patching_sweep covers positions 0 … 4: the corrupted "
                                         r"input has 6 tokens and the clean one 5, so positions "
                                         r"5 … 5 have no clean value to patch in and are left out"):
        sweep = hookscope.patching_sweep(gpt2, clean, corrupted, layers="transformer.h.0",
                                         metric=lambda out: out.logits[:, -1, 3].mean(), progress=False)
    assert sweep.positions == [0, 1, 2, 3, 4]


def test_gradcam_overlay_takes_an_image_path(tmp_path: Path) -> None:
    pil = pytest.importorskip("PIL.Image")
    pixels = (np.random.default_rng(0).random((24, 30, 3)) * 255).astype(np.uint8)
    photo = tmp_path / "cat.png"
    pil.fromarray(pixels).save(photo)
    cam = torch.rand(6, 5)
    from_path = hookscope.save_gradcam_overlay(str(photo), cam, tmp_path / "a.png")
    from_array = hookscope.save_gradcam_overlay(pixels, cam, tmp_path / "b.png")
    assert from_path.read_bytes() == from_array.read_bytes()  # same picture, same figure
    hookscope.save_gradcam_overlay(photo, cam, tmp_path / "c.png")  # a PathLike too
    with pytest.raises(hookscope.GradcamError, match=r"image='.*missing.jpg' cannot be read as a "
                                                     r"picture .*give the path of a PNG/JPEG file"):
        hookscope.save_gradcam_overlay(str(tmp_path / "missing.jpg"), cam, tmp_path / "d.png")


def test_call_inputs_repr_is_one_short_line(gpt2: torch.nn.Module) -> None:
    with hookscope.capture(gpt2, "transformer.h.0", inputs=True) as acts:
        gpt2(IDS, use_cache=True)
    shown = repr(acts.inputs("transformer.h.0"))
    assert shown.startswith("<hookscope.CallInputs hidden_states: 1x5x32 float32, ")
    assert "DynamicCache" in shown and "\n" not in shown and len(shown) < 250
    assert str(acts.inputs("transformer.h.0")) == shown


class _TakesDtype(torch.nn.Module):
    """A forward with a keyword that is also a capture option's name."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.fc(x).to(dtype)


def test_run_passes_an_option_name_the_forward_declares_to_the_model() -> None:
    model, x = _TakesDtype(), torch.randn(2, 3)
    out, acts = hookscope.run(model, x, layers="fc", dtype=torch.float64)
    assert out.dtype == torch.float64 and acts["fc"].dtype == torch.float32  # the model's, not capture's
    torch.testing.assert_close(out, model.fc(x).double())
