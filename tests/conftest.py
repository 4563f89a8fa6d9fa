"""Test-wide checks: every test must leave no hook behind on any live module."""

from __future__ import annotations

import gc
import signal
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from hookscope.diagnostics.inventory import _GLOBAL_DICTS, _HOOK_DICTS, _is_internal, _registered_by


def _live_hooks() -> set[tuple[int, str, int]]:
    """Hooks on live modules, except internal ones (weight_norm, lazy init: part of a model
    that a test built, not left behind by hookscope)."""
    found = set()
    module_type = nn.Module
    for obj in gc.get_objects():
        if issubclass(type(obj), module_type):  # type(), not isinstance: no __class__ lookups
            for attr in _HOOK_DICTS.values():
                found.update((id(obj), attr, hid) for hid, fn in getattr(obj, attr).items()
                             if not _is_internal(_registered_by(fn)))
    for attr in _GLOBAL_DICTS.values():
        found.update((0, attr, hid) for hid in getattr(torch_module, attr))
    return found


# A shell's background job starts with SIGINT ignored, and every child inherits that
# disposition: Ctrl-C tests would then interrupt nothing. Python's own handler, installed here,
# makes the suite behave the same from any shell, and a child (exec resets a handled signal to
# SIG_DFL) starts with Python's default KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def no_hooks_left_behind() -> Iterator[None]:
    """Fail a test that leaves any forward/pre/backward or global hook it added."""
    before = _live_hooks()
    torch.manual_seed(0)
    yield
    left = _live_hooks() - before
    assert not left, f"test left {len(left)} hooks behind: {sorted(left)[:5]}"


@pytest.fixture(scope="module")
def process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo group of one process (FSDP, DDP and DTensor need one; a file, not a port,
    rendezvous), torn down after the module's tests; an existing group is left alone."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def minilm() -> object:
    """MiniLM with its shipped weights and tokenizer (``hookscope.zoo.models.load_model``); the
    test is skipped, naming why, where the ``[text]`` extra is missing."""
    import hookscope
    from hookscope.zoo.models import load_model

    try:
        return load_model("minilm")
    except hookscope.HookscopeError as err:
        pytest.skip(str(err))
