"""Test-wide checks: every test must leave no hook behind on any live module."""

from __future__ import annotations

import gc
import logging
import os
import signal
import weakref
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings
from torch import nn

from hookscope.diagnostics.inventory import _is_internal, _registered_by
from hookscope.engine.door.tables import registered
from tests.s3_server import s3_endpoint  # noqa: F401  (a fixture for every test file)

# Every live module, kept weakly: scanning ``gc.get_objects()`` (~400,000 objects once torch and
# transformers are imported) took 0.15 s per scan, two scans per test: about 8 of the suite's
# minutes. Every module is made by ``nn.Module.__new__`` (a constructor, ``copy.deepcopy``,
# pickling, ``torch.jit``, fx's ``GraphModule``), so wrapping it sees every module made from here on;
# the one scan below adds those made before this file was imported.
_MODULES: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary(
    (id(obj), obj) for obj in gc.get_objects() if issubclass(type(obj), nn.Module))


def _tracked_new(cls: type[nn.Module], *args: object, **kwargs: object) -> nn.Module:
    module = object.__new__(cls)
    _MODULES[id(module)] = module
    return module


nn.Module.__new__ = staticmethod(_tracked_new)


def _live_hooks() -> set[tuple[int, str, int]]:
    """Hooks on live modules, except internal ones (weight_norm, lazy init: part of a model
    that a test built, not left behind by hookscope)."""
    found = set()
    for obj in list(_MODULES.values()):
        found.update((id(obj), kind, hid) for kind, hid, fn in registered(obj)
                     if not _is_internal(_registered_by(fn)))
    found.update((0, kind, hid) for kind, hid, _ in registered(None))
    return found


# Hypothesis: "ci" (the default) is deterministic, each property test drawing the same examples
# on every run (derandomize) at the count it asks for (100 where it names none), and prints the
# blob that replays a failure; "fuzz" (`make fuzz`, `--hypothesis-profile=fuzz`) draws fresh
# random examples, FUZZ_FACTOR times as many, and keeps what fails in .hypothesis/ to replay:
# turn each find into a test (an `@example` or a plain test holding the right value).
FUZZ_FACTOR = 10
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("fuzz", print_blob=True, deadline=None)
settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the "fuzz" profile, multiply every property test's own ``max_examples``."""
    if settings.get_current_profile_name() != "fuzz":
        return
    for item in items:
        test = getattr(item, "obj", None)
        chosen = getattr(test, "_hypothesis_internal_use_settings", None)
        if chosen is not None:
            test._hypothesis_internal_use_settings = settings(
                chosen, max_examples=chosen.max_examples * FUZZ_FACTOR)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what is alive once the tests are collected (torch, transformers, the test modules:
    ~400,000 objects) out of the garbage collector's reach: an explicit ``gc.collect()`` (the
    benchmarks call one per timed case, tests that check what is freed call it too) then walks
    only what the tests made since (0.28 s -> 0.00001 s each); nothing a test makes is frozen."""
    gc.collect()
    gc.freeze()


# Under pytest-xdist (`make test` runs one worker per core) each worker runs torch on one thread:
# workers on every core plus torch's own intra-op threads on every core would oversubscribe them.
# References are computed in the same worker, so they share its thread count.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


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


class _Kept(logging.Handler):
    """Keeps the messages logged to torch._dynamo's logger (it does not propagate to root)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def dynamo_warnings() -> Iterator[list[str]]:
    """The warnings torch._dynamo logs during the test (recompiles, graph breaks)."""
    kept, logger = _Kept(), logging.getLogger("torch._dynamo")
    logger.addHandler(kept)
    try:
        yield kept.messages
    finally:
        logger.removeHandler(kept)
