"""Issue 32: a capture inside ``torch.compile(model, fullgraph=True)``: no graph break, values
equal the eager capture's, and opening and closing blocks compiles the model at most twice (a
graph with the hooks, one without), never once per block (``engine.compile.graph``)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch._dynamo
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from transformers.utils import ModelOutput

import hookscope
from tests.models import InplaceRelu, tiny_gpt2

Tensor = torch.Tensor
BLOCKS = 10


def _mlp() -> nn.Module:
    """Eight Linear layers in a Sequential of Sequentials (issue 32's model)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(8)]).eval()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return InplaceRelu().eval()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, Tensor]], str]] = {
    "mlp": (_mlp, lambda: {"input": torch.randn(2, 8)}, "*.0"),
    "cnn": (_cnn, lambda: {"input": torch.randn(2, 3, 6, 6)}, "*"),
    "gpt2": (tiny_gpt2, lambda: {"input_ids": torch.tensor([[3, 5, 7, 9], [2, 4, 6, 0]]),
                                 "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])},
             "transformer.h.*.*"),
}
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {}, "dtype": {"dtype": torch.float64}, "reduce": {"reduce": "mean"},
    "clone-false": {"clone": False}, "to": {"to": "cpu"}, "clone-true": {"clone": True},
}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from nothing and leaves nothing compiled behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _call(model: nn.Module, inputs: dict[str, Tensor]) -> Any:
    if "input" in inputs:
        return model(inputs["input"])
    return model(**inputs)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list(MODELS))
def test_fullgraph_capture_equals_eager_and_compiles_twice_over_ten_blocks(
        name: str, option: str, dynamo_warnings: list[str]) -> None:
    make, data, pattern = MODELS[name]
    model, inputs = make(), data()
    options = OPTIONS[option]
    exact = {k: v for k, v in options.items() if k != "clone"}  # clone=False: eager values of
    # the CNN are overwritten in place (its capture refuses them); compiled ones are copies
    with torch.no_grad(), hookscope.capture(model, pattern, **exact) as eager:
        expected_out = _call(model, inputs)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(BLOCKS):
            with hookscope.capture(compiled, pattern, on_unfired="error", **options) as acts:
                out = _call(compiled, inputs)
                _call(compiled, inputs)
            _call(compiled, inputs)  # no hooks: its own graph
    assert counter.frame_count <= 2
    assert [m for m in dynamo_warnings if "recompil" in m] == []
    logits = out if isinstance(out, Tensor) else out.logits
    torch.testing.assert_close(logits, expected_out if isinstance(out, Tensor) else expected_out.logits)
    assert set(eager.counts) <= set(acts.counts) and len(eager.counts) >= 4  # ("*.0" on the
    # compiled wrapper also matches "_orig_mod.0", shown as "0")
    for key, count in eager.counts.items():
        assert acts.counts[key] == 2 * count
        for k, want in enumerate(eager.calls(key)):
            for got in (acts.calls(key)[k], acts.calls(key)[count + k]):  # both compiled calls
                if isinstance(want, Tensor):
                    assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize(("name", "pattern"), [
    *((name, MODELS[name][2]) for name in MODELS),
    ("gpt2", "transformer.h.*"), ("gpt2", "transformer.h.0.attn")])
def test_fullgraph_capture_under_inductor_equals_eager(name: str, pattern: str,
                                                       dynamo_warnings: list[str]) -> None:
    """The default backend: inductor keeps the operator and its order (an ordered effect).
    GPT-2 found a bug: a witness's operator (a module near a selected one, noting that it ran)
    took no tensor, and inductor freed a buffer before a later kernel read it
    (``UnboundLocalError: buf22``); it now takes an empty one."""
    make, data, _ = MODELS[name]
    model, inputs = make(), data()
    with torch.no_grad(), hookscope.capture(model, pattern) as eager:
        _call(model, inputs)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            with hookscope.capture(compiled, pattern) as acts:
                _call(compiled, inputs)
            _call(compiled, inputs)
    assert counter.frame_count <= 2
    assert len(eager.counts) >= 1
    for key, count in eager.counts.items():
        assert acts.counts[key] == count
        torch.testing.assert_close(acts.calls(key), eager.calls(key), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fullgraph_inputs_equal_eager_and_compile_twice_over_ten_blocks(
        name: str, backend: str, dynamo_warnings: list[str]) -> None:
    """``inputs=True`` inside the full graph: each call's arguments and keywords (GPT-2's
    blocks: tensors, ``None``, flags) as the eager capture keeps them, the graph whole."""
    make, data, pattern = MODELS[name]
    model, inputs = make(), data()
    with torch.no_grad(), hookscope.capture(model, pattern, inputs=True) as eager:
        _call(model, inputs)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(BLOCKS):
            with hookscope.capture(compiled, pattern, inputs=True) as acts:
                _call(compiled, inputs)
            _call(compiled, inputs)
    assert counter.frame_count <= 2
    assert [m for m in dynamo_warnings if "recompil" in m] == []
    assert len(eager.counts) >= 4
    for key, count in eager.counts.items():
        assert acts.counts[key] == count
        for k in range(count):
            want, got = eager.inputs(key, k), acts.inputs(key, k)
            assert list(got.named) == list(want.named) and got.kwargs.keys() == want.kwargs.keys()
            _assert_same((got.args, got.kwargs), (want.args, want.kwargs))
            torch.testing.assert_close(acts.calls(key)[k], eager.calls(key)[k], rtol=1e-5, atol=1e-5)
    if name == "gpt2":  # its attention's KV cache, an object, is named
        assert repr(acts.inputs("transformer.h.0.attn").kwargs["cache"]) == "NotKept('DynamicCache')"


def _assert_same(got: Any, want: Any, *, exact: bool = False) -> None:
    """``got`` (a compiled capture's input, or a value ``flatten`` wrote and the sink filled)
    is ``want`` (the eager one): tensors close (``exact``: equal), other leaves equal and of
    the same type (nan equal to nan), and an object that is no tensor, number, string, None or
    plain container ``NotKept`` with its type's name."""
    if isinstance(want, Tensor) and exact:
        assert torch.equal(got, want)
    elif isinstance(want, Tensor):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif type(want) in (tuple, list):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w, exact=exact)
    elif type(want) is dict:
        assert list(got) == list(want)
        for k in want:
            _assert_same(got[k], want[k], exact=exact)
    elif want is None or type(want) in (bool, int, float, str):
        assert type(got) is type(want) and (got == want or got != got and want != want)
    elif isinstance(want, (tuple, dict)):  # a namedtuple or a ModelOutput: its class, its fields
        assert type(got) is type(want)
        fields = want._asdict() if isinstance(want, tuple) else dict(want)
        got_fields = got._asdict() if isinstance(got, tuple) else dict(got)
        assert list(got_fields) == list(fields)
        for k in fields:
            _assert_same(got_fields[k], fields[k], exact=exact)
    else:
        assert got == hookscope.NotKept(type(want).__name__)


def test_fullgraph_inputs_keep_numbers_dynamic_sizes_and_name_what_a_graph_cannot_hand_out(
        dynamo_warnings: list[str]) -> None:
    """A call's numbers (a dynamic size, which dynamo calls an ``int``, included) come back as
    numbers, its strings and flags as they were, and an object a graph cannot hand out as
    ``NotKept`` with its type's name, under ``dynamic=True`` and inductor."""
    class Tag:
        pass

    class Inner(nn.Module):
        def forward(self, x: Tensor, n: int, scale: float, *, how: str, tag: Tag,
                    extra: dict[str, Any], wide: bool, big: int) -> Tensor:
            return x[:, :n] * scale + extra["bias"][:n]

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.tag = Inner(), Tag()

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x, x.shape[1] - 1, 0.5, how="mean", tag=self.tag,
                              extra={"bias": torch.ones(x.shape[1]), "on": True, "w": [1.5, None]},
                              wide=x.shape[1] > 6, big=2**70)  # a SymBool, an int beyond int64

    model = Top()
    compiled = torch.compile(model, backend="inductor", fullgraph=True, dynamic=True)
    for width in (5, 7):
        x = torch.randn(2, width)
        with torch.no_grad(), hookscope.capture(compiled, "inner", inputs=True) as acts:
            compiled(x)
        call = acts.inputs("inner")
        assert call.args[1:] == (width - 1, 0.5) and type(call.args[1]) is int
        assert torch.equal(call.args[0], x)
        assert call.kwargs["how"] == "mean" and repr(call.kwargs["tag"]) == "NotKept('Tag')"
        assert call.kwargs["extra"]["on"] is True and call.kwargs["extra"]["w"] == [1.5, None]
        assert call.kwargs["wide"] is (width > 6) and call.kwargs["big"] == 2**70
        assert torch.equal(call.kwargs["extra"]["bias"], torch.ones(width))
        torch.testing.assert_close(acts["inner"], model(x))


@pytest.mark.parametrize(("options", "pattern", "named"), [
    ({"grads": True}, "*.0", "grads=True"),
    ({"early_stop": True}, "*.0", "early_stop=True")])
def test_fullgraph_refuses_what_the_graph_cannot_hold_at_entry(
        options: dict[str, Any], pattern: str, named: str, dynamo_warnings: list[str]) -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(hookscope.HookscopeError, match=rf"{named} cannot run inside torch\.compile"
                                                       rf"\(model, fullgraph=True\).*fullgraph=False"):
        with hookscope.capture(compiled, pattern, **options):
            compiled(torch.randn(2, 8, requires_grad=True))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_kept_values_survive_the_graph_writing_its_buffers_again(dynamo_warnings: list[str]) -> None:
    """Inductor reuses intermediate buffers within a call, and each later call writes its own:
    a value kept copy-on-write (``engine.compile.graph._copy``) keeps what the module returned, as
    the graph's kernels take their pointers through torch's mutable accessor, which gives the
    buffer a storage of its own first."""
    torch.manual_seed(0)
    layers = [layer for _ in range(6) for layer in (nn.Linear(16, 16), nn.ReLU(inplace=True))]
    model = nn.Sequential(*layers).eval()
    x = torch.randn(4, 16)
    with torch.no_grad(), hookscope.capture(model, "*") as eager:
        model(x)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    with torch.no_grad():
        with hookscope.capture(compiled, "*") as acts:
            compiled(x)
        for _ in range(3):
            compiled(-x)
    assert len(eager.counts) == 12
    for key in eager.counts:
        torch.testing.assert_close(acts[key], eager[key], rtol=1e-5, atol=1e-6)


class _Object:
    """A value no graph hands out (a cache, a config)."""


_Größe = type("_Größe", (), {})  # class names no bytes literal holds (found by an attack)
_Quoted = type("_we'ird\\", (), {})


_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=5),  # ints beyond int64 too
    st.floats(width=64),  # inf and nan included
    st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)),
    st.sampled_from([_Object, _Größe, _Quoted]).map(lambda kind: kind()))


class _Pair(NamedTuple):
    first: Any
    second: Any


def _output(first: Tensor, fields: dict[str, Any]) -> Any:
    """A Hugging Face ``ModelOutput``: a tensor first (a first field of another kind is read as
    the fields themselves, transformers' own rule), then ``fields``' values by the output's
    other names."""
    from transformers.modeling_outputs import BaseModelOutputWithPast
    names = ("past_key_values", "hidden_states", "attentions")
    return BaseModelOutputWithPast(first, **dict(zip(names, fields.values())))


@pytest.mark.hypothesis
@given(st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=4), inner, max_size=3),
    st.tuples(inner, inner).map(lambda pair: _Pair(*pair)),
    st.builds(_output, st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)),
              st.dictionaries(st.text(max_size=4), inner.filter(lambda v: v is not None),
                              max_size=3))), max_leaves=8))
def test_a_flattened_call_fills_back_to_itself(value: Any) -> None:
    """``engine.compile.graph.flatten`` then the sink's fill (``engine.compile.spec``) give back
    any nesting of tuples, lists
    and string-keyed dicts of tensors, None, flags, numbers (inf and nan) and strings, and of
    namedtuples and ``ModelOutput``s, the types kept; an object comes back ``NotKept`` with
    its type's name."""
    from hookscope.engine.compile import graph as compiled
    from hookscope.engine.compile import spec as written

    values, spec = compiled.flatten(value)
    _assert_same(written._filled(values, spec), value, exact=True)


# ------------------------------------------------------------- found by an attack (session 11)
@dataclasses.dataclass
class _Required(ModelOutput):
    """A ModelOutput whose first field is required (transformers allows one)."""

    logits: Tensor
    extra: Tensor | None = None


class _Derived(collections.namedtuple("_Derived", "a b")):
    """A namedtuple whose own ``__new__`` takes one value and derives the other."""

    def __new__(cls, a: Tensor) -> _Derived:
        return super().__new__(cls, a, a * 2)


class _Returning(nn.Module):
    def __init__(self, make: Callable[[Tensor], Any]) -> None:
        super().__init__()
        self.lin, self.make = nn.Linear(4, 4), make

    def forward(self, x: Tensor) -> Any:
        return self.make(self.lin(x))


class _Top(nn.Module):
    def __init__(self, make: Callable[[Tensor], Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _Returning(make)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)[0] + 1


@pytest.mark.parametrize("make", [lambda h: _Required(logits=h), _Derived], ids=["required", "own-new"])
def test_outputs_whose_class_builds_otherwise_are_kept_as_eager_keeps_them(
        make: Callable[[Tensor], Any]) -> None:
    """A ModelOutput with a required first field raised the class's own TypeError at the
    compiled call (the sink built it empty); a namedtuple with a ``__new__`` of its own broke
    even the eager capture (rebuilt by calling it). Both come back as their class, as eager."""
    model, x = _Top(make).eval(), torch.randn(2, 4)
    with torch.no_grad(), hookscope.capture(model, "inner") as eager:
        model(x)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad(), hookscope.capture(compiled, "inner") as acts:
        compiled(x)
    _assert_same(acts["inner"], eager["inner"], exact=True)


def test_an_edit_a_full_graph_cannot_take_back_says_so_at_the_call() -> None:
    """An edit of a module returning a namedtuple (or a ModelOutput, a dict) on a fullgraph
    model raised dynamo's own ``Unsupported``: its output cannot come back as the graph's
    tensors, and a full graph cannot run the edit outside. It is now an ``EditError`` naming
    the fixes, and the block leaves nothing behind."""
    model, x = _Top(lambda h: _Derived(h)).eval(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(hookscope.EditError, match="submodule whose output is a tensor"), \
            torch.no_grad(), hookscope.edit(compiled, {"inner": lambda out: _Derived(out.a * 2)}):
        compiled(x)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad(), hookscope.edit(compiled, {"inner.lin": lambda out: out * 2}):
        edited = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(edited, model.inner.lin(x) * 2 + 1, rtol=0, atol=0)


def test_a_verb_whose_hooks_run_outside_the_graph_is_refused_on_a_full_graph_at_entry() -> None:
    """``stats`` (its hooks run outside the graph) on a fullgraph model raised dynamo's own
    ``Unsupported`` from inside the forward; it is refused when the block opens, naming the
    fixes, with nothing left behind."""
    model, x = _Top(lambda h: (h,)).eval(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(hookscope.HookscopeError, match=r"stats runs a hook .* fullgraph=False"):
        hookscope.stats(compiled, [x], "inner.lin")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_module_called_several_times_is_recorded_in_the_order_it_ran_under_inductor() -> None:
    """Inductor ran the ``keep`` operators of a shared module's three calls last first (they
    are ordered effects, yet the third call's came first): ``calls()`` came back reversed for
    the first and last. Values now go to the sinks in the order dynamo traced them
    (``compiled.hold``). Found by the attack on function addresses, which had the same cause."""
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.Identity()

        def forward(self, x: Tensor) -> Tensor:
            v, i = torch.max(x, dim=1)
            cat = torch.cat([x, v[:, None]], dim=1)
            return self.act(cat).sum() + self.act(i).sum() + self.act(x[0]).sum()

    torch.manual_seed(0)
    model, x = Shared().eval(), torch.randn(3, 4)
    with torch.no_grad(), hookscope.capture(model, "act", inputs=True) as eager:
        model(x)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    with torch.no_grad(), hookscope.capture(compiled, "act", inputs=True) as acts:
        compiled(x)
        compiled(x)
    assert acts.counts == {"act": 6}
    for k, got in enumerate(acts.calls("act")):
        want = eager.calls("act")[k % 3]
        assert got.shape == want.shape and torch.equal(got, want)
        assert torch.equal(acts.inputs("act", k)[0], eager.inputs("act", k % 3)[0])
