"""``engine.mode_stack.entered``: a mode pushed for a block is taken off once, on every way out.
``take_off`` searches the whole heap when the mode is no longer on the stack, so the exit's
guard (``interrupts.never_skipped``) must not call it again after a normal exit (10 ms a block
with 173k objects alive, found in review)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hookscope.engine import mode_stack


class _Mode(TorchFunctionMode):
    pass


@pytest.mark.parametrize("fails", [False, True])
def test_a_block_takes_its_mode_off_once_and_leaves_the_stack_as_found(
        monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    calls = []
    take_off = mode_stack.take_off
    monkeypatch.setattr(mode_stack, "take_off", lambda mode: (calls.append(mode), take_off(mode)))
    before = torch._C._len_torch_function_stack()
    mode = _Mode()
    with pytest.raises(ValueError) if fails else contextlib.nullcontext():
        with mode_stack.entered(mode):
            assert torch._C._len_torch_function_stack() == before + 1
            if fails:
                raise ValueError("inside the block")
    assert calls == [mode]
    assert torch._C._len_torch_function_stack() == before

