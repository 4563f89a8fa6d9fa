"""Private: a session's hook acts only on the calls that belong to its session.

A hook on a module is run by more than the calls its ``with`` block means:

- **copies**: ``copy.copy(model)`` shares the module's hook dictionaries, hooks included (a
  ``deepcopy`` or pickle made inside a block leaves them out: ``copies.py``);
- **threads**: another thread calling the same model (a server running requests in parallel)
  runs the same hooks; blocks of several threads share their entries (``ModuleHooks``), each
  hook calling the one acting for the calling thread;
- **export tracing**: ``torch.export.export`` runs (or dynamo-traces) hooks on FakeTensors,
  which hold no values: a hook refuses then (``refuse_export_trace``);
- **torch.compile**: dynamo traces the hooks of a model compiled while a block is open. A hook
  that reads only what the call gives it (``pick``: a capture's record, a witness) runs in the
  graph as one opaque operator that hands it the real value at run time
  (``engine.compile.graph``: no graph break, ``fullgraph=True`` works, no recompile per block); an
  edit (``replaces``) runs in one whose result the graph goes on with, a gradient watch
  (``on_gradient``) in the backward graph; any other hook runs outside the graph
  (``_untraced``), or dynamo would recompile the hook's frame once per module;
- **recomputation**: activation checkpointing (``torch.utils.checkpoint``, reentrant or not, HF
  ``gradient_checkpointing_enable()``) runs the forward of the checkpointed part again during
  backward. That is not a new call of the module.

This file is the only one that calls torch's hook registration (``tests/test_layers.py``):
``register`` for module forward (pre-)hooks (``ModuleHooks``: a session's, in bulk),
``on_tensor_grad`` for tensor gradient hooks, ``on_node`` for autograd node hooks,
``on_optimizer_step`` for an optimizer's step hooks and ``after_backward`` for the end of a
backward pass, so every hook hookscope adds, for every verb, gets the same guarantees.

``OwnedHook`` wraps a session's hook function and calls it only for the session's own module
object, in the thread that entered the session, outside a backward pass (a forward that runs
while autograd executes a graph task is a recomputation; ``torch._C._current_graph_task_id()``
is -1 outside backward). Other calls are counted (``foreign_calls``, ``recomputes``) so reports
can say why a module looked silent; a call for another module object (a shallow copy sharing
the tables) does nothing.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope.engine.compile import graph as compiled
from hookscope.errors import HookscopeError

__all__ = ["OwnedHook", "RecordingHook", "FULLGRAPH", "output_of", "nothing", "register", "drop_sink",
           "owner", "in_recompute", "refuse_export_trace", "traced", "kind_of_hook", "other_threads",
           "unowned_threads"]

FULLGRAPH = 2  # ``OwnedHook(replaces=FULLGRAPH)``: an edit entered on a fullgraph=True model
_graph_task_id = torch._C._current_graph_task_id
_get_ident = threading.get_ident
_compiling = torch.compiler.is_compiling
_exporting = torch.compiler.is_exporting
_transforms_active = torch._C._are_functorch_transforms_active
_lazy_clone = torch._lazy_clone
_dynamo_tracing = torch.compiler.is_dynamo_compiling  # True only in code dynamo traces
_fake_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def _traced() -> bool:
    """Whether this call is traced: dynamo traces it, or this thread runs it on FakeTensors (a
    non-strict ``torch.export``). ``torch.compiler.is_compiling()`` alone is one flag for the
    whole process, True in every thread while any thread compiles: a hook running eagerly in
    another thread then took the traced branch, and skipped its thread checks."""
    return _dynamo_tracing() or _fake_mode(_FAKE) is not None


class OwnedHook:
    """A forward or forward-pre hook that runs ``function`` only for its session's calls.

    Args:
        function: the hook, called as torch calls hooks: ``(module, args[, kwargs], output)``.
        module: the module it is registered on (copies of it are not the session's).
        in_recompute: also run ``function`` during an activation-checkpointing recompute (edits
            must, so the recomputed forward equals the real one); the call is still counted in
            ``recomputes`` and never as a new call by ``function``'s session.
        traceable: ``function`` is known to trace in dynamo without a graph break: a hooked call
            that ``torch.compile`` traces runs it inside the graph; otherwise it runs outside
            the graph (``_untraced``), so no hook makes dynamo recompile per module.
        thread: the ident of the session's thread (default: the calling thread); a session
            making hundreds of hooks asks once.
        pick: ``pick(module, args[, kwargs][, output])`` takes from a call the value that
            ``function`` reads (a forward hook that only reads the output: ``output_of``), a
            tensor, None or a flat tuple/list of tensors: ``on_kept(value)`` (default:
            ``function(module, (), value)``) then runs for calls inside a ``torch.compile``
            graph, on a copy of the real value, without breaking the graph (``engine.compile.graph``).
        on_kept: see ``pick``.
        replaces: true (or ``FULLGRAPH``) when ``function`` is a forward hook whose return
            replaces the output (an edit), with ``pick=output_of``: inside a ``torch.compile``
            graph it runs, on a copy of the real output, in an operator whose result the graph
            goes on with (``engine.compile.graph.replace``); when gradients flow through the output,
            outside the graph (``_needs_grad``), or, with ``FULLGRAPH`` (the block was entered
            on a ``fullgraph=True`` model, which cannot split), the operator raises
            ``EditError`` at the call.
        on_gradient: with ``pick=output_of``: inside a ``torch.compile`` graph,
            ``on_gradient(grad)`` runs in the backward pass with (a copy of) the gradient of
            the output's first floating-point tensor when it requires grad, the tensor hook
            ``function`` registers in eager mode (``engine.compile.graph.watch_gradient``).

    Attributes:
        recomputes: forwards re-run during backward that reached this hook.
        foreign_calls: calls from threads other than the session's (and its guests').
        guests: hooks of other threads' blocks that this one's table entry serves
            (``ModuleHooks``): a call in a guest's thread runs the guest (``_guest``).
        entries: the ``(table, id)`` entries it holds while registered by ``ModuleHooks``.
    """

    __slots__ = ("function", "module", "thread", "in_recompute", "traceable", "recomputes",
                 "foreign_calls", "pick", "on_kept", "replaces", "on_gradient", "key", "gradient_key",
                 "guests", "entries")

    def __init__(self, function: Callable[..., Any], module: nn.Module, *, in_recompute: bool = False,
                 traceable: bool = False, thread: int | None = None,
                 pick: Callable[..., Any] | None = None,
                 on_kept: Callable[[Any], Any] | None = None, replaces: bool | int = False,
                 on_gradient: Callable[[torch.Tensor], Any] | None = None):
        self.function = function
        self.module = module
        self.thread = threading.get_ident() if thread is None else thread  # the session's
        self.in_recompute = in_recompute
        self.traceable = traceable
        self.recomputes = 0
        self.foreign_calls = 0
        self.pick = pick
        self.on_kept = on_kept
        self.replaces = replaces
        self.on_gradient = on_gradient
        self.key: int | None = None  # set while registered, when ``pick`` is
        self.gradient_key: int | None = None  # set while registered, when ``on_gradient`` is
        # hosting (ModuleHooks): the table entries it holds, and the hooks of other threads'
        # blocks it calls for their threads (a new list on each change: read without a lock)
        self.entries: list[tuple[dict[int, Any], int]] = []
        self.guests: list[OwnedHook] = []

    def filler(self, module: nn.Module) -> OwnedHook:
        """A hook of this one's kind (``_kind``: it traces to the same operator) on ``module``
        that acts for no call: a block on a ``torch.compile(fullgraph=True)`` model pads every
        module it does not hook with these (``session.HookSession``), so the hook tables dynamo
        guards look the same whichever modules a block selects, and a sweep over layers, one
        block each, reuses one graph instead of compiling one per layer up to dynamo's
        recompile limit (issue 47). Its place has no sink (``compiled.open_sink``): its
        operator copies nothing, until a block of another thread joins it as a guest."""
        twin = copy.copy(self)  # every slot, then what makes it act for nobody
        twin.function, twin.module, twin.thread, twin.on_kept = _no_call, module, _FILLER, None
        twin.on_gradient = None if self.on_gradient is None else _no_call
        twin.recomputes = twin.foreign_calls = 0
        twin.key = twin.gradient_key = None
        twin.guests, twin.entries = [], []
        return twin

    def kept(self, value: Any) -> Any:
        """Run ``function`` on ``value``, what ``pick`` took from a compiled call (a copy, from
        ``engine.compile.graph``'s operator), with the checks of an eager call that a compiled
        call can still make (thread, recompute); return what it returned (an edit's output)."""
        ident = _get_ident()
        self._count(ident)
        if ident != self.thread:
            guest = self._guest(ident)
            return None if guest is None else guest.kept(value)
        if _graph_task_id() != -1:
            self.recomputes += 1
            if not self.in_recompute:
                return None
        if self.on_kept is not None:
            return self.on_kept(value)
        if self.pick is nothing:  # a pre-hook noting the call
            return self.function(self.module, ())
        return self.function(self.module, (), value)  # a forward hook on its output (output_of)

    def gradient_kept(self, grad: torch.Tensor) -> None:
        """Run ``on_gradient`` on a compiled backward's gradient (a copy, from
        ``hookscope::gradient``) when the session's thread runs that backward, as the eager
        tensor hook, registered by an owned forward only, does; count it a foreign call else."""
        ident = _get_ident()
        self._count(ident)
        if ident != self.thread:
            guest = self._guest(ident)
            if guest is not None:
                guest.gradient_kept(grad)
        elif self.on_gradient is not None:
            self.on_gradient(grad)

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        # a subclass with an inlined hot path (RecordingHook) makes these same five tests,
        # compiling first (dynamo must not trace the rest), and hands every other call here
        if (not _compiling() and module is self.module and _get_ident() == self.thread
                and _graph_task_id() == -1 and not self.guests):
            return self.function(module, *args)
        if _compiling() and _traced():  # traced into a compiled graph: calls are the model's
            if _exporting():  # torch.export: FakeTensors, no values to record
                raise refuse_export_trace()
            if self.key is not None and self.pick is not None:
                value = self.pick(module, *args)
                flat = compiled.flat_output(value)
                if not self.replaces and self._keeps(value, flat, self.key):  # one operator
                    if self.gradient_key is None or flat is None:
                        return None
                    return compiled.watch_gradient(flat[0], flat[1], self.gradient_key)
                grad = flat is not None and _needs_grad(flat[0])
                if (flat is None or grad) and self._fills():
                    return None  # a filler (OwnedHook.filler): no edit to refuse, none to run
                if flat is not None and (self.replaces == FULLGRAPH or not grad):
                    # the graph goes on with its result (or, fullgraph with gradients, an error)
                    return compiled.replace(flat[0], flat[1], self.key, grad)
                if self.replaces == FULLGRAPH:  # an output it cannot rebuild: an error at the call
                    return compiled.refuse(self.key)
            if self.traceable and (self.key is not None or self.pick is None):
                return self.function(module, *args)  # no thread check: every call's (see docs)
            # with its checks, at run time (a hook whose block began before dynamo was loaded)
            return _untraced(self._eager, module, args)
        return self._eager(module, args)

    def _eager(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        """A call run as it comes (not traced; another thread may be compiling): the session's
        own, a guest's (run by the guest), a checkpoint recompute, or another thread's."""
        if module is not self.module:  # a shallow copy sharing the hook tables
            return None
        ident = _get_ident()
        self._count(ident)
        if ident != self.thread:
            guest = self._guest(ident)
            return None if guest is None else guest.__call__(module, *args)
        if _graph_task_id() == -1:
            return self.function(module, *args)
        self.recomputes += 1  # a forward inside backward: a checkpoint recompute
        return self.function(module, *args) if self.in_recompute else None

    def _fills(self) -> bool:
        """Whether this hook and every guest it hosts are fillers (``filler``): no block wants
        its operator, so a trace needs none where one cannot be made (an output a graph cannot
        take back, or one gradients flow through)."""
        return self.thread in (_FILLER, _NOBODY) and all(g.thread == _FILLER for g in self.guests)

    def _guest(self, thread: int) -> OwnedHook | None:
        """The hook of another block that this one hosts for ``thread``, if any."""
        return next((guest for guest in self.guests if guest.thread == thread), None)

    def acts_for(self, thread: int) -> bool:
        """Whether a call in ``thread`` runs this hook's function or a guest's."""
        return self.thread == thread or any(guest.thread == thread for guest in self.guests)

    def _count(self, thread: int) -> None:
        """Count a call in ``thread`` as a foreign call of this hook and of each guest whose
        block is another thread's (the report of a block whose module ran only elsewhere); a
        forward of hookscope's own (``unowned_threads``) is no one's call, and is not counted."""
        if thread != self.thread:
            if thread in unowned_threads:  # tested only here: the session's calls pay nothing
                return
            self.foreign_calls += 1
        for guest in self.guests:
            if guest.thread != thread:
                guest.foreign_calls += 1

    def _keeps(self, value: Any, flat: Any, key: int) -> bool:
        """Inside a compiled graph, hand ``value`` to this hook's sink by ``hookscope::keep``;
        False (and nothing done) when the hook must run outside the graph instead: an output
        whose gradient is watched but ``watch_gradient`` cannot pass (``flat`` is None). Any
        other value is kept: an object in it that is no tensor, number, string, namedtuple or
        ``ModelOutput`` (a ``Cache``) is recorded as ``NotKept``. Traced instead, the hook
        would record every thread's calls (a traced function has no thread check), and
        outside the graph it would split the graph before every hooked module."""
        values, spec = compiled.flatten(value)
        if self.gradient_key is not None and flat is None:
            return False
        compiled.keep(values, spec, key)
        return True


compiled.eager_when_called(OwnedHook.__call__.__code__)


class RecordingHook(OwnedHook):
    """The hot path of a capture: a forward hook that appends each call's whole output, kept
    safe from later in-place writes, to ``outputs``.

    ``OwnedHook``'s checks (own module, own thread, not a recompute, not traced) and the
    copy-on-write keep (``copy_on_write.lazy_copy``) are inlined in one ``__call__``: per call
    this costs about what a bare hook appending ``detach()`` costs. Every other call (a copy of
    the module, another thread, a recompute, a torch.compile trace) goes through
    ``OwnedHook.__call__``.

    Args:
        outputs: the list each call's kept output is appended to.
        module: the module it is registered on.
        snapshot: ``snapshot(output)``: the value to keep of an output the hot path does not
            take (one that requires grad, a quantized tensor, a tuple, under a functorch
            transform).
        thread: the ident of the session's thread.
    """

    __slots__ = ("outputs", "snapshot")

    def __init__(self, outputs: list[Any], module: nn.Module, snapshot: Callable[[Any], Any], thread: int):
        super().__init__(self._record, module, traceable=True, thread=thread, pick=output_of,
                         on_kept=self._kept)
        self.outputs, self.snapshot = outputs, snapshot

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        # OwnedHook.__call__'s checks and lazy_copy inlined (a frame less per call: keep them
        # in step). Dynamo's trace first (it folds the test to True: it must not trace on);
        # not torch.compiler.is_compiling(), two Python calls on every call, True also while
        # another thread compiles (an eager call here is still one) and in a non-strict
        # torch.export, whose outputs are FakeTensors: those go to OwnedHook.__call__ below
        if (_dynamo_tracing() or module is not self.module or _get_ident() != self.thread
                or _graph_task_id() != -1 or self.guests):
            return OwnedHook.__call__(self, module, args, output)  # a copy, a thread, a recompute
        # no functorch transform running: no output can be a transform's wrapper (a cheaper
        # test than asking the output); under one, snapshot() asks the output itself
        if (type(output) is torch.Tensor and not output.requires_grad and not output.is_quantized
                and not _transforms_active()):
            try:
                self.outputs.append(_lazy_clone(output))
                return None
            except (NotImplementedError, RuntimeError):  # no copy-on-write storage
                pass
        if _fake_mode(_FAKE) is not None:  # a non-strict export's FakeTensors: refused there
            return OwnedHook.__call__(self, module, args, output)
        self.outputs.append(self.snapshot(output))  # a tuple, a subclass: kept whole, checked above
        return None

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self.outputs.append(self.snapshot(output))

    def _kept(self, output: Any) -> None:
        """A compiled call's output (``engine.compile.graph``): already a detached copy of its own,
        so a plain tensor is kept as it is."""
        if type(output) is torch.Tensor and not output.is_quantized:
            self.outputs.append(output)
        else:
            self.outputs.append(self.snapshot(output))


compiled.eager_when_called(RecordingHook.__call__.__code__)


def other_threads(path: str, calls: int) -> str:
    """Why a target recorded nothing although its module ran ``calls`` times, every time in a
    thread other than the one that entered the block (module and ``path::fn`` targets alike)."""
    return (f"{path or 'the model'} ran {calls} time{'s' if calls > 1 else ''}, all in other "
            f"threads: a hookscope block records only the calls made by the thread that entered "
            f"it (so concurrent requests never mix). Enter the block in the thread that calls the "
            f"model")


def _needs_grad(values: list[torch.Tensor | None]) -> bool:
    """True when a backward pass may go through ``values``: an edit then runs outside the graph
    (``hookscope::replace`` has no derivative: an edit is any function), where autograd records
    it as in eager mode; ``fullgraph=True`` cannot split the graph (see ``FULLGRAPH``)."""
    return torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in values)


def output_of(module: nn.Module, *args: Any) -> Any:
    """``pick`` for a forward hook that reads the output only: ``function(module, (), output)``."""
    return args[-1]


def nothing(module: nn.Module, *args: Any) -> None:
    """``pick`` for a forward pre-hook that reads nothing of the call (a witness noting that a
    module ran): ``function(module, ())``."""
    return None


def owner(value: Any) -> OwnedHook | None:
    """The ``OwnedHook`` behind a hook-table value, or None when hookscope did not put it there.

    A table holds an ``OwnedHook``'s bound ``__call__``, not the object: torch calls a bound
    method about 50 ns faster than an object with a Python ``__call__`` (no slot lookup), on
    every hooked call (``python -m bench.dispatch``)."""
    if isinstance(value, OwnedHook):
        return value
    held = getattr(value, "__self__", None)  # its bound __call__, not another of its methods
    return held if isinstance(held, OwnedHook) and value == held.__call__ else None


def _outside_graph(function: Callable[..., Any], module: nn.Module, args: tuple[Any, ...]) -> Any:
    """Run ``function(module, args)`` (a hook's ``OwnedHook._eager``: the session's function,
    after the checks of an eager call) where ``torch.compile`` traces a hooked call: outside
    the graph (dynamo splits the graph there), on the real values, in the thread running the
    compiled call, once ``_untraced`` is this function wrapped in ``torch.compiler.disable``
    (``_ready_for_compile``).

    Traced instead, a hook that dynamo cannot trace (a gradient watch, a version counter, a
    storage comparison) breaks the graph inside ``OwnedHook.__call__``, whose frame dynamo then
    compiles once per hook object (each guards on its own ``function``): 12 hooked modules hit
    dynamo's recompile limit (8) and print its warning (issue 25). Disabled, this one shared
    function is never compiled, so no hook adds a recompile."""
    return function(module, args)


_untraced = _outside_graph


def _ready_for_compile() -> bool:
    """Wrap ``_untraced`` in ``torch.compiler.disable`` once ``torch._dynamo`` is loaded (by
    ``torch.compile`` or anything else), and set up ``engine.compile.graph``; called whenever hooks
    are registered. Return whether ``torch._dynamo`` is loaded.

    Not at import: ``torch.compiler.disable`` imports ``torch._dynamo``, ``torch._inductor`` and
    sympy, 820 modules and 1.5-3.5 s that every ``import hookscope`` paid (issue 32). A model
    is compiled by ``torch.compile``, which loads ``torch._dynamo`` first; only a model first
    compiled inside a block whose hooks were registered before ``torch._dynamo`` was loaded
    traces ``_outside_graph`` itself (a graph break in it, as before issue 25)."""
    if "torch._dynamo" not in sys.modules:
        return False
    if _untraced is _outside_graph:
        # another thread may still be importing it (in sys.modules, half made): an import
        # statement waits for that to finish; one thread sets up, under a lock
        import torch._dynamo  # noqa: F401
        with _compile_lock:
            _set_up_for_compile()
    return True


_compile_lock = threading.Lock()


def refuse_export_trace() -> HookscopeError:
    """The error a hook raises when ``torch.export.export`` traces the model inside a block:
    the hook would see ``FakeTensor``s (shapes without values), so nothing it records is real."""
    return HookscopeError(
        "torch.export.export traced the model while a hookscope block was open on it: the "
        "hooks see FakeTensors (shapes, no values) during export tracing, so a capture would "
        "record no value and an edit would be baked into the exported graph. Export outside the "
        "with block, then hook torch.export.unflatten(ep) or the eager model")


def _set_up_for_compile() -> None:
    global _untraced
    if _untraced is _outside_graph:
        compiled.prepare()
        _untraced = torch.compiler.disable(_outside_graph)  # type: ignore[no-untyped-call]


def register(module: nn.Module, hook: OwnedHook | Callable[..., Any], *, pre: bool = False,
             with_kwargs: bool = False, prepend: bool = False, always_call: bool = False,
             in_recompute: bool = False,
             record: Callable[[RemovableHandle], Any] | None = None) -> RemovableHandle:
    """Register ``hook`` on ``module`` as a forward (``pre``: forward-pre) hook; return the handle.

    Args:
        module: the module object the hook acts for (a copy of it never runs ``hook``).
        hook: an ``OwnedHook`` made for ``module`` (with its own ``in_recompute``; a session
            keeps it to read its counts), or a plain hook function, wrapped in one here.
        pre, with_kwargs, prepend: as torch's ``register_forward_pre_hook`` and
            ``register_forward_hook``.
        always_call: forward hooks only: run also when the forward raises.
        in_recompute: for a plain function, also run it during an activation-checkpointing
            recompute (see ``OwnedHook``).
        record: ``record(handle)`` is called before the hook is in the table (written as
            torch's ``register_forward_(pre_)hook`` write it, or, for a module overriding
            those, through them): an exception anywhere leaves no hook the caller has not
            recorded (else one landing as ``register`` returns loses the handle, issue 47).

    An ``OwnedHook`` with a ``pick`` gets a compiled sink (its ``key``: a compiled call hands
    it the value, ``engine.compile.graph``) once ``torch._dynamo`` is loaded; the caller closes it
    after removing the hook (``drop_sink``).
    """
    owned = hook if isinstance(hook, OwnedHook) else OwnedHook(hook, module, in_recompute=in_recompute)
    if _ready_for_compile() and owned.pick is not None and owned.key is None:
        owned.key = compiled.open_sink(module, owned.kept, _place(owned))
    if record is not None:
        return _recorded(module, owned.__call__, pre, with_kwargs, prepend, always_call, record)
    # returned as made: no line runs between the registration and the caller's record of it
    if pre:
        return module.register_forward_pre_hook(owned.__call__, with_kwargs=with_kwargs,
                                                prepend=prepend)
    return module.register_forward_hook(owned.__call__, with_kwargs=with_kwargs,
                                        prepend=prepend, always_call=always_call)


def _recorded(module: nn.Module, hook: Callable[..., Any], pre: bool, with_kwargs: bool, prepend: bool,
              always_call: bool, record: Callable[[RemovableHandle], Any]) -> RemovableHandle:
    """``register``'s write with ``record``: the handle recorded, then the flags, then the hook."""
    name = "register_forward_pre_hook" if pre else "register_forward_hook"
    if getattr(type(module), name) is not getattr(nn.Module, name):  # its own: asked through it
        options = {} if pre else {"always_call": always_call}
        handle: RemovableHandle = getattr(module, name)(hook, with_kwargs=with_kwargs, prepend=prepend,
                                                        **options)
        record(handle)
        return handle
    table: Any  # torch's OrderedDict (typed as a dict)
    if pre:
        table, flags = module._forward_pre_hooks, [module._forward_pre_hooks_with_kwargs]
    else:
        table = module._forward_hooks
        flags = [module._forward_hooks_with_kwargs, module._forward_hooks_always_called]
    handle = RemovableHandle(table, extra_dict=flags)
    record(handle)
    for flag, wanted in zip(flags, (with_kwargs, always_call), strict=False):
        if wanted:
            flag[handle.id] = True
    table[handle.id] = hook
    if prepend:
        table.move_to_end(handle.id, last=False)
    return handle


def drop_sink(owned: OwnedHook) -> None:
    """Close the compiled sink that ``register`` opened for ``owned`` (again: nothing)."""
    if owned.key is not None:
        compiled.close_sink(owned.key)
        owned.key = None


#: idents of the threads running a forward of hookscope's own (``engine.ground_truth``'s probe):
#: no block is theirs, so every hook skips their calls, as another thread's, without counting them
unowned_threads: set[int] = set()
_NOBODY = -1  # the ``thread`` of a host whose own block closed: no thread's ident
_FILLER = -2  # the ``thread`` of a filler while its block is open (``OwnedHook.filler``)

def _no_call(*args: Any) -> None:
    """The function of a filler (``OwnedHook.filler``): it never acts."""


def _kind(owned: OwnedHook) -> tuple[Any, ...] | None:
    """What a compiled call of ``owned`` does, for ``ModuleHooks._join``: hooks of one kind
    trace to the same operator and take the same value from a call (``pick``), whatever their
    block, so one entry serves them all; None for a hook that shares no entry (no ``pick``: a
    traced call runs its own function; a ``pick`` bound to one block's state)."""
    pick = owned.pick
    if pick is None or hasattr(pick, "__self__"):
        return None
    return type(owned), pick, owned.replaces, owned.on_gradient is None, owned.in_recompute


kind_of_hook = _kind


def _place(owned: OwnedHook) -> tuple[Any, ...]:
    """The kind of place ``owned`` takes on its module (``compiled.open_sink``): what it does
    in a graph, by code, not by object (a function watch's ``pick`` is a closure made per
    block), so each block of the same verb gets the same key there."""
    pick = getattr(owned.pick, "__func__", owned.pick)
    return (type(owned), getattr(pick, "__code__", pick), owned.replaces, owned.on_gradient is None,
            owned.in_recompute)


def traced() -> bool:
    """True while dynamo traces this call into a compiled graph (or this thread runs it on
    FakeTensors): its Python side effects happen once, at trace time, not at each call."""
    return _compiling() and _traced()


def in_recompute() -> bool:
    """True while autograd runs a backward pass: a forward now is a checkpoint recompute."""
    return not (_compiling() and _traced()) and _graph_task_id() != -1



