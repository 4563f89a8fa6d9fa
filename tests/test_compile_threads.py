"""Blocks opened at once in several threads on one model share its hook-table entries
(``engine.door.sharing.ModuleHooks``): a hook of another thread's block joins an entry of the same
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
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch._dynamo
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import hookscope
from hookscope.engine.compile import graph as compiled
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
    assert not any(key in compiled._sinks for m in model.modules()
                   for keys in compiled._places.get(m, {}).values() for key in keys)


EDITS: dict[str, Callable[[nn.Module, int, list[Any]], Any]] = {  # thread t's own edit
    "edit": lambda model, t, refs: hookscope.edit(model, {"3.0": lambda out: out * (t + 2)}),
    "steer": lambda model, t, refs: hookscope.steer(model, {"3.0": torch.full((8,), float(t))}),
    # the mean of thread t's own reference capture (threads whose blocks hook *other* modules
    # make other tables: a compile per combination, see docs/capture.md)
    "ablate": lambda model, t, refs: hookscope.ablate(model, ["3.0"], how="mean", reference=refs[t]),
}


@pytest.mark.parametrize("verb", list(EDITS))
def test_edits_in_four_threads_on_one_fullgraph_model_each_apply_their_own(
        verb: str, interleaved: None, dynamo_warnings: list[str]) -> None:
    """The edit verbs across threads: each thread's block applies its own edit to its own
    calls only (the output equals the eager model under that thread's edit alone), and the
    model compiles no more after the warm-up."""
    make, data, _ = MODELS["mlp"]
    model, x = make(), data()["input"]
    expected, refs = [], []
    with torch.no_grad():
        for t in range(THREADS):
            with hookscope.capture(model, "3.0") as ref:
                model(x + t)
            refs.append(ref)
            with EDITS[verb](model, t, refs):
                expected.append(model(x))
    counter = CompileCounterWithBackend("eager")
    compiled_model = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad(), EDITS[verb](compiled_model, 0, refs):
        compiled_model(x)
    warm, wrong = counter.frame_count, []

    def work(t: int) -> None:
        for block in range(BLOCKS):
            with torch.no_grad(), EDITS[verb](compiled_model, t, refs):
                got = compiled_model(x)
            if not torch.equal(got, expected[t]):
                wrong.append((t, block))

    assert _in_threads(work) == []
    assert wrong == [] and counter.frame_count == warm and dynamo_warnings == []
    assert _tables_empty(model)


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


def _no_grad(model: nn.Module, x: Tensor) -> Tensor:
    """``model(x)`` under ``torch.no_grad()`` (grad mode is the calling thread's own)."""
    with torch.no_grad():
        return model(x)


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
@example(steps=[(0, "user hook"), (0, "open"), (0, "no user hook"), (0, "user hook"),
                (0, "call")])  # a user's hook registered again comes after the block (make fuzz)
@example(steps=[(0, "open inputs"), (1, "open inputs"), (0, "close"), (1, "call"), (0, "open"),
                (0, "call"), (2, "open"), (1, "close"), (2, "call")])  # the host leaves first
def test_shared_entries_give_each_block_exactly_its_threads_calls(
        steps: list[tuple[int, str]]) -> None:
    """Generated interleavings of three threads' blocks on one module, with a user's hook (it
    doubles the output) added and removed between them. Each block records exactly the calls
    its thread made while it was open, each value as a block registered at that moment sees
    it: doubled when the user's hook there now was there before the block opened (a block
    never runs ahead of a hook registered before it), plain otherwise. Once all close, no entry, flag or
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
                blocks[i].append((block, user[0] if user else None, []))  # the user's hook before it
            elif action == "call":
                with torch.no_grad():  # the Linear, without the hooks
                    plain = nn.functional.linear(x, model.a.weight, model.a.bias)
                worker.run(lambda: model(x))  # noqa: B023 - run at once
                for _, before, wanted in blocks[i]:
                    wanted.append(plain * 2 if user and user[0] is before else plain)
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
    assert not any(key in compiled._sinks for m in model.modules()
                   for keys in compiled._places.get(m, {}).values() for key in keys)


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


# ---------------------------------------------------------------- found by an attack (session 11)
def test_a_joined_block_says_its_module_ran_only_in_other_threads() -> None:
    """A block sharing another thread's entry counts that thread's calls as foreign, both ways:
    its report says the module ran in other threads, not that no forward pass ran."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for caller in (0, 1):
        workers = [Worker(), Worker()]
        try:
            blocks = [hookscope.capture(model, "0", on_unfired="ignore") for _ in workers]
            for worker, block in zip(workers, blocks):
                worker.run(block.__enter__)
            assert len(model[0]._forward_hooks) == 1  # shared
            workers[caller].run(lambda: model(torch.ones(1, 4)))  # noqa: B023 - run at once
            for worker, block in zip(workers, blocks):
                worker.run(lambda: block.__exit__(None, None, None))  # noqa: B023
        finally:
            for worker in workers:
                worker.stop()
        silent = blocks[1 - caller]
        assert blocks[caller].counts["0"] == 1 and silent.counts["0"] == 0
        assert "ran 1 time, all in other threads" in silent.unfired["0"]


def test_blocks_of_two_hooks_of_one_kind_per_thread_keep_the_tables_as_they_are(
        interleaved: None, dynamo_warnings: list[str]) -> None:
    """Each request opens a capture and a steer of one module (two witnesses of one kind on
    the next module): the n-th thread's hooks joined the last entry, then needed one of their
    own, so the tables grew by one entry per open request, each a recompile, and the ninth
    raised dynamo's FailOnRecompileLimitHit. Each hook now joins the earliest entry it can."""
    model = Net().eval()
    counter = CompileCounterWithBackend("eager")
    compiled_model = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.ones(1, 4)

    def blocks() -> list[Any]:
        return [hookscope.capture(compiled_model, "a"),
                hookscope.steer(compiled_model, {"a": torch.ones(4)})]

    with torch.no_grad(), blocks()[0] as acts, blocks()[1]:
        want = compiled_model(x)
    workers, opened, tables = [Worker() for _ in range(9)], [], None
    try:
        for worker in workers:
            pair = blocks()
            for block in pair:
                worker.run(block.__enter__)  # noqa: B023 - run at once
            opened.append((worker, pair))
            got = worker.run(lambda: _no_grad(compiled_model, x))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            now = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
            assert now == (tables := tables or now)  # as the first request left them
        for worker, pair in opened:
            for block in reversed(pair):
                worker.run(lambda: block.__exit__(None, None, None))  # noqa: B023
            assert pair[0].counts["a"] == 1 and torch.equal(pair[0]["a"], acts["a"])
    finally:
        for worker in workers:
            worker.stop()
    assert counter.frame_count == 1 and dynamo_warnings == []
    assert _tables_empty(model)


def test_a_model_compiled_in_another_thread_checks_for_new_hooks() -> None:
    """torch 2.13 keeps a dynamo setting per thread: hookscope turned hook guards on in the
    thread that first opened a block only, so code compiled in a worker thread ignored later
    blocks there (an ablation did nothing, with a warning blaming code compiled earlier)."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
    compiled_model = torch.compile(model, backend="eager")
    x = torch.ones(1, 4)
    with torch.no_grad(), hookscope.capture(compiled_model, "0"):
        compiled_model(x)
    worker = Worker()
    try:
        def compile_then_ablate() -> tuple[Tensor, dict[str, int]]:
            with torch.no_grad():
                compiled_model(x)  # compiled here, without a block
                with hookscope.ablate(compiled_model, "2") as ablation:
                    return compiled_model(x), ablation.counts
        out, counts = worker.run(compile_then_ablate)
    finally:
        worker.stop()
        torch._dynamo.reset()
    assert torch.equal(out, torch.zeros(1, 4)) and counts == {"2": 1}


def test_a_compile_in_another_thread_leaves_eager_hooks_their_thread_checks() -> None:
    """``torch.compiler.is_compiling()`` is True in every thread while any thread compiles: a
    hook running eagerly meanwhile took the traced branch, with no thread check, so one
    thread's call ran another thread's edit. The compile here waits in its backend while the
    eager calls run."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.ones(1, 4)
    inside, leave = threading.Event(), threading.Event()

    def waiting_backend(gm: Any, example_inputs: Any) -> Any:
        inside.set()
        leave.wait(60)
        return gm.forward

    compiling = threading.Thread(target=lambda: torch.compile(
        lambda t: t * 2 + 1, backend=waiting_backend)(torch.ones(3)))
    doubling, tripling = Worker(), Worker()
    edits = [hookscope.edit(model, {"0": lambda o: o * 2}, on_unfired="ignore"),
             hookscope.edit(model, {"0": lambda o: o * 3})]
    try:
        doubling.run(edits[0].__enter__)
        tripling.run(edits[1].__enter__)
        alone = tripling.run(lambda: model(x)).detach()
        compiling.start()
        assert inside.wait(60) and torch.compiler.is_compiling()
        during = tripling.run(lambda: model(x)).detach()
    finally:
        leave.set()
        compiling.join(60)
        for worker, edit in zip((doubling, tripling), edits):
            worker.run(lambda: edit.__exit__(None, None, None))  # noqa: B023
            worker.stop()
        torch._dynamo.reset()
    with torch.no_grad():
        want = model[2](torch.relu(model[0](x) * 3))
    torch.testing.assert_close(alone, want, rtol=0, atol=0)
    torch.testing.assert_close(during, want, rtol=0, atol=0)
    assert edits[0].counts == {"0": 0} and edits[1].counts == {"0": 2}


def test_an_export_in_another_thread_leaves_eager_captures_alone() -> None:
    """``torch.compiler.is_exporting()`` is one flag for the process: while a thread exported
    another model, every eager capture in other threads raised 'torch.export.export traced the
    model'. The export here waits inside its traced forward while the capture runs."""
    inside, leave = threading.Event(), threading.Event()

    class Waiting(nn.Module):
        def forward(self, t: Tensor) -> Tensor:
            inside.set()
            leave.wait(60)
            return t + 1

    exporting = threading.Thread(target=lambda: torch.export.export(Waiting(), (torch.ones(2),),
                                                                    strict=False))
    model = Net().eval()
    x = torch.ones(1, 4)
    exporting.start()
    try:
        assert inside.wait(60) and torch.compiler.is_exporting()
        with torch.no_grad(), hookscope.capture(model, "a") as acts:
            model(x)
    finally:
        leave.set()
        exporting.join(60)
    with torch.no_grad():
        assert torch.equal(acts["a"], model.a(x))


def test_a_thread_without_an_edit_is_told_why_a_fullgraph_call_with_gradients_fails(
        interleaved: None) -> None:
    """A fullgraph model holds another thread's open edit as an operator without a derivative:
    a call with gradients cannot pass it in any thread (gradients would stop there). The error
    says it is another thread's edit and what to do."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
    compiled_model = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.ones(1, 4)
    with torch.no_grad(), hookscope.edit(compiled_model, {"0": lambda o: o * 2}):
        compiled_model(x)
    worker = Worker()
    edit = hookscope.edit(compiled_model, {"0": lambda o: o * 2}, on_unfired="ignore")
    try:
        worker.run(edit.__enter__)
        with pytest.raises(hookscope.EditError, match="another thread's edit block is open"):
            compiled_model(x)
        with torch.no_grad():
            torch.testing.assert_close(compiled_model(x), model(x), rtol=0, atol=0)  # unedited here
    finally:
        worker.run(lambda: edit.__exit__(None, None, None))
        worker.stop()


def test_removing_hooks_waits_for_a_trace_in_another_thread() -> None:
    """``remove_hooks`` changed hook tables outside dynamo's compile lock: another thread's
    trace then met a table changing under it (IndexError from dynamo's guard builder,
    'OrderedDict mutated during iteration'). It now waits while a trace holds the lock."""
    import torch._dynamo.convert_frame as frames
    model = Net().eval()
    handle = model.a.register_forward_hook(lambda m, a, out: None)
    done = threading.Event()
    remover = threading.Thread(target=lambda: (hookscope.remove_hooks(model), done.set()))
    with frames.compile_lock:  # a trace in progress
        remover.start()
        assert not done.wait(0.3) and len(model.a._forward_hooks) == 1
    remover.join(60)
    assert done.is_set() and not model.a._forward_hooks
    handle.remove()


def test_a_flag_is_left_out_of_copies_before_it_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's ``with_kwargs`` flag was written before the block noted it as its own
    (``copies.KeptOut``): a ``deepcopy`` made by another thread in between carried it. Each
    flag is now noted first, the host's flag by each block that joins it too."""
    from hookscope.engine.door import copies as copies_module
    noted: list[tuple[int, bool]] = []
    add_entry = copies_module.KeptOut.add_entry

    def noting(self: Any, table: Any, key: int) -> None:
        noted.append((key, key in table))
        add_entry(self, table, key)

    monkeypatch.setattr(copies_module.KeptOut, "add_entry", noting)
    model = Net().eval()
    worker = Worker()
    try:
        blocks = [hookscope.capture(model, "a", inputs=True, on_unfired="ignore") for _ in range(2)]
        blocks[0].__enter__()
        worker.run(blocks[1].__enter__)  # joins: notes the host's flag, already written
        copied = worker.run(lambda: copy.deepcopy(model))
        blocks[0].__exit__(None, None, None)
        copied_after = worker.run(lambda: copy.deepcopy(model))  # the host's block is gone
        worker.run(lambda: blocks[1].__exit__(None, None, None))
    finally:
        worker.stop()
    hosted = [key for key, _ in noted[:2]]  # the root's and a's flags, by the first block
    assert [written for _, written in noted[:2]] == [False, False]
    assert [key for key, _ in noted[2:]] == hosted  # the joining block notes the same flags
    assert _tables_empty(copied) and _tables_empty(copied_after) and _tables_empty(model)


_BEFORE_DYNAMO = """
import queue, sys, threading, warnings
import torch
from torch import nn
import hookscope
warnings.simplefilter("ignore")

class Worker:  # runs each job handed to it in a thread of its own, when told
    def __init__(self):
        self.jobs, self.done = queue.Queue(), queue.Queue()
        threading.Thread(target=lambda: [self.done.put(job()) for job in iter(self.jobs.get, None)],
                         daemon=True).start()
    def run(self, job):
        self.jobs.put(job)
        return self.done.get(timeout=60)
    def stop(self):
        self.jobs.put(None)

class Net(nn.Module):  # tests.test_compile_threads.Net (a Sequential did not show it)
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

model = Net().eval()
x1, x2 = torch.ones(1, 4), torch.full((1, 4), 2.0)
first, second = Worker(), Worker()
assert "torch._dynamo" not in sys.modules
a = hookscope.capture(model, "a", on_unfired="ignore")
first.run(a.__enter__)  # a long-lived block, opened before anything compiled
import torch._dynamo
compiled = torch.compile(model, backend="eager")
b = hookscope.capture(compiled, "a", on_unfired="ignore")
second.run(b.__enter__)
second.run(lambda: compiled(x2))
first.run(lambda: model(x1))
second.run(lambda: b.__exit__(None, None, None))
first.run(lambda: a.__exit__(None, None, None))
with torch.no_grad():
    print(torch.equal(a.calls("a")[0], model.a(x1)), a.counts["a"],
          b.counts["a"] == 1 and torch.equal(b.calls("a")[0], model.a(x2)), b.counts["a"])
first.stop(); second.stop()
"""


def test_a_block_on_a_compiled_model_does_not_join_one_opened_before_dynamo_loaded() -> None:
    """An entry made before ``torch._dynamo`` was loaded has no compiled sink: a traced call
    runs its host's function, never a guest's. A block of another thread on the compiled
    model joined it and recorded nothing (its call went to the first block)."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _BEFORE_DYNAMO], capture_output=True, text=True,
                          timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "1", "True", "1"]


class _Pair(NamedTuple):
    h: Tensor
    g: Tensor


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> _Pair:
        h = self.lin(x)
        return _Pair(h, h * 2)


class _Outer(nn.Module):
    """A module returning a namedtuple inside (as a Hugging Face model returns ModelOutputs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.out = _Inner(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.inner(x).g)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_namedtuple_output_is_kept_in_the_graph_for_its_own_thread(fullgraph: bool) -> None:
    """An output holding an object was captured by tracing the hook itself into the graph,
    with no thread check: a block recorded every thread's calls (and, sharing an entry, a
    joined block none). A namedtuple (and a ModelOutput) is now kept by the graph's operator
    as its fields and built again, so each block gets its own thread's calls, as its class."""
    torch._dynamo.reset()
    model = _Outer().eval()
    compiled_model = torch.compile(model, backend="eager", fullgraph=fullgraph)
    xs = [torch.ones(1, 4), torch.full((1, 4), 3.0)]
    with torch.no_grad(), hookscope.capture(compiled_model, "inner"):
        compiled_model(xs[0])
    workers = [Worker(), Worker()]
    blocks = [hookscope.capture(compiled_model, "inner", on_unfired="ignore") for _ in workers]
    try:
        for worker, block in zip(workers, blocks):
            worker.run(block.__enter__)
        for worker, x in zip(workers, xs):
            worker.run(lambda: _no_grad(compiled_model, x))  # noqa: B023 - run at once
        for worker, block in zip(workers, blocks):
            worker.run(lambda: block.__exit__(None, None, None))  # noqa: B023
    finally:
        for worker in workers:
            worker.stop()
        torch._dynamo.reset()
    for block, x in zip(blocks, xs):
        with torch.no_grad():
            want = model.inner(x)
        (got,) = block.calls("inner")
        assert type(got) is _Pair and torch.equal(got.h, want.h) and torch.equal(got.g, want.g)


def test_gpt2s_model_output_is_kept_with_its_cache_named() -> None:
    """GPT-2's ``transformer`` returns a ModelOutput holding a KV cache: inside a fullgraph
    model the capture is the same ModelOutput class, its tensors equal eager, and the cache,
    an object no graph hands out, ``NotKept``."""
    from tests.models import tiny_gpt2
    torch._dynamo.reset()
    model = tiny_gpt2()
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad(), hookscope.capture(model, "transformer") as eager:
        model(ids)
    compiled_model = torch.compile(model, backend="eager", fullgraph=True)
    try:
        with torch.no_grad(), hookscope.capture(compiled_model, "transformer") as acts:
            compiled_model(ids)
    finally:
        torch._dynamo.reset()
    got, want = acts["transformer"], eager["transformer"]
    assert type(got) is type(want) and list(got.keys()) == list(want.keys())
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-5, atol=1e-6)
    assert got.past_key_values == hookscope.NotKept(type(want.past_key_values).__name__)
