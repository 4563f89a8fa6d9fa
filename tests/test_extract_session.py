"""extract keeps one hook session across batches: hooks are registered twice in all (the
first batch's check, then one session), never once per batch; and an in-place write to a kept
output on a later batch never changes the stored row (copy-on-write, see ``_inplace.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.engine.door.hooks import OwnedHook
from hookscope.engine.door.sharing import ModuleHooks
from hookscope.store.extraction import extract
from tests.models import LeNet


def test_hooks_are_registered_once_for_all_batches(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = LeNet().eval()
    registered: list[str] = []
    original, original_bulk = ModuleHooks.add, ModuleHooks.add_forward  # the doors of every
    # session's module hooks: one at a time, and the capture's forward hooks in bulk

    def counting(self: ModuleHooks, owned: OwnedHook, *, pre: bool = False,
                 with_kwargs: bool = False) -> None:
        if not pre:
            registered.append(type(owned.module).__name__)
        original(self, owned, pre=pre, with_kwargs=with_kwargs)

    def counting_bulk(self: ModuleHooks, hooks: list[OwnedHook]) -> None:
        registered.extend(type(owned.module).__name__ for owned in hooks)
        original_bulk(self, hooks)

    monkeypatch.setattr(ModuleHooks, "add", counting)
    monkeypatch.setattr(ModuleHooks, "add_forward", counting_bulk)
    images = torch.randn(40, 3, 32, 32)
    store = extract(model, TensorDataset(images), ["conv2", "fc1"], tmp_path / "s", batch_size=4,
                    progress=False)
    assert registered.count("Conv2d") == 2 and registered.count("Linear") == 2  # not 2 x 10
    with torch.no_grad():
        expected = model.fc1(model.pool(torch.relu(model.conv2(
            model.pool(torch.relu(model.conv1(images)))))).flatten(1))
    torch.testing.assert_close(store["fc1"][:], expected)


class _LateInPlace(nn.Module):
    """``lin``'s output is zeroed in place, but only for inputs whose sum is large."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if x.sum() > 100:  # a data-dependent branch: not seen on the first batches
            y.mul_(0)
        return y


def test_a_late_in_place_write_stores_what_the_module_returned(tmp_path: Path) -> None:
    """The write comes on the third batch only, after the capture had seen two batches with
    none; copy-on-write capture keeps the value from before the write, so every row is right."""
    model = _LateInPlace().eval()
    x = torch.ones(12, 3)
    x[8:] = 100.0  # the third batch of 4 takes the in-place branch
    rows = extract(model, TensorDataset(x), "lin", tmp_path / "s", batch_size=4,
                   progress=False)["lin"][:]
    with torch.no_grad():
        expected = model.lin(x)  # what lin returned, before the write
    assert bool(expected[8:].abs().sum() > 0)  # the write would have zeroed these rows
    torch.testing.assert_close(rows, expected)
