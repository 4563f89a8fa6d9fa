"""What a new user tripped on (issue 15), each held at the right value or message.

- An edit that returns the wrong type or shape fails at the edit, naming its pattern, what the
  module returned and what the edit returned (not in the next module).
- ``hookscope.run(model, tokenizer(...), layers=...)``: a mapping given as the one input whose
  keys name ``forward``'s parameters is passed as keyword arguments, as ``extract`` does.
- Every warning of a public function points at the user's line (its filename is this file).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, UserDict
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope import EditError
from tests.models import UnusedBranch

# ----------------------------------------------------------------------------- edits checked


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))


def test_an_edit_of_the_wrong_shape_is_blamed_on_the_edit_not_the_next_module() -> None:
    model, x = _mlp(), torch.randn(3, 10)
    with pytest.raises(EditError) as caught:
        with hookscope.edit(model, {"0": lambda out: out[:, :5]}):
            model(x)
    message = str(caught.value)
    assert "edit of '0'" in message
    assert "Tensor of shape (3, 20)" in message and "Tensor of shape (3, 5)" in message
    assert "'1' (ReLU)" not in message and "inside '1'" not in "".join(caught.value.__notes__ or [])
    assert model(x).shape == (3, 5)   # hooks gone: the model runs as before


def test_an_edit_returning_another_type_names_both_types() -> None:
    model, x = _mlp(), torch.randn(3, 10)
    with pytest.raises(EditError, match=r"edit of '\*\*\.0'.*returned a Tensor.*the edit returned "
                                        r"a tuple"):
        with hookscope.edit(model, {"**.0": lambda out: (out, out)}):
            model(x)


def test_an_edit_returning_another_dtype_is_refused() -> None:
    model, x = _mlp(), torch.randn(3, 10)
    with pytest.raises(EditError, match=r"dtype torch.float32.*dtype torch.float64"):
        with hookscope.edit(model, {"0": lambda out: out.double()}):
            model(x)


def test_a_float32_sae_spliced_into_a_bfloat16_model_is_told_to_cast() -> None:
    model, x = _mlp().to(torch.bfloat16), torch.randn(3, 10, dtype=torch.bfloat16)
    torch.manual_seed(0)
    sae = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 20))  # float32
    with pytest.raises(EditError) as caught:
        with hookscope.edit(model, {"0": lambda out: sae(out.float())}):
            model(x)
    message = str(caught.value)
    assert "dtype torch.bfloat16 on cpu, but the edit returned a Tensor of shape (3, 20), dtype " \
           "torch.float32 on cpu" in message
    assert "Return it as the module's dtype (torch.bfloat16): new.to(output.dtype), or convert " \
           "what made it once, e.g. sae.to(output.dtype)" in message
    with hookscope.edit(model, {"0": lambda out: sae(out.float()).to(out.dtype)}):  # the fix works
        edited = model(x)
    assert torch.equal(edited, model[2](model[1](sae(model[0](x).float()).to(torch.bfloat16))))


def test_edits_of_structured_outputs_are_checked_part_by_part() -> None:
    lstm, x = nn.LSTM(4, 6, batch_first=True), torch.randn(2, 3, 4)
    container = nn.Sequential(lstm)
    with pytest.raises(EditError, match=r"\[1\]\[0\].*shape \(1, 2, 6\).*shape \(2, 6\)"):
        with hookscope.edit(container, {"0": lambda out: (out[0], (out[1][0][0], out[1][1]))}):
            container(x)
    with hookscope.edit(container, {"0[0]": lambda out: out * 0}):   # a part: right shape
        assert torch.equal(container(x)[0], torch.zeros(2, 3, 6))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 2), st.integers(1, 3))
def test_any_wrong_shape_is_caught_at_the_edit(shape: list[int], axis: int, extra: int) -> None:
    model = nn.Sequential(nn.Identity(), nn.Tanh())
    x = torch.randn(*shape)
    axis = axis % len(shape)

    def grow(out: torch.Tensor) -> torch.Tensor:
        pad = list(out.shape)
        pad[axis] = extra
        return torch.cat([out, torch.zeros(pad)], dim=axis)

    grown = list(shape)
    grown[axis] += extra
    with pytest.raises(EditError, match=rf"shape {tuple(shape)}.*shape {tuple(grown)}".replace(
            "(", r"\(").replace(")", r"\)")):
        with hookscope.edit(model, {"0": grow}):
            model(x)


def test_a_right_edit_still_equals_a_plain_forward_hook() -> None:
    model, x = _mlp(), torch.randn(3, 10)
    with hookscope.edit(model, {"0": lambda out: out * 2}):
        edited = model(x)
    handle = model[0].register_forward_hook(lambda m, a, out: out * 2)
    try:
        expected = model(x)
    finally:
        handle.remove()
    assert torch.equal(edited, expected)


# ----------------------------------------------------------------------------- run(model, mapping)


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(input_ids)) * attention_mask[..., None]


@pytest.mark.parametrize("kind", [dict, OrderedDict, UserDict, MappingProxyType],
                         ids=lambda k: k.__name__)
def test_run_passes_a_mapping_as_keyword_arguments(kind: Callable[[dict[str, Any]], Any]) -> None:
    model = _Keywords()
    batch = kind({"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]),
                  "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])})
    out, acts = hookscope.run(model, batch, layers="proj")
    assert torch.equal(out, model(**dict(batch)))
    assert torch.equal(acts["proj"], model.proj(model.embed(batch["input_ids"])))


def test_run_passes_a_tokenizer_batch_encoding_as_keyword_arguments() -> None:
    transformers = pytest.importorskip("transformers")
    model = _Keywords()
    encoding = transformers.BatchEncoding({"input_ids": torch.tensor([[2, 7, 9, 3]]),
                                           "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    out, acts = hookscope.run(model, encoding, layers=["embed", "proj"])
    assert torch.equal(out, model(**encoding))
    assert torch.equal(acts["embed"], model.embed.weight[[2, 7, 9, 3]][None])


def test_run_keeps_a_dict_positional_when_forward_takes_one() -> None:
    class TakesDict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.lin(batch["image"])

    model, batch = TakesDict(), {"image": torch.randn(3, 2)}
    out, acts = hookscope.run(model, batch, layers="lin")
    assert torch.equal(out, model(batch)) and torch.equal(acts["lin"], out)


# ----------------------------------------------------------------------------- warnings' lines


def _capture(model: nn.Module, x: torch.Tensor) -> None:
    with hookscope.capture(model, "head", "relu"):
        model(x)


def _run(model: nn.Module, x: torch.Tensor) -> None:
    hookscope.run(model, x, layers=["head", "relu"])


def _edit(model: nn.Module, x: torch.Tensor) -> None:
    with hookscope.edit(model, {"relu": lambda out: out}):
        model(x)


def _edit_with_context(model: nn.Module, x: torch.Tensor) -> None:
    with hookscope.edit(model, {"head": lambda out, path, call: out}):  # no context=True
        model(x)


def _ablate(model: nn.Module, x: torch.Tensor) -> None:
    with hookscope.ablate(model, ["head", "relu"]):
        model(x)


def _steer(model: nn.Module, x: torch.Tensor) -> None:
    with hookscope.steer(model, {"relu": torch.ones(4)}):
        model(x)


def _patch(model: nn.Module, x: torch.Tensor) -> None:
    with hookscope.capture(model, "head") as clean:
        model(x)
    with hookscope.patch(model, source=clean, layers=["head", "aux_head"]):
        model(x)


def _stats(model: nn.Module, x: torch.Tensor) -> None:
    hookscope.stats(model, [x], layers=["head", "relu"])


def _clone_false_inference(model: nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode(), hookscope.capture(model, "backbone", "head", clone=False):
        model(x)


@pytest.mark.parametrize("use", [_capture, _run, _edit, _edit_with_context, _ablate, _steer, _patch, _stats,
                                 _clone_false_inference], ids=lambda f: f.__name__.strip("_"))
def test_every_warning_points_at_the_users_line(use: Callable[[nn.Module, torch.Tensor], Any]
                                                 ) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        use(UnusedBranch(), torch.randn(2, 4))
    assert caught, "the scenario must warn"
    assert [(w.filename, w.category.__name__) for w in caught] == [
        (__file__, w.category.__name__) for w in caught]


def test_edit_and_steer_given_a_list_say_they_take_a_dict() -> None:
    model = _mlp()
    with pytest.raises(EditError, match=r"edits must be a dict \{pattern: fn\}.*got a list.*ablate"):
        hookscope.edit(model, ["0"])  # type: ignore[arg-type]
    with pytest.raises(EditError, match=r"vectors must be a dict \{pattern: vector\}.*got a Tensor"):
        hookscope.steer(model, torch.ones(20))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- reading a capture


def test_a_capture_used_without_with_says_so() -> None:
    model, x = _mlp(), torch.randn(3, 10)
    acts = hookscope.capture(model, "0")
    model(x)
    with pytest.raises(hookscope.CaptureError, match=r"'0' never ran.*this capture was never "
                                                     r"entered.*with hookscope.capture.*hookscope.run"):
        acts["0"]
    with hookscope.capture(model, "0", "2") as acts:
        with pytest.raises(hookscope.CaptureError, match="no forward pass has run yet"):
            acts["0"]
        model(x)
    assert torch.equal(acts["0"], model[0](x))


def test_print_acts_shows_paths_calls_and_shapes_of_the_first_six() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(7)], nn.ReLU())
    with hookscope.capture(model, "**") as acts:
        model(torch.randn(2, 4))
        model(torch.randn(3, 4))
    assert repr(acts) == ("<hookscope.Capture 0: 2 calls, first 2x4, 1: 2 calls, first 2x4, "
                          "2: 2 calls, first 2x4, 3: 2 calls, first 2x4, 4: 2 calls, first 2x4, "
                          "5: 2 calls, first 2x4, … 2 more>")
    with hookscope.capture(model, "0", "7", on_unfired="ignore") as acts:
        model[0](torch.randn(5, 4))
    assert str(acts) == "<hookscope.Capture 0: 5x4, 7: never ran>"


# ----------------------------------------------------------------------------- error notes


def test_the_error_note_gives_the_inputs_of_forward_not_of_a_helper_method() -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 5), nn.ReLU())   # Conv2d.forward -> _conv_forward
    with pytest.raises(RuntimeError) as caught:
        with hookscope.capture(model, "1"):
            model(torch.randn(2, 4, 32, 32))
    assert caught.value.__notes__ == [
        "hookscope: raised inside '0' (Conv2d) called with input shapes [(2, 4, 32, 32)]"]
