"""Blocks opened at once in several threads on one model share its hook-table entries
(``engine.hooks.ModuleHooks``): a hook of another thread's block joins an entry of the same
kind, and an entry stays until the last block it serves closes.

On a ``torch.compile(fullgraph=True)`` model, four threads opening five captures each failed in
11-12 of 20 blocks before (dynamo's ``Unsupported``, its "Guard failed on the same frame it was
created", then ``FailOnRecompileLimitHit``): each block's entries changed the tables that the
other threads' traces read and guarded on. Now no block fails, each records its own thread's
values, and the model compiles at most twice. The eager tests hold what sharing must keep:
each block records exactly its own thread's calls, a hook runs after every hook that was there
when it was registered (a user's hook is never overtaken), entries and compiled sinks go with
the last block, and copies leave shared entries out."""

from __future__ import annotations

import copy
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import hookscope
from hookscope.engine import compiled
from tests.test_compile_fullgraph import MODELS, _call

Tensor = torch.Tensor
THREADS, BLOCKS = 4, 5


@pytest.fixture
def interleaved() -> Iterator[None]:
    """Threads switch every 10 µs (Python's default: 5 ms), so they interleave inside blocks."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    torch._dynamo.reset()
    yield
    sys.setswitchinterval(before)
    torch._dynamo.reset()


def _tables_empty(model: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks or m._forward_hooks_with_kwargs
                   or m._forward_pre_hooks_with_kwargs for m in model.modules())


def _in_threads(work: Callable[[int], None]) -> list[str]:
    """Run ``work(t)`` in ``THREADS`` threads started together; the errors they raised."""
    errors: list[str] = []
    start = threading.Barrier(THREADS)

    def run(t: int) -> None:
        start.wait()
        try:
            work(t)
        except BaseException as err:  # noqa: BLE001 - a thread's error is only a warning to pytest
            errors.append(f"{type(err).__name__}: {str(err)[:300]}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    return errors


@pytest.mark.parametrize("inputs", [False, True], ids=["outputs", "inputs"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_blocks_in_four_threads_on_one_fullgraph_model_record_their_own_calls(
        name: str, inputs: bool, interleaved: None, dynamo_warnings: list[str]) -> None:
    make, data, pattern = MODELS[name]
    model, base = make(), data()
    batches = [{k: v if v.is_floating_point() is False else v + t for k, v in base.items()}
               for t in range(THREADS)]
    if name == "gpt2":  # other tokens per thread (ids stay in the vocabulary)
        batches = [{**base, "input_ids": (base["input_ids"] + 7 * t) % 60} for t in range(THREADS)]
    expected = []
    with torch.no_grad():
        for batch in batches:  # the eager capture, in this thread, under the same grad mode
            with hookscope.capture(model, pattern, inputs=inputs) as acts:
                _call(model, batch)
            expected.append(acts)
    counter = CompileCounterWithBackend("eager")
    compiled_model = torch.compile(model, backend=counter, fullgraph=True)
    # warmed up in one thread, as a server is: threads that make the first call of a compiled
    # model together each compile it (dynamo's own doing: 4 of 4 for the model without hooks)
    with torch.no_grad(), hookscope.capture(compiled_model, pattern, inputs=inputs):
        _call(compiled_model, batches[0])
    warm = counter.frame_count
    wrong: list[tuple[int, int, str]] = []

    def work(t: int) -> None:
        for block in range(BLOCKS):
            with torch.no_grad(), hookscope.capture(compiled_model, pattern, inputs=inputs) as acts:
                _call(compiled_model, batches[t])
            for key in expected[t].paths:
                if acts.counts[key] != 1 or not _same(acts[key], expected[t][key]):
                    wrong.append((t, block, key))
                if inputs and not _same_tensors(acts.inputs(key), expected[t].inputs(key)):
                    wrong.append((t, block, f"{key} inputs"))

    assert _in_threads(work) == []
    assert wrong == []
    assert counter.frame_count == warm == 1  # the graph with the hooks, never again per block
    assert dynamo_warnings == []
    assert _tables_empty(model)
    assert not any(key in compiled._sinks for m in model.modules() for key in compiled._places.get(m, []))


def _tensors(value: Any) -> list[Tensor]:
    """The tensors of a call's inputs, in order (objects a graph cannot hand out are left out:
    ``NotKept`` in a compiled capture, the object in an eager one)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _same(got: Any, want: Any) -> bool:
    a, b = _tensors(got), _tensors(want)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_tensors(got: Any, want: Any) -> bool:
    return _same((got.args, got.kwargs), (want.args, want.kwargs))


class Net(nn.Module):
    """``(batch, 4)`` -> ``(batch, 4)``: two Linear layers with a ReLU between."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)))


class Worker:
    """A thread that runs the functions handed to it, one at a time, when the test says: the
    test decides the exact order in which threads open, call and close."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self.done: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self.done.put((True, job()))
            except BaseException as err:  # noqa: BLE001 - handed back to the test
                self.done.put((False, err))

    def run(self, job: Callable[[], Any]) -> Any:
        self.jobs.put(job)
        ok, value = self.done.get(timeout=60)
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=60)


#: (worker, action): open a capture of ``a`` (with inputs or not), call the model, close the
#: worker's newest block, or add / remove the user's hook that doubles ``a``'s output
STEPS = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(
    ["open", "open inputs", "call", "call", "close", "user hook", "no user hook"])),
    min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(steps=STEPS)
@example(steps=[(0, "open"), (0, "user hook"), (1, "open"), (1, "call"), (0, "call")])  # no overtaking
@example(steps=[(0, "open inputs"), (1, "open inputs"), (0, "close"), (1, "call"), (0, "open"),
                (0, "call"), (2, "open"), (1, "close"), (2, "call")])  # the host leaves first
def test_shared_entries_give_each_block_exactly_its_threads_calls(
        steps: list[tuple[int, str]]) -> None:
    """Generated interleavings of three threads' blocks on one module, with a user's hook (it
    doubles the output) added and removed between them. Each block records exactly the calls
    its thread made while it was open, each value as a block registered at that moment sees
    it: doubled when the user's hook was there before the block opened (a block never runs
    ahead of a hook registered before it), plain otherwise. Once all close, no entry, flag or
    compiled sink is left."""
    model = Net().eval()
    workers = [Worker() for _ in range(3)]
    blocks: list[list[tuple[Any, Any, list[Tensor]]]] = [[], [], []]  # per worker: open blocks
    closed: list[tuple[Any, list[Tensor]]] = []
    user: list[Any] = []  # the user's handle while registered
    xs = [torch.full((1, 4), float(i + 1)) for i in range(3)]
    try:
        for i, action in steps:
            worker, x = workers[i], xs[i]
            if action.startswith("open"):
                block = hookscope.capture(model, "a", inputs=action == "open inputs",
                                          on_unfired="ignore")
                worker.run(block.__enter__)
                blocks[i].append((block, bool(user), []))
            elif action == "call":
                with torch.no_grad():  # the Linear, without the hooks
                    plain = nn.functional.linear(x, model.a.weight, model.a.bias)
                worker.run(lambda: model(x))  # noqa: B023 - run at once
                for _, after_user, wanted in blocks[i]:
                    wanted.append(plain * 2 if user and after_user else plain)
            elif action == "close" and blocks[i]:
                block, _, wanted = blocks[i].pop()
                worker.run(lambda: block.__exit__(None, None, None))  # noqa: B023
                closed.append((block, wanted))
            elif action == "user hook" and not user:
                user.append(model.a.register_forward_hook(lambda m, a, out: out * 2))
            elif action == "no user hook" and user:
                user.pop().remove()
        for i, worker in enumerate(workers):
            while blocks[i]:
                block, _, wanted = blocks[i].pop()
                worker.run(lambda: block.__exit__(None, None, None))  # noqa: B023
                closed.append((block, wanted))
    finally:
        for worker in workers:
            worker.stop()
        for handle in user:
            handle.remove()
    for block, wanted in closed:
        got = block.calls("a") if wanted else []
        assert len(got) == len(wanted)
        for value, want in zip(got, wanted):
            torch.testing.assert_close(value, want, rtol=0, atol=0)
    assert _tables_empty(model)
    assert not any(key in compiled._sinks for m in model.modules() for key in compiled._places.get(m, []))


def test_a_shared_entry_hosts_later_blocks_and_leaves_with_the_last() -> None:
    """Two threads' captures of one module share one entry in each table; the first block
    closing leaves it to the second, which still records; the second closing removes it."""
    model = Net().eval()
    first, second = Worker(), Worker()
    x = torch.ones(1, 4)
    try:
        a = hookscope.capture(model, "a", inputs=True, on_unfired="ignore")
        b = hookscope.capture(model, "a", inputs=True)
        first.run(a.__enter__)
        tables = (dict(model.a._forward_hooks), dict(model.a._forward_pre_hooks),
                  dict(model.a._forward_pre_hooks_with_kwargs))
        second.run(b.__enter__)
        assert (dict(model.a._forward_hooks), dict(model.a._forward_pre_hooks),
                dict(model.a._forward_pre_hooks_with_kwargs)) == tables  # nothing added
        assert [len(t) for t in tables] == [1, 1, 1]
        first.run(lambda: a.__exit__(None, None, None))
        assert dict(model.a._forward_hooks) == tables[0]  # kept for the second block
        second.run(lambda: model(x))
        copied = second.run(lambda: copy.deepcopy(model))  # a copy made in the second block
        assert _tables_empty(copied)  # the flag of the entry the first block wrote is left out
        second.run(lambda: b.__exit__(None, None, None))
    finally:
        first.stop()
        second.stop()
    assert _tables_empty(model)
    with torch.no_grad():
        want = model.a(x)
    assert b.counts["a"] == 1 and torch.equal(b["a"], want) and a.counts["a"] == 0
    assert torch.equal(b.inputs("a")[0], x)
