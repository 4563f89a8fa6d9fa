"""Private: module hooks that a ``torch.compile`` graph holds whole (``fullgraph=True``).

A forward hook that only reads its module's output (a capture, ``stats``) runs, inside a
compiled graph, as one opaque operator, ``hookscope::keep(values, spec, key)``: dynamo puts it
in the graph as it is (an operator of a ``torch.library.Library``), registered as an ordered
side effect (``EffectType.ORDERED``: no compiler pass drops it, though it returns nothing, or
moves it across another). At run time the operator calls the sink registered under ``key``
with the real value, rebuilt as the module had it: ``values`` are its tensors and ``spec`` the
rest, written while dynamo traces (``flatten``: a Python literal with ``...`` for each tensor,
so the numbers, strings and ``None`` of a call's arguments and keywords, which the graph holds
as constants, travel as one string constant; ``engine.compile.spec`` writes and reads it). So:

- no graph break, and the graph runs at compiled speed: the only added work is a copy of each
  kept tensor (``_copy``: copy-on-write on the CPU, so bytes move only for a buffer the graph
  writes again; a real copy on other devices);
- no per-object guard: dynamo guards the hook's ``key`` (an ``int``) and its type. A key names a
  *place* (module object, n-th hookscope hook on it), not a session, so each new block on the
  same modules reuses the code compiled for the last one: a model compiles twice in all (with
  the hooks, without them), however many blocks open and close.

Two more operators serve hooks that do more than read:

- ``hookscope::replace(values, kind, key, grad, tag)`` (an edit): the sink gets a copy of the output
  (with ``tag``, a function call's: ``(*tag, output)``)
  and returns the edited one; the operator returns its tensors (fresh, with the strides its fake
  promised: those of the output), and the graph goes on with them. It has no derivative (an
  edit is any function): a hook whose output needs gradients runs outside the graph instead
  (``hooks._needs_grad``), or, under ``fullgraph=True``, the operator raises ``EditError``.
- ``hookscope::gradient(grad, key)``: the backward of ``Tap``, an identity ``autograd.Function``
  that dynamo traces whole, so the backward graph hands a copy of a forward value's gradient to
  the sink (a tensor hook's place in a graph: the monitor's gradient statistics). Tried and
  not used: a tensor hook registered inside the traced hook (torch 2.13's dynamo refuses a
  hook that appends to Python state: "Unsafe side effect") and a Python exception raised
  while tracing (dynamo turns it into its own ``Unsupported``, so errors are raised by the
  operators at run time).

A sink runs eagerly, on real tensors, in the thread running the compiled call; during a call
of a compiled model a block is open on (``hold``/``release``, the block's hooks on its compile
wrapper), ``keep``'s values reach their sinks when the call returns, in the order dynamo traced
them: inductor runs the ``keep`` operators in an order of its own, though they are ordered
effects (a shared module's three calls were recorded last first). While these
functions put operators in a graph, ``making[0]`` is True: a block's function mode, which sees
every torch call a traced forward makes, passes them through (``engine.function_mode``).

Code compiled without hooks must check that the hook tables are still empty, or it would run on
silently when a block adds hooks: dynamo skips that check by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``); ``prepare`` turns it off when
``torch._dynamo`` is loaded, for code compiled from then on (a few dictionary-length checks per
module per call). Code compiled before that still ignores new hooks: a block reports it
(``diagnose._COMPILED_WHY``, with the fix ``torch._dynamo.reset()``).
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._library.effects import EffectType

from hookscope.engine.compile.spec import _class_code, _code, _filled, _spec
from hookscope.errors import EditError, HookscopeError

__all__ = ["prepare", "eager_when_called", "open_sink", "serve", "idle_sink", "close_sink", "hold",
           "release", "abandon", "keep",
           "replace", "replace_call", "call_refusal", "refuse", "CALLS_UNCOMPILED", "CALL_IN_PLACE",
           "rebuilt", "watch_gradient", "flat_output", "flatten"]

Tensor = torch.Tensor
Sink = Callable[[Any], None]

TENSOR, TUPLE, LIST = 0, 1, 2  # how ``replace`` rebuilds what the module returned (flat_output)
REFUSED = 3  # ``replace`` of an output it cannot rebuild in a full graph: EditError at the call
CALL_STRUCTURE, CALL_GRAD = 4, 5  # ``replace_call`` refusals: EditError at the call
CALLS_UNCOMPILED = 6  # function addresses set up for eager calls, traced: HookscopeError
CALL_IN_PLACE = 7  # an edit of an in-place call's result: EditError at the call
_sinks: dict[int, Sink | None] = {}
#: module -> kind of hook (``hooks._kind``) -> the keys of its places there, in order
_places: weakref.WeakKeyDictionary[nn.Module, dict[Any, list[int]]] = weakref.WeakKeyDictionary()
_next_key = [0]
_keys_lock = threading.Lock()  # two threads opening blocks on one module get two keys
_op: list[Any] = []  # the operators (keep, replace, Tap.apply), defined once on first use
_checked: list[bool] = []  # whether torch._dynamo was set up (prepare)
_hook_codes: list[Any] = []  # code objects of hooks' __call__ (eager_when_called)
#: while dynamo traces: ``[True]`` while hookscope puts its own operators in the graph. A plain
#: list: dynamo models its writes (a ``threading.local`` it cannot); nothing reads it at run time.
making = [False]


def prepare() -> None:
    """Define the ``hookscope::keep`` operator (once, 30 ms) and make code that dynamo compiles
    from now on check the hook tables; ``engine.door.hooks`` calls it once ``torch._dynamo`` is
    loaded, before it gives any hook a key."""
    if not _op:
        _op.append(_define())
    if not _checked and (dynamo := sys.modules.get("torch._dynamo")) is not None:
        unguarded = dynamo.config.skip_nnmodule_hook_guards  # code compiled so far ignores hooks
        dynamo.config.skip_nnmodule_hook_guards = False  # this thread's setting (a ContextVar)
        entry = getattr(dynamo.config, "_config", {}).get("skip_nnmodule_hook_guards")
        if entry is not None:  # and every other thread's: torch 2.13's config is per thread
            entry.default = False
        frames: Any = dynamo.eval_frame
        skip = frames.FrameExecStrategy(frames.FrameAction.SKIP, frames.FrameAction.SKIP)
        for code in _hook_codes:  # a frame of its own: eager, whole (see eager_when_called)
            frames.set_code_exec_strategy(code, skip)
        _class_code[0] = dynamo.assume_constant_result(_code)
        _order[0] = dynamo.assume_constant_result(_next_order)
        if unguarded:
            _recompile_unguarded()
        _checked.append(True)


def _recompile_unguarded() -> None:
    """Drop the code dynamo compiled before ``prepare`` (its cache entries, per code object):
    compiled while ``skip_nnmodule_hook_guards`` was on, it never checks the hook tables, so
    a model compiled and warmed up before the first hookscope block (as a server warms up)
    ran on without the block's hooks: every later ``steer`` returned the unsteered output
    (issue 46). Each such code compiles again at its next call, once, with the hook checks.
    Run once per process, under dynamo's compile lock, as ``torch._dynamo.reset_code_caches``
    clears them, but only for code that has compiled entries (the rest of dynamo's records
    stay)."""
    convert: Any = sys.modules["torch._dynamo.convert_frame"]
    frames: Any = sys.modules["torch._dynamo.eval_frame"]
    with convert.compile_lock:
        for weak in (*convert.input_codes.seen, *convert.output_codes.seen):
            code = weak()
            if code is not None and frames._debug_get_cache_entry_list(code):
                frames.reset_code(code)


def eager_when_called(code: Any) -> None:
    """Never compile ``code`` (a hook's ``__call__``) as a frame of its own, nor what it calls.

    Dynamo runs the hooks of a compiled model's root module outside the graph, and would then
    compile each such hook call as a frame of its own: a third compile, redone per hook object.
    Called there, the hook is plain Python (``torch.compiler.is_compiling()`` is False) and
    runs eagerly. Traced inline, inside a module's call in the graph, it still is: dynamo's
    frame strategy concerns frames it is handed, not code it inlines."""
    _hook_codes.append(code)


def _keep(values: list[Tensor], spec: str, key: int, order: int) -> None:
    sink = _sinks.get(key)
    if sink is None:  # the block closed: code compiled with its hooks is never run then
        return
    if spec == "None":  # a witness's (a module ran): nothing to copy, no order to keep
        sink(None)
        return
    value = _filled([_copy(v) for v in values], spec)  # copied now: the graph goes on
    if not _held.depth:
        sink(value)
        return
    items = _held.__dict__.setdefault("items", [])
    items.append((order, len(items), sink, value))


class _Held(threading.local):
    """``owners``: one entry per ``hold`` open in this thread, the block that holds (one list
    operation per change, so an interrupt never leaves a count half changed); ``items``: what
    ``keep``'s operator handed out meanwhile, ``(order, arrival, sink, value)``."""

    @property
    def depth(self) -> int:
        return len(self.__dict__.setdefault("owners", []))


_held = _Held()


def hold(owner: object) -> None:
    """Hold what compiled calls in this thread hand out to sinks (``keep``) until ``owner``
    (a block) releases it: sessions hold it around each call of a compiled model (its
    wrapper's hooks).

    Inductor runs the ``keep`` operators in an order of its own, though they are ordered
    effects (an attack found three calls of one shared module recorded last first, and the
    end of a forward handed out before its calls); each carries its place in the order dynamo
    traced them (``_order``), and ``release`` hands them out in that order."""
    _held.__dict__.setdefault("owners", []).append(owner)


def abandon(owner: object) -> None:
    """End every hold of ``owner`` it never released (an interrupt skips a wrapper's forward
    hooks, ``always_call`` ones too: torch runs those on ``Exception`` only); once none is
    open, what they held is dropped (an attack found a Ctrl-C left a hold open, and every
    later capture in that thread recorded nothing)."""
    owners = _held.__dict__.setdefault("owners", [])
    owners[:] = [other for other in owners if other is not owner]
    if not owners:
        _held.items = []


def release(owner: object) -> None:
    """End a hold of ``owner``; the last one open hands every held value to its sink, in
    traced order."""
    owners = _held.__dict__.setdefault("owners", [])
    if owner in owners:
        owners.remove(owner)
    if owners:
        return
    items, _held.items = _held.__dict__.get("items", []), []
    for _, _, sink, value in sorted(items, key=lambda item: item[:2]):
        sink(value)


_orders = itertools.count()


def _next_order() -> int:
    """A number no ``keep`` traced before had: increasing in the order dynamo traces them."""
    return next(_orders)


_order: list[Callable[[], int]] = [_next_order]  # a constant of the trace (prepare)


def _copy(value: Tensor) -> Tensor:
    """A copy of ``value`` that what the graph runs next cannot change: copy-on-write on the CPU
    (``torch._lazy_clone``: no bytes move until one side is written, as eager captures keep;
    inductor's CPU kernels take their pointers through torch's mutable accessor, which first
    gives a copy-on-write tensor a storage of its own, so a reused buffer is never the kept
    one), a real copy elsewhere (a CUDA graph replays raw pointers)."""
    value = value.detach()
    if value.device.type == "cpu" and value.layout == torch.strided and not value.is_quantized:
        return torch._lazy_clone(value)
    return value.clone()


def _replace(values: list[Tensor | None], kind: int, key: int, grad: bool, tag: str) -> list[Tensor]:
    if kind in _REFUSALS:
        error, message = _REFUSALS[kind]
        raise error(message)
    sink = _sinks.get(key)
    if grad:  # no derivative: not even a thread without an edit of its own can pass
        hook = getattr(sink, "__self__", None)  # the OwnedHook whose kept() the sink is
        mine = hook is None or hook.acts_for(threading.get_ident())
        raise EditError(_NO_GRAD_EDIT if mine else _OTHER_THREADS_EDIT)
    kept = [None if v is None else v.detach().clone() for v in values]
    if sink is None:
        return _fresh(kept, None)
    value = rebuilt(kept, kind)  # a call's result goes with its tag (replace_call)
    return _fresh(kept, sink((*tag.split(" ", 1), value) if tag else value))


def _gradient(grad: Tensor, key: int) -> Tensor:
    sink = _sinks.get(key)
    if sink is not None:
        sink(_copy(grad))
    return grad.clone()  # an operator's result is a tensor of its own


#: name: (schema, kernel, fake); ``replace``'s values are ``Tensor?[]`` (a module may return None in
#: a tuple); ``keep``'s are tensors only, its ``spec`` holding the rest (``flatten``)
_OPS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "keep": ("keep(Tensor[] values, str spec, int key, int order) -> ()", _keep,
             lambda values, spec, key, order: None),
    "replace": ("replace(Tensor?[] values, int kind, int key, bool grad, str tag) -> Tensor[]", _replace,
                lambda values, kind, key, grad, tag: [torch.empty_like(v) for v in values if v is not None]),
    "gradient": ("gradient(Tensor grad, int key) -> Tensor", _gradient,
                 lambda grad, key: torch.empty_like(grad)),
}


def _define() -> Any:
    """Define the operators on a ``torch.library.Library`` of their own (kept alive in ``_op``).

    Not ``torch.library.custom_op``: its Python wrappers cost 34 us per call against 8 us for a
    plain kernel (a 30-layer MLP compiled by inductor, every layer kept), on every hooked
    module of every compiled call. Each runs eagerly on real tensors (``CompositeExplicitAutograd``:
    one kernel for every device) and is an ordered side effect (``EffectType.ORDERED``)."""
    library = torch.library.Library("hookscope", "DEF")  # type: ignore[no-untyped-call]
    for name, (schema, kernel, fake) in _OPS.items():
        library.define(schema)  # type: ignore[no-untyped-call]
        library.impl(name, kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"hookscope::{name}", fake, lib=library)
    for name in ("keep", "replace"):
        library._register_effectful_op(f"hookscope::{name}", EffectType.ORDERED)

    class Tap(torch.autograd.Function):
        """The identity whose backward hands the gradient to ``hookscope::gradient``."""

        @staticmethod
        def forward(ctx: Any, value: Tensor, key: int) -> Tensor:
            ctx.key = key
            return value.view_as(value)

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
            return torch.ops.hookscope.gradient.default(grad, ctx.key), None

    ops = torch.ops.hookscope
    return ops.keep.default, ops.replace.default, Tap.apply, library


_NO_GRAD_EDIT = (
    "an edit cannot run inside torch.compile(model, fullgraph=True) while gradients flow "
    "through the edited output: the graph holds it as one operator without a derivative (an "
    "edit is any function), and a full graph cannot run it outside. Call the model under "
    "torch.no_grad() or torch.inference_mode(), compile with fullgraph=False (the edit then "
    "splits the graph and gradients equal eager), or edit the eager model (compiled._orig_mod)")


_NO_STRUCTURE_EDIT = (
    "an edit cannot run inside torch.compile(model, fullgraph=True) on a module whose output is "
    "not a tensor or a tuple or list of tensors (a namedtuple, a ModelOutput, a dict): the graph "
    "takes an edited output back only as tensors in those places, and a full graph cannot run "
    "the edit outside. Edit a submodule whose output is a tensor, compile with fullgraph=False "
    "(the edit then splits the graph and values equal eager), or edit the eager model "
    "(compiled._orig_mod)")


_NO_CALL_STRUCTURE_EDIT = (
    "an edit of a function call ('path::fn') inside a torch.compile graph cannot replace a result "
    "that is not a tensor or a tuple or list of tensors (torch.max's values and indices, a "
    "dict): the graph takes an edited value back only as tensors in those places. Edit a call "
    "that returns a tensor, or edit the eager model (compiled._orig_mod)")


_NO_CALL_GRAD_EDIT = (
    "an edit of a function call ('path::fn') inside a torch.compile graph cannot run while "
    "gradients flow through the call's result: the graph holds the edit as one operator without "
    "a derivative (an edit is any function), and a call inside a compiled forward cannot run "
    "outside its graph. Call the model under torch.no_grad() or torch.inference_mode(), edit the "
    "output of the module that makes the call (an address without '::'; compiled with "
    "fullgraph=False, that edit runs outside the graph), or edit the eager model "
    "(compiled._orig_mod)")


_OTHER_THREADS_EDIT = (
    "another thread's edit block is open on this torch.compile(model, fullgraph=True) model, and "
    "this call runs with gradients: the graph holds that edit as one operator without a "
    "derivative, which every thread's call goes through (gradients would stop there). Call the "
    "model under torch.no_grad() or torch.inference_mode() while edit blocks are open, compile "
    "with fullgraph=False, or edit a copy of the model (copy.deepcopy) in the other thread")


_CALLS_UNCOMPILED = (
    "a block with function addresses ('path::fn') was opened on a module that torch.compile now "
    "traces (the model was compiled after the block opened, or the module is inside a "
    "torch.compile'd submodule): such a block sees calls inside a compiled graph only when it is "
    "opened on the compiled module itself. Open it on that module (hookscope.capture(compiled, "
    "'path::fn'), the path relative to it), or call the eager module")


_NO_IN_PLACE_EDIT = (
    "an edit of an in-place call ('path::fn' of x.relu_(), x.add_(y), x += y) cannot run inside a "
    "torch.compile graph: the forward may go on with the tensor the call wrote rather than with "
    "its result, and a graph takes an edited value back only as the result (inductor dropped "
    "such an edit, silently: found by an attack). Edit the call that made the tensor, the "
    "output of the module (an address without '::'), or the eager model (compiled._orig_mod)")


#: kind -> (the error ``refuse`` raises at the call, its message)
_REFUSALS: dict[int, tuple[type[Exception], str]] = {
    REFUSED: (EditError, _NO_STRUCTURE_EDIT), CALL_STRUCTURE: (EditError, _NO_CALL_STRUCTURE_EDIT),
    CALL_GRAD: (EditError, _NO_CALL_GRAD_EDIT), CALLS_UNCOMPILED: (HookscopeError, _CALLS_UNCOMPILED),
    CALL_IN_PLACE: (EditError, _NO_IN_PLACE_EDIT)}


def rebuilt(values: list[Tensor | None], kind: int) -> Any:
    """The output as the module returned it, from ``flat_output``'s ``(values, kind)``."""
    return values[0] if kind == TENSOR else tuple(values) if kind == TUPLE else values


def _fresh(kept: list[Tensor | None], new: Any) -> list[Tensor]:
    """The tensors of ``new`` (None: ``kept`` as it is) in place of ``kept``'s, each a tensor of
    its own with ``kept``'s strides, as ``replace``'s fake promised the compiler: the edited
    value (broadcast, if it broadcasts) copied into a new one unless it is that copy.

    Raises:
        HookscopeError: ``new`` has another structure than ``kept`` (an edit checks that first,
            with its own message)."""
    if new is None:
        return [v for v in kept if v is not None]
    flat = flat_output(new)
    if flat is None or len(flat[0]) != len(kept) or any(
            (v is None) != (n is None) for v, n in zip(kept, flat[0])):
        raise HookscopeError("a hook inside a torch.compile graph returned another structure "
                             "than its module's output; return the same tensors (or None) in "
                             "the same places")
    return [v if n is v else torch.empty_like(v).copy_(n)
            for v, n in zip(kept, flat[0]) if v is not None and n is not None]


def open_sink(module: nn.Module, sink: Sink | None, kind: Any = None) -> int:
    """Register ``sink(output)`` to run for each compiled call of a hook on ``module``; return
    its key (the first free place on ``module`` for hooks of ``kind``, hashable: the same key
    as the last block's hook of that kind there, whatever hooks of other kinds other threads'
    blocks hold meanwhile, so a key a graph guards stays the same however blocks interleave).
    Thread-safe: blocks opened at once in several threads get distinct keys. ``None`` holds
    the place with no sink (a filler's, ``hooks.OwnedHook.filler``): its operators hand
    nothing out and copy nothing, until ``serve`` gives it one."""
    with _keys_lock:
        return _claim(module, sink, kind)


def _claim(module: nn.Module, sink: Sink | None, kind: Any) -> int:
    places = _places.setdefault(module, {}).setdefault(kind, [])
    key = next((k for k in places if k not in _sinks), None)
    if key is None:
        key = _next_key[0]
        _next_key[0] += 1
        places.append(key)
    _sinks[key] = sink
    return key


def serve(key: int, sink: Sink) -> None:
    """Run ``sink`` for the compiled calls of ``key``, a place held open (``open_sink``)."""
    if key in _sinks:
        _sinks[key] = sink


def idle_sink(key: int) -> None:
    """Keep the place of ``key`` and run no sink for it (as a filler's, ``open_sink``), until
    ``serve`` gives it one or ``close_sink`` closes it."""
    if key in _sinks:
        _sinks[key] = None


def close_sink(key: int) -> None:
    """Stop running the sink of ``key`` (again: nothing happens)."""
    _sinks.pop(key, None)


def flat_output(output: Any) -> tuple[list[Tensor | None], int] | None:
    """``(values, kind)`` of an output that ``replace`` can edit and ``watch_gradient`` watch
    (both rebuild it while dynamo traces, from ``kind``): a tensor, None, or a tuple or list of
    tensors and ``None`` (a transformer block's ``(hidden, None)``); else None. ``keep``, whose
    sink rebuilds at run time, takes any value (``flatten``)."""
    if output is None or isinstance(output, Tensor):
        return [output], TENSOR
    if type(output) in (tuple, list) and all(v is None or isinstance(v, Tensor) for v in output):
        return list(output), TUPLE if type(output) is tuple else LIST
    return None


def flatten(value: Any) -> tuple[list[Tensor], str]:
    """``(tensors, spec)`` of ``value`` (a module's output, or a call's ``(args, kwargs)``)
    for ``keep``: its tensors in order, the rest as a Python literal with ``...`` for each
    tensor (``"((..., None, ), {'mask': ..., 'how': 'mean', }, )"``). Dynamo traces this
    function whole: the strings
    and ``None`` of a traced call are constants of the graph, so the spec is one string
    constant, and code compiled for one spec is reused while calls keep it.

    Written: tensors, ``None``, ``bool``, ``int``, ``float`` (each a 0-d tensor, a Python
    number again in the sink: dynamo gives a dynamic size or a comparison of sizes, a
    ``SymInt`` or ``SymBool``, the type ``int`` or ``bool`` and cannot write it as text; an
    int beyond int64, a constant, as text), ``str``, and ``tuple``, ``list`` and ``dict`` (with
    string keys) of them, exactly these types; a namedtuple and a Hugging Face ``ModelOutput``
    as their fields, with a number standing for their class (``_class_code``: the sink builds
    the same class again). Any other object (a ``Cache``, ``torch.Size``) is written as a
    one-element set holding its type's name, which ``keep``'s sink receives as
    ``NotKept(name)``: a graph hands out tensors, not objects."""
    values: list[Tensor] = []
    making[0] = True  # numbers become tensors (scalar_tensor): hookscope's calls
    spec = _spec(value, values)
    making[0] = False
    return values, spec


def keep(values: list[Tensor], spec: str, key: int) -> None:
    """Call ``hookscope::keep`` with ``flatten``'s ``(values, spec)`` of a value: inside a
    compiled graph, one opaque ordered operator. A value without a tensor (a witness's) gets an
    empty one: torch 2.13's inductor frees a buffer before a later kernel reads it when an
    effectful operator takes none."""
    making[0] = True
    _op[0][0](values or [torch.empty(0)], spec, key, _order[0]())
    making[0] = False


def watch_gradient(values: list[Tensor | None], kind: int, key: int) -> Any:
    """The output (``values``, ``kind``) with its first floating-point tensor passed through an
    identity whose backward, in the compiled backward graph, hands a copy of that tensor's
    gradient to the sink of ``key`` (``hookscope::gradient``: a tensor hook's place in a graph;
    dynamo traces the ``autograd.Function`` whole); None when that tensor does not require
    grad (no backward reaches it) or there is none."""
    first = next((i for i, v in enumerate(values) if v is not None and v.is_floating_point()), None)
    if first is None or not (torch.is_grad_enabled() and values[first].requires_grad):  # type: ignore[union-attr]
        return None
    values = list(values)
    making[0] = True
    values[first] = _op[0][2](values[first], key)
    making[0] = False
    return rebuilt(values, kind)


def refuse(key: int, kind: int = REFUSED) -> None:
    """Put in the graph an operator that raises an error when it runs (``_REFUSALS[kind]``):
    an edit entered on a ``fullgraph=True`` model, of an output ``replace`` cannot rebuild
    (``REFUSED``), an edit of a call ``call_refusal`` names, or a block set up for eager calls
    that dynamo traces (``CALLS_UNCOMPILED``). (A Python exception raised while dynamo traces
    becomes its own ``Unsupported``.) It takes an empty tensor: inductor lowers no operator
    without one ("Not sure where to find device info")."""
    making[0] = True
    _op[0][1]([torch.empty(0)], kind, key, False, "")
    making[0] = False


def call_refusal(output: Any) -> int | None:
    """Why ``replace_call`` cannot take an edit of a function call's result ``output`` back
    (``refuse``'s kind), or None: ``CALL_STRUCTURE`` for a result that is no tensor,
    tuple or list of tensors, ``CALL_GRAD`` for one gradients may flow through (the operator
    has no derivative, and a call inside a compiled forward cannot run outside the graph as a
    module's hook can)."""
    flat = flat_output(output)
    if flat is None:
        return CALL_STRUCTURE
    if torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in flat[0]):
        return CALL_GRAD
    return None


def replace_call(output: Any, key: int, tag: tuple[str, str]) -> Any:
    """``replace`` for the result of a function call inside a compiled graph (an edit of
    ``path::fn``, ``engine.function_mode``; ``call_refusal(output)`` is None): what the sink
    of ``key`` made of ``(*tag, copy of output)``, which the forward goes on with."""
    values, kind = flat_output(output)  # type: ignore[misc]
    return replace(values, kind, key, False, " ".join(tag))


def replace(values: list[Tensor | None], kind: int, key: int, grad: bool, tag: str = "") -> Any:
    """Call ``hookscope::replace``: inside a compiled graph, one opaque ordered operator whose
    result is what the sink of ``key`` returned for a copy of ``values`` (None: the copy), so
    the graph goes on with the edited output. The shapes, dtypes and strides are ``values``'
    (the compiler plans the rest of the graph with them: an edit returns what its module did).

    Returns:
        The output rebuilt as the module returned it (``values``' structure, ``kind``).

    Raises:
        EditError: at run time, when ``grad`` (a backward pass may go through ``values``):
            the operator has no derivative, an edit being any function."""
    making[0] = True
    new = iter(_op[0][1](values, kind, key, grad, tag))
    making[0] = False
    return rebuilt([None if v is None else next(new) for v in values], kind)
