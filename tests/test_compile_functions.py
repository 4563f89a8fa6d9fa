"""Issue 32: function addresses (``path::fn``) inside ``torch.compile(model, fullgraph=True)``.

The calls a forward makes (``F.relu``, ``scaled_dot_product_attention``, ``x + y``) are seen by a
``TorchFunctionMode`` that the compile wrapper's own pre-hook enters for the whole call, where
dynamo traces it; each call a capture wants leaves the graph by one ordered operator
(``engine.function_mode``), and a call an edit wants goes through ``hookscope::replace``. These
tests hold: no graph break, values (outputs, arguments, keywords; an edited forward's output)
equal eager mode's, opening and closing blocks compiles at most twice, the "never made" report
names what the forward did make, other threads' calls are not recorded, and nothing is left on
torch's mode stack.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import hookscope
from tests.models import tiny_gpt2
from tests.test_compile_fullgraph import (
    BLOCKS,
    _assert_same,
    _call,
    _cnn,
    _mlp,
    fresh_dynamo,  # noqa: F401 - autouse: each test compiles from nothing
)
from tests.test_compile_fullgraph import MODELS as MODULE_MODELS

Tensor = torch.Tensor
GPT2_INPUTS = MODULE_MODELS["gpt2"][1]()
#: name: (model, inputs, function addresses): of a submodule, of the compiled module itself
#: ("::add_": the CNN's ``z += y``, an in-place call), an occurrence, one call per block
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, Tensor]], list[str]]] = {
    "mlp": (_mlp, lambda: {"input": torch.randn(2, 8)}, ["*.0::linear", "*.1::relu"]),
    "cnn": (_cnn, lambda: {"input": torch.randn(2, 3, 6, 6)}, ["::add_", "relu::relu", "conv::conv2d"]),
    "gpt2": (tiny_gpt2, lambda: dict(GPT2_INPUTS),
             ["transformer.h.*.attn::scaled_dot_product_attention", "transformer.h.0.attn::transpose#1",
              "transformer::add", "transformer::dropout"]),
}


def _assert_like_eager(acts: Any, eager: Any, *, times: int = 1, exact: bool = False) -> None:
    """Each address ran ``times`` as often as in the eager capture, every call's output and
    inputs as eager's (``exact``: equal tensors), bound to the function's parameters
    (``named``: how torch splits a call into positions and keywords differs, ``F.relu(x)`` is
    ``(x,), {'inplace': False}`` in eager mode and ``(x,), {}`` in a graph). (A wide
    pattern, ``*.0``, on the compile wrapper also matches the module it wraps, ``_orig_mod.0``
    shown as ``0``: such a record holds nothing when its eager twin is not in the eager
    capture.)"""
    assert eager.counts and {k: acts.counts[k] for k in eager.counts} == {
        k: c * times for k, c in eager.counts.items()}
    assert all(c == 0 for k, c in acts.counts.items() if k not in eager.counts)
    for key, count in eager.counts.items():
        for k in range(count * times):
            want, got = eager.inputs(key, k % count), acts.inputs(key, k)
            _assert_same(got.named, want.named, exact=exact)
            _assert_same(acts.calls(key)[k], eager.calls(key)[k % count], exact=exact)


def _assert_same_report(got: dict[str, str], want: dict[str, str]) -> None:
    """The same silent addresses, with the same reasons; the names a forward made (``it made:
    a, b``) are eager's, in order, less what dynamo computes while it traces and never calls
    in the graph (``x.shape``, ``x.dtype``: a tensor's attributes)."""
    assert list(got) == list(want)
    for key, reason in want.items():
        head, _, made = reason.partition("it made: ")
        assert got[key].startswith(head)
        names = got[key][len(head):].removeprefix("it made: ").split(" (")[0].split(", ")
        wanted = made.split(" (")[0].split(", ")
        assert [n for n in wanted if n in names] == names


def _unhooked(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(MODELS))
def test_function_addresses_in_a_full_graph_equal_eager_and_compile_twice(
        name: str, backend: str, dynamo_warnings: list[str]) -> None:
    make, data, patterns = MODELS[name]
    model, inputs = make(), data()
    with torch.no_grad(), hookscope.capture(model, patterns, inputs=True) as eager:
        expected = _call(model, inputs)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(BLOCKS if backend == "eager" else 3):
            with hookscope.capture(compiled, patterns, inputs=True, on_unfired="error") as acts:
                out = _call(compiled, inputs)
                _call(compiled, inputs)
            assert torch._C._len_torch_function_stack() == 0
            _call(compiled, inputs)  # no hooks: its own graph
    assert counter.frame_count <= 2
    assert [m for m in dynamo_warnings if "recompil" in m or "graph break" in m.lower()] == []
    _assert_like_eager(acts, eager, times=2, exact=backend == "eager")
    logits = out if isinstance(out, Tensor) else out.logits
    torch.testing.assert_close(logits, expected if isinstance(out, Tensor) else expected.logits)
    assert _unhooked(model)
    if name == "gpt2":  # attention's query, key and value, and its flags, as eager has them
        call = acts.inputs("transformer.h.0.attn::scaled_dot_product_attention")
        assert [a.shape for a in call.args[:3]] == [torch.Size([2, 4, 4, 8])] * 3


@pytest.mark.parametrize("options", [{"dtype": torch.float64}, {"reduce": "mean"}, {"to": "cpu"},
                                     {"clone": True}])
def test_function_addresses_in_a_full_graph_take_the_capture_options(options: dict[str, Any]) -> None:
    model, inputs = _cnn(), {"input": torch.randn(2, 3, 6, 6)}
    patterns = ["relu::relu", "::add_"]
    with torch.no_grad(), hookscope.capture(model, patterns, **options) as eager:
        model(inputs["input"])
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad(), hookscope.capture(compiled, patterns, **options) as acts:
        compiled(inputs["input"])
    for key in patterns:
        assert acts.counts[key] == eager.counts[key] == 1
        assert acts[key].dtype == eager[key].dtype and torch.equal(acts[key], eager[key])


def test_an_in_place_call_is_kept_as_it_returned_not_as_the_forward_left_it() -> None:
    """``F.relu(y, inplace=True)`` then ``y.add_(1)``: the relu's output is kept as the relu
    made it. (Handed out at the end of the forward, it held the +1: found while building.)"""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x: Tensor) -> Tensor:
            y = F.relu(self.conv(x), inplace=True)
            y.add_(1)
            return y * 2

    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), Block()).eval(), torch.randn(2, 3, 6, 6)
    with torch.no_grad(), hookscope.capture(model, "*::relu", "*::add_") as eager:
        model(x)
    for backend in ("eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with torch.no_grad(), hookscope.capture(compiled, "*::relu", "*::add_") as acts:
            compiled(x)
        for key in ("0::relu", "1::relu", "0::add_", "1::add_"):
            torch.testing.assert_close(acts[key], eager[key], rtol=0, atol=1e-6)
        assert float((acts["0::add_"] - acts["0::relu"]).min()) == pytest.approx(1.0)


def test_a_call_the_forward_never_made_is_reported_as_eager_reports_it() -> None:
    model, x = _cnn(), torch.randn(2, 3, 6, 6)
    with torch.no_grad(), hookscope.capture(model, "::softmax", "conv::relu", on_unfired="ignore") as eager:
        model(x)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for _ in range(2):  # the call that compiles and one that does not
        with torch.no_grad(), hookscope.capture(compiled, "::softmax", "conv::relu",
                                                on_unfired="ignore") as acts:
            compiled(x)
        _assert_same_report(acts.unfired, eager.unfired)
    assert ("the model ran 1 time but its own forward never made any softmax; it made: add_"
            in acts.unfired["::softmax"])
    assert "it made: conv2d" in acts.unfired["conv::relu"]


def test_calls_of_another_thread_are_not_recorded_and_are_named() -> None:
    model, x = _mlp(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(x)  # warm up in one thread (torch compiles per thread on a first call at once)
        with hookscope.capture(compiled, "0.1::relu", on_unfired="ignore") as acts:
            worker = threading.Thread(target=lambda: [compiled(x) for _ in range(3)])
            worker.start()
            worker.join()
        assert acts.counts == {"0.1::relu": 0}
        assert acts.unfired["0.1::relu"].startswith("0.1 ran 3 times, all in other threads")
        with hookscope.capture(compiled, "0.1::relu") as acts:
            worker = threading.Thread(target=lambda: compiled(x + 1))
            worker.start()
            worker.join()
            compiled(x)
        assert acts.counts == {"0.1::relu": 1}
        torch.testing.assert_close(acts["0.1::relu"], model[0](x))


SDPA = "scaled_dot_product_attention"
#: name: (the edits a model's calls get; each one edit block, in turn)
EDITS: dict[str, list[Callable[[nn.Module], Any]]] = {
    "mlp": [lambda m: hookscope.edit(m, {"1.1::relu": lambda o: o * 0}),
            lambda m: hookscope.ablate(m, "2.1::relu"),
            lambda m: hookscope.steer(m, {"0.1::relu": torch.ones(8)}, scale=2.0)],
    "cnn": [lambda m: hookscope.edit(m, {"bn::batch_norm": lambda o: o * -1}),
            lambda m: hookscope.steer(m, {"conv::conv2d": torch.ones(4, 1, 1)})],
    "gpt2": [lambda m: hookscope.edit(m, {f"transformer.h.0.attn::{SDPA}": lambda o: o * 0}),
             lambda m: hookscope.steer(m, {f"transformer.h.1.attn::{SDPA}": torch.ones(8)},
                                       positions=[-1], attention_mask=GPT2_INPUTS["attention_mask"]),
             lambda m: hookscope.edit(m, {"transformer.h.1.attn::transpose#1": lambda o: o.flip(-1)})],
}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(EDITS))
def test_edits_of_calls_in_a_full_graph_equal_eager_and_compile_once_per_edit(
        name: str, backend: str, dynamo_warnings: list[str]) -> None:
    """``edit``, ``steer`` (at a token position, with the attention mask) and ``ablate`` of a
    call: the forward goes on with the edited value, as in eager mode, whatever the call
    returns to."""
    make, data, _ = MODELS[name]
    model, inputs = make(), data()
    with torch.no_grad():
        plain = _call(model, inputs)
        expected = []
        for verb in EDITS[name]:
            with verb(model) as applied:
                expected.append(_call(model, inputs))
            assert sum(applied.counts.values()) >= 1
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            for verb, want in zip(EDITS[name], expected):
                with verb(compiled) as applied:
                    got = _call(compiled, inputs)
                    again = _call(compiled, inputs)
                assert sum(applied.counts.values()) >= 2
                for out in (got, again):
                    out, want_out = (out, want) if isinstance(out, Tensor) else (out.logits, want.logits)
                    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
                    assert not torch.allclose(out, plain if isinstance(plain, Tensor) else plain.logits)
        _call(compiled, inputs)
    assert counter.frame_count <= len(EDITS[name]) + 1  # a graph per edit, one without: no more
    assert [m for m in dynamo_warnings if "recompil" in m] == []
    assert _unhooked(model) and torch._C._len_torch_function_stack() == 0


def test_an_edit_of_one_occurrence_changes_that_call_only_and_a_capture_sees_it() -> None:
    """``::relu#1`` edits the second ``F.relu`` of each forward; a capture of ``::relu`` in the
    same block sees the edited value where the edit ran before it (the capture's block
    entered inside the edit's), as in eager mode."""
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: Tensor) -> Tensor:
            return F.relu(self.lin(F.relu(x))) + F.relu(x - 1)

    torch.manual_seed(0)
    model, x = Twice().eval(), torch.randn(3, 6)
    results = []
    for target in (model, torch.compile(model, backend="eager", fullgraph=True)):
        with torch.no_grad(), hookscope.edit(target, {"::relu#1": lambda o: o + 10}) as edited:
            with hookscope.capture(target, "::relu") as seen:
                out = target(x)
        results.append((out, seen.calls("::relu"), edited.counts))
    (eager_out, eager_seen, eager_counts), (out, seen_calls, counts) = results
    assert counts == eager_counts == {"::relu#1": 1}
    assert torch.equal(out, eager_out) and len(seen_calls) == len(eager_seen) == 3
    for got, want in zip(seen_calls, eager_seen):
        assert torch.equal(got, want)
    assert float(seen_calls[1].min()) >= 10 and float(seen_calls[0].min()) == 0


def test_an_edit_of_a_call_says_what_a_graph_cannot_take_back_at_the_call() -> None:
    """Gradients through the edited call (no derivative), and a result that is no tensor
    (``torch.max``'s values and indices): ``EditError`` at the call, naming the fixes; the
    same block edits again once the call has no gradients."""
    class Pick(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return torch.max(F.relu(self.lin(x)), dim=1).values

    model, x = Pick(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with hookscope.edit(compiled, {"::relu": lambda o: o * 0}, on_unfired="ignore") as edit:
        with pytest.raises(hookscope.EditError, match=r"gradients flow.*torch\.no_grad\(\)"):
            compiled(x)
        with torch.no_grad():
            assert torch.equal(compiled(x), torch.zeros(2))
    assert edit.counts == {"::relu": 1}
    with torch.no_grad(), hookscope.edit(compiled, {"::max": lambda o: o}, on_unfired="ignore"):
        with pytest.raises(hookscope.EditError, match=r"not a tensor or a tuple or list of tensors"):
            compiled(x)
    assert _unhooked(model) and torch._C._len_torch_function_stack() == 0


def test_a_compiled_call_that_raises_leaves_no_mode_and_the_next_call_is_recorded() -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(2, 8)
    with torch.no_grad(), hookscope.capture(compiled, "*.1::relu", "::linear",
                                            on_unfired="ignore") as acts:
        with pytest.raises(RuntimeError, match="same reduction dim"):  # raised while dynamo traces
            compiled(torch.randn(2, 5))
        assert torch._C._len_torch_function_stack() == 0
        compiled(x)
        model(x)  # the eager module in the same block: its calls are seen too
    assert acts.counts["0.1::relu"] == 2
    for got in acts.calls("0.1::relu"):
        torch.testing.assert_close(got, model[0](x))
    assert torch._C._len_torch_function_stack() == 0 and _unhooked(compiled)


def test_statistics_of_a_call_inside_a_compiled_model_equal_eager() -> None:
    """``stats`` (its token hook on the root runs outside the graph: not under
    ``fullgraph=True``, tests/test_compile_fullgraph.py) of calls the graph hands out."""
    model, batches = _mlp(), [torch.randn(2, 8), torch.randn(3, 8)]
    eager = hookscope.stats(model, batches, "*.1::relu")
    compiled = torch.compile(model, backend="eager")
    got = hookscope.stats(compiled, batches, "*.1::relu")
    assert set(eager) <= set(got) and len(eager) == 8  # (and "1::relu": see _assert_like_eager)
    for key in eager:
        assert got[key].count == eager[key].count == 5 * 8
        torch.testing.assert_close(got[key].mean, eager[key].mean)


# ------------------------------------------------------------------ generated models
#: functions a generated forward calls: name -> how it changes ``x`` (``y``: a second tensor)
STEPS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "relu": lambda x, y: F.relu(x),
    "sigmoid": lambda x, y: torch.sigmoid(x),
    "softmax": lambda x, y: torch.softmax(x, dim=-1),
    "add": lambda x, y: x + y,
    "mul": lambda x, y: torch.mul(x, 0.5),
    "tanh": lambda x, y: x.tanh(),
    "relu_": lambda x, y: x.clone().relu_(),  # a call writing its input in place
    "layer_norm": lambda x, y: F.layer_norm(x, (x.shape[-1],)),
}


class _Step(nn.Module):
    """A Linear, then ``steps`` (names of ``STEPS``) in its own forward, a child's result
    between them (its calls are the child's own)."""

    def __init__(self, steps: list[str], child: nn.Module | None):
        super().__init__()
        self.lin, self.steps, self.child = nn.Linear(6, 6), steps, child

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x)
        for k, step in enumerate(self.steps):
            if k == len(self.steps) // 2 and self.child is not None:
                y = y + self.child(y)
            y = STEPS[step](y, x)
        return y


def _generated(steps: list[list[str]]) -> nn.Module:
    torch.manual_seed(0)
    module: nn.Module | None = None
    for own in reversed(steps):  # steps[0] is the outermost
        module = _Step(own, module)
    assert module is not None
    return module.eval()


_STEP = st.sampled_from(sorted(STEPS))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.lists(_STEP, min_size=1, max_size=4), min_size=1, max_size=3),
       which=st.lists(st.tuples(st.integers(0, 2), _STEP, st.none() | st.integers(0, 2)),
                      min_size=1, max_size=3))
@example(steps=[["relu", "relu_", "relu"], ["add", "relu"]], which=[(0, "relu", 1), (1, "add", None)])
def test_generated_forwards_in_a_full_graph_record_what_eager_records(
        steps: list[list[str]], which: list[tuple[int, str, int | None]]) -> None:
    """Any nesting of forwards calling any of ``STEPS``, any address ``path::fn`` or
    ``path::fn#k`` (one the forward never makes included): the compiled capture records the
    same calls, with the same outputs and inputs, and reports the same silent addresses."""
    torch._dynamo.reset()
    model, x = _generated(steps), torch.randn(2, 6)
    paths = ["", "child", "child.child"][:len(steps)]
    patterns = sorted({f"{paths[depth % len(paths)]}::{name}{'' if k is None else f'#{k}'}"
                       for depth, name, k in which})
    with torch.no_grad(), hookscope.capture(model, patterns, inputs=True, on_unfired="ignore") as eager:
        model(x)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad(), hookscope.capture(compiled, patterns, inputs=True, on_unfired="ignore") as acts:
        compiled(x)
    _assert_same_report(acts.unfired, eager.unfired)
    if eager.counts:
        _assert_like_eager(acts, eager, exact=True)
    assert torch._C._len_torch_function_stack() == 0 and _unhooked(model)


def test_a_second_threads_block_of_calls_on_one_compiled_model_is_refused_at_entry() -> None:
    """Found building: two threads capturing ``0.1::relu`` on one compiled model at once; the
    graph traced in one thread served the other's calls, so one block recorded 1 call of 3.
    It is refused now, naming the fixes; blocks one after the other, and nested blocks in one
    thread, still record every call."""
    model, x = _mlp(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    opened, release, errors = threading.Event(), threading.Event(), []

    def first() -> None:
        with torch.no_grad(), hookscope.capture(compiled, "0.1::relu") as acts:
            opened.set()
            release.wait(30)
            for _ in range(3):
                compiled(x)
        errors.append(acts.counts)

    worker = threading.Thread(target=first)
    worker.start()
    opened.wait(30)
    try:
        with pytest.raises(hookscope.HookscopeError, match=r"another thread.*copy\.deepcopy"):
            hookscope.capture(compiled, "1.1::relu").__enter__()
        assert not model[1][1]._forward_hooks and not model[1]._forward_pre_hooks
    finally:
        release.set()
        worker.join()
    assert errors == [{"0.1::relu": 3}]
    with torch.no_grad(), hookscope.capture(compiled, "0.1::relu") as outer:
        with hookscope.capture(compiled, "0.1::relu", "1.1::relu") as inner:
            compiled(x)
        compiled(x)
    assert outer.counts == {"0.1::relu": 2} and inner.counts == {"0.1::relu": 1, "1.1::relu": 1}
    torch.testing.assert_close(inner["1.1::relu"], model[:2](x))
    assert _unhooked(model)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.lists(_STEP, min_size=1, max_size=4), min_size=1, max_size=3),
       edited=st.tuples(st.integers(0, 2), _STEP.filter(lambda name: not name.endswith("_")),
                        st.none() | st.integers(0, 2)),  # (an in-place call's edit is refused)
       seen=st.tuples(st.integers(0, 2), _STEP, st.none() | st.integers(0, 2)))
@example(steps=[["relu", "relu_", "relu"], ["add", "relu"]], edited=(0, "relu", 1), seen=(0, "relu", None))
def test_generated_forwards_edited_in_a_full_graph_equal_eager(
        steps: list[list[str]], edited: tuple[int, str, int | None],
        seen: tuple[int, str, int | None]) -> None:
    """Any nesting, an edit of any address (``o + 1``) and a capture of any address inside
    it: the compiled forward's output, the calls edited and the values captured (edited ones
    where the edit came first) are eager mode's."""
    torch._dynamo.reset()
    model, x = _generated(steps), torch.randn(2, 6)
    paths = ["", "child", "child.child"][:len(steps)]
    edit_at, capture_at = (f"{paths[depth % len(paths)]}::{name}{'' if k is None else f'#{k}'}"
                           for depth, name, k in (edited, seen))
    results = []
    for target in (model, torch.compile(model, backend="eager", fullgraph=True)):
        with torch.no_grad(), hookscope.edit(target, {edit_at: lambda o: o + 1}, on_unfired="ignore") as edit:
            with hookscope.capture(target, capture_at, on_unfired="ignore") as acts:
                out = target(x)
        calls = acts.calls(capture_at) if acts.counts.get(capture_at) else []  # never ran: an error
        results.append((out, dict(edit.counts), dict(acts.counts), calls))
    (want, want_edits, want_counts, want_calls), (got, got_edits, got_counts, got_calls) = results
    assert got_edits == want_edits and got_counts == want_counts and torch.equal(got, want)
    for a, b in zip(got_calls, want_calls, strict=True):
        assert torch.equal(a, b)
    assert torch._C._len_torch_function_stack() == 0 and _unhooked(model)


# ------------------------------------------------------------------ found by an attack
class _Sums(nn.Module):
    """Three ``sum`` calls inductor schedules last first, and a structseq result."""

    def forward(self, x: Tensor) -> Tensor:
        v, i = torch.max(x, dim=1)
        cat = torch.cat([x, v[:, None]], dim=1)
        return cat.sum() + i.sum() + x[0].sum()


class _Twice(nn.Module):
    """``_Sums`` called twice in one forward (a shared module)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = _Sums()

    def forward(self, x: Tensor) -> Tensor:
        return self.c(x) + self.c(x * 2)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_calls_are_reported_in_the_order_the_forward_made_them_whatever_inductor_runs_first(
        backend: str) -> None:
    """Inductor ran the operators handing out ``::sum`` last first (calls came out as
    [-0.36, 6, -0.58] for eager's [-0.58, 6, -0.36]), and, for a module called twice, one
    forward's end before its calls ("'c' ran 3 times"): calls are now kept until the compiled
    call returns and reported forward by forward, call by call, in the traced order."""
    torch.manual_seed(0)
    model, x = _Twice().eval(), torch.randn(3, 4)
    patterns = ["c::sum", "c::sum#2", "c::max", "c::softmax"]
    with torch.no_grad(), hookscope.capture(model, patterns, inputs=True, on_unfired="ignore") as eager:
        model(x)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad(), hookscope.capture(compiled, patterns, inputs=True, on_unfired="ignore") as acts:
        compiled(x)
    assert dict(acts.counts) == dict(eager.counts) == {
        "c::sum": 6, "c::sum#2": 2, "c::max": 2, "c::softmax": 0}
    for key in ("c::sum", "c::sum#2"):
        for got, want in zip(acts.calls(key), eager.calls(key), strict=True):
            torch.testing.assert_close(got, want)
    for got, want in zip(acts.calls("c::max"), eager.calls("c::max"), strict=True):  # a structseq
        assert type(got) is type(want) and torch.equal(got.indices, want.indices)
        torch.testing.assert_close(got.values, want.values)
    assert acts.unfired["c::softmax"].startswith("'c' ran 2 times")


def test_threads_calling_the_compiled_model_without_a_block_are_left_alone() -> None:
    """A trace in another thread ran the block's traced hooks, and dynamo wrote the frames
    it changed back after each of that thread's calls, over the block's own: IndexError and
    StopIteration in both threads, a recompile storm, a block with 4 calls of 5."""
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(x)
    stop, problems = threading.Event(), []

    def serve() -> None:
        try:
            with torch.no_grad():
                while not stop.is_set():
                    y = torch.randn(2, 8)
                    if not torch.allclose(compiled(y), model(y)):
                        problems.append("wrong output")
        except Exception as error:  # noqa: BLE001 - any error of the serving thread is the finding
            problems.append(repr(error))

    workers = [threading.Thread(target=serve) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        for _ in range(6):
            with torch.no_grad(), hookscope.capture(compiled, "*.1::relu", "::linear",
                                                    on_unfired="ignore") as acts:
                for _ in range(4):
                    compiled(x)
            assert acts.counts["2.1::relu"] == 4
            torch.testing.assert_close(acts.calls("2.1::relu")[-1], model[:3](x))
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert problems == [] and _unhooked(model)


def test_a_tensor_attribute_is_refused_on_a_compiled_model_before_anything_runs() -> None:
    """``x.T``: dynamo computes it while it traces, no call is left in the graph; a capture
    recorded nothing and said the forward never made it."""
    compiled = torch.compile(_mlp(), backend="eager", fullgraph=True)
    for address in ("0.0::T", "::shape"):
        with pytest.raises(hookscope.HookscopeError, match=r"tensor attribute .*model\._orig_mod"):
            hookscope.capture(compiled, address)


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Sequential(nn.Linear(4, 4))
        self.inner = _BreaksInside()

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.b(x)) * 2


class _BreaksInside(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(x)
        torch._dynamo.graph_break()
        return y + 1


def test_a_graph_break_inside_a_watched_forward_records_as_eager() -> None:
    """``fullgraph=False``, ``torch._dynamo.graph_break()`` inside the watched forward: dynamo
    runs that forward's hooks apart and traces the rest of it (an attack got torch's own
    ``InternalTorchDynamoError: NameError``, and then hookscope's refusal of a break that its
    own hook made, ``stats`` beside a call's address on GPT-2)."""
    torch.manual_seed(0)
    model, x = _Broken().eval(), torch.randn(3, 4)
    with torch.no_grad(), hookscope.capture(model, "inner::relu", "inner::add", "b") as eager:
        model(x)
    split = torch.compile(model, backend="eager")
    for _ in range(2):
        with torch.no_grad(), hookscope.capture(split, "inner::relu", "inner::add", "b") as acts:
            split(x)
        assert dict(acts.counts) == dict(eager.counts) == {"inner::relu": 1, "inner::add": 1, "b": 1}
        for key in eager.counts:
            assert torch.equal(acts[key], eager[key])
    assert _unhooked(model) and torch._C._len_torch_function_stack() == 0


def test_what_dynamo_cannot_follow_is_an_error_that_names_the_fix() -> None:
    """Raw torch errors before (``Unsupported``): a block opened on a model compiled later, or
    on one with a compiled submodule; a watched forward inside ``torch.utils.checkpoint``."""
    x = torch.randn(3, 4)
    late = _Broken().eval()
    late.inner = _Sums()  # type: ignore[assignment]
    with pytest.raises(hookscope.HookscopeError, match=r"compiled after the block opened"):
        with torch.no_grad(), hookscope.capture(late, "inner::sum"):
            torch.compile(late, backend="eager", fullgraph=True)(x)
    inside = _Broken().eval()
    inside.inner = torch.compile(_Sums(), backend="eager", fullgraph=True)  # type: ignore[assignment]
    with pytest.raises(hookscope.HookscopeError, match=r"inside a torch\.compile'd submodule"):
        with torch.no_grad(), hookscope.capture(inside, "inner::sum"):
            inside(x)

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = _Sums()

        def forward(self, x: Tensor) -> Tensor:
            return torch.utils.checkpoint.checkpoint(self.b, x, use_reentrant=False) * 2

    checkpointed = torch.compile(Checkpointed(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="Unsafe side effect") as raised:
        with torch.no_grad(), hookscope.capture(checkpointed, "b::sum"):
            checkpointed(x)
    assert any("torch.utils.checkpoint region" in note for note in raised.value.__notes__)
    for model in (late, inside, checkpointed):
        assert _unhooked(model)
    assert torch._C._len_torch_function_stack() == 0


def test_an_edit_writing_in_place_a_result_that_shares_memory_is_refused_at_the_call() -> None:
    """``o[:, 0] = 0; return o`` on ``h.view(...)``: eagerly the write reaches ``h``, which the
    forward uses later; the compiled edit got a copy, and the outputs differed by up to 9.8,
    silently (an attack). Now ``EditError``; an edit returning a new tensor still works."""
    class Viewed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Tensor:
            h = self.lin(x)
            v = h.view(3, 2, 4)
            return h + v.sum(-1).sum(-1, keepdim=True)

    def in_place(o: Tensor) -> Tensor:
        o[:, 0] = 0
        return o

    def fresh(o: Tensor) -> Tensor:
        o = o.clone()
        o[:, 0] = 0
        return o

    torch.manual_seed(0)
    model, x = Viewed().eval(), torch.randn(3, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad(), hookscope.edit(compiled, {"::view": in_place}):
        with pytest.raises(hookscope.EditError, match=r"result of 'view' in place.*o = o\.clone\(\)"):
            compiled(x)
    outputs = []
    for target in (model, compiled):
        with torch.no_grad(), hookscope.edit(target, {"::view": fresh}) as edit:
            outputs.append(target(x))
        assert edit.counts == {"::view": 1}
    assert torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], model(x))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_an_edit_of_an_in_place_call_is_refused_at_the_call(backend: str) -> None:
    """``z += y`` (the CNN's ``::add_``), ``F.relu(x, inplace=True)``: the forward may go on with
    the tensor the call wrote, not its result; inductor dropped such an edit, silently (an
    attack: outputs off by 9.8). ``EditError`` at the call, on every backend."""
    model, x = _cnn(), torch.randn(2, 3, 6, 6)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for address in ("::add_", "relu::relu"):
        with torch.no_grad(), hookscope.edit(compiled, {address: lambda o: o * 0}, on_unfired="ignore"):
            with pytest.raises(hookscope.EditError, match=r"in-place call .*'path::fn'"):
                compiled(x)
    assert _unhooked(model) and torch._C._len_torch_function_stack() == 0


def test_an_interrupted_compiled_call_leaves_later_captures_recording() -> None:
    """A ``KeyboardInterrupt`` inside a compiled call skips the compile wrapper's forward hooks
    (torch runs ``always_call`` ones on ``Exception`` only), and the hold of the call's values
    stayed open: every later capture in the thread recorded nothing (an attack)."""
    model, x = _mlp(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)

    def interrupt(output: Tensor) -> Tensor:
        raise KeyboardInterrupt

    with torch.no_grad(), hookscope.capture(compiled, "1.0") as same:
        with hookscope.edit(compiled, {"0.1::relu": interrupt}):
            with pytest.raises(KeyboardInterrupt):
                compiled(x)
        compiled(x)  # the same capture block goes on
    assert same.counts == {"1.0": 1}
    with torch.no_grad(), hookscope.capture(compiled, "1.0") as later:
        compiled(x)
    assert later.counts == {"1.0": 1} and torch.equal(later["1.0"], model[1][0](model[0](x)))
    assert _unhooked(model) and torch._C._len_torch_function_stack() == 0


def test_holds_belong_to_their_block_and_thread_and_an_interrupt_ends_only_its_own() -> None:
    """``compiled.hold`` is per thread and per block: an interrupted block's holds end at its
    next call or exit (``abandon``) without ending another block's, and another thread never
    sees them. (A count kept by each block went wrong when an interrupt landed between the
    count and the hold.)"""
    from hookscope.engine.compile import graph as engine

    outer, inner = object(), object()
    engine.hold(outer)
    engine.hold(inner)
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(engine._held.depth))
    worker.start()
    worker.join()
    engine.abandon(inner)  # the inner block's call was interrupted
    assert seen == [0] and engine._held.depth == 1
    engine.release(inner)  # a release that is not its own any more changes nothing
    assert engine._held.depth == 1
    engine.release(outer)
    assert engine._held.depth == 0

    model, x = _mlp(), torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager", fullgraph=True)

    def interrupt(output: Tensor) -> Tensor:
        raise KeyboardInterrupt

    with torch.no_grad(), hookscope.capture(compiled, "1.0", "2.1::relu") as kept:
        compiled(x)
        with pytest.raises(KeyboardInterrupt), hookscope.edit(compiled, {"0.1::relu": interrupt}):
            compiled(x)
        compiled(x)
    assert kept.counts == {"1.0": 2, "2.1::relu": 2} and engine._held.depth == 0  # (1.0 comes after 0.1)
    assert _unhooked(model)
