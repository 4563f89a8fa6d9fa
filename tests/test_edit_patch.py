"""Activation patching: call k gets call k of the source; shapes checked; none patched, none changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookscope
from hookscope import EditError
from tests.models import LeNet, ModuleListBlocks, SharedLinear, TupleOutput


@pytest.mark.parametrize("layers", ["pos_block.*", "pos_block.3", "head"])
def test_patching_with_the_clean_run_gives_the_clean_output(layers: str) -> None:
    model = ModuleListBlocks()
    clean, corrupted = torch.randn(1, 8, 6, 6), torch.randn(1, 8, 6, 6)
    with hookscope.capture(model, layers) as acts:
        clean_out = model(clean)
    with hookscope.patch(model, source=acts, layers=layers):
        patched = model(corrupted)
    assert torch.allclose(patched, clean_out)
    assert not torch.allclose(model(corrupted), clean_out)


def test_patching_every_record_of_the_source_by_default() -> None:
    model = LeNet()
    clean, corrupted = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32)
    with hookscope.capture(model, "**") as acts:
        clean_out = model(clean)
    with hookscope.patch(model, source=acts):
        assert torch.allclose(model(corrupted), clean_out)


def test_patching_no_layer_is_refused_as_every_empty_selection_is() -> None:
    model = ModuleListBlocks()
    with hookscope.capture(model, "pos_block.*") as acts:
        model(torch.randn(1, 8, 6, 6))
    with pytest.raises(hookscope.EmptySelectionError, match=r"layers selects nothing \(got \[\]\)"):
        hookscope.patch(model, source=acts, layers=[])


def test_call_k_gets_call_k_of_the_source() -> None:
    model = SharedLinear()
    clean, corrupted = torch.randn(2, 6), torch.randn(2, 6)
    with hookscope.capture(model, "lin") as acts:
        model(clean)
    first, second = acts.calls("lin")
    with hookscope.capture(model, "lin") as patched:
        with hookscope.patch(model, source=acts, layers="lin"):
            out = model(corrupted)
    assert torch.equal(out, second)  # the last call's value is the model's output
    with hookscope.patch(model, source=acts, layers="lin"), hookscope.capture(model, "lin") as seen:
        model(corrupted)
    assert torch.equal(seen["lin", 0], first) and torch.equal(seen["lin", 1], second)
    assert patched.counts == {"lin": 2}


def test_patch_from_a_saved_file_with_a_tuple_output(tmp_path: Path) -> None:
    model = TupleOutput()
    clean, corrupted = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    with hookscope.capture(model, "lstm") as acts:
        clean_out = model(clean)
    file = tmp_path / "clean.safetensors"
    acts.save(str(file))
    with hookscope.patch(model, source=hookscope.load(str(file)), layers="lstm"):
        assert torch.allclose(model(corrupted), clean_out)
    out, _ = model.lstm(corrupted)
    expected = model.fc(out[:, -1] + acts["lstm"][1][0][0])
    with hookscope.patch(model, source=file, layers="lstm[1][0]"):  # h only; out stays corrupted
        assert torch.allclose(model(corrupted), expected)


def test_shape_mismatch_names_layer_shapes_and_call() -> None:
    model = LeNet()
    with hookscope.capture(model, "conv2") as acts:
        model(torch.randn(2, 3, 32, 32))
    with pytest.raises(EditError, match=r"call 0 of 'conv2'.*\(2, 16, 10, 10\).*\(1, 16, 10, 10\)"):
        with hookscope.patch(model, source=acts, layers="conv2"):
            model(torch.randn(1, 3, 32, 32))


def test_source_without_the_layer_or_the_call() -> None:
    model = SharedLinear()
    with hookscope.capture(model, "lin") as acts:
        model.lin(torch.randn(2, 6))  # one call only
    with pytest.raises(EditError, match=r"reached call 1.*holds 1 call"):
        with hookscope.patch(model, source=acts, layers="lin"):
            model(torch.randn(2, 6))
    lenet = LeNet()
    with pytest.raises(EditError, match="holds no record of 'fc1'"):
        with hookscope.patch(lenet, source=acts, layers="fc1"):
            lenet(torch.randn(1, 3, 32, 32))
