"""Private: see the torch function calls that one module's own ``forward`` makes.

Module hooks see what a module returns, never the values computed *inside* its ``forward`` by
functions (``F.relu``, ``torch.softmax``, ``F.scaled_dot_product_attention``). A
``torch.overrides.TorchFunctionMode`` sees every such call, so ``FunctionWatcher`` enters one
only while a watched module's forward runs: its forward pre-hook (registered last, so it runs
just before ``forward``) enters the mode, its forward hook (``prepend=True``, ``always_call=True``:
right after ``forward``, also when it raises) leaves it. Calls made while one of the module's
direct children runs are not the module's own: a pre-hook on each child suspends the watch and
leaves the mode until the child returns, so the child runs at full speed. Nothing is intercepted
anywhere else: no global patching, no global hooks, and modules that are not watched (or children
of watched ones) carry no hook.

Inside the mode's handler torch pops the mode, so the handler's own work (detach, clone) and the
body of a Python function it forwards to (``F.softmax`` calling ``Tensor.softmax``) are not seen:
each call the module's code makes is seen exactly once, under the name its author wrote
(``function_name``).

Each watcher enters its mode once however deeply watched modules nest (a stack of frames says
whose forward is running), and the torch calls an ``on_call`` makes are never reported.

A call is passed to ``on_call(call)`` as a ``FunctionCall`` once the function has returned;
whatever ``on_call`` returns other than ``None`` replaces the function's return value, so edits
reach everything the forward computes after it.

**Inside a ``torch.compile`` graph** (the watcher is given the model's compile wrapper) the
same hooks are traced, and the mode with them: dynamo traces a ``TorchFunctionMode`` that is on
the stack when the compiled call starts, but not one that a hook enters inside the graph (dynamo
2.13 fails with ``RecursionError``). So the wrapper's own forward pre-hook, which runs eagerly
before the compiled code, enters the mode for the whole call, and its forward hook leaves it. While
dynamo traces, the hooks keep a frame of the trace, and the mode hands each call a watch wants
out of the graph where it is made (``_Frame.note``: its arguments and result, by one
``hookscope::keep`` operator, ``engine.compile.graph``, which copies them before the forward goes on
and writes them in place); a call an edit wants goes through ``hookscope::replace``, whose result
the forward goes on with; the module's forward hook then hands out the names of all the calls
(``pick=_taken``). At run time the leave hook's sink reports each call to the watches as an
eager call would, and returns an edit's value (``_replayed``), in the order the forward made
the calls (``compiled.hold``). The graph holds no Python state: the frames of traced forwards
exist while dynamo traces only (the compiled module's own, ``_enter_call``, and one dynamo runs
apart at a graph break are eager frames of the call), and the graph compiled for one block
serves the next. A graph hands a call's values to the blocks whose
mode was on the stack when it was traced, in the thread that traced it, and torch's guard on the
mode stack compares types only, so another thread would run that graph for its own block and
record nothing: a second thread's block of function addresses on the same compiled model is
refused at entry (``_claim``).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from types import GeneratorType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from hookscope.engine.compile import graph as compiled
from hookscope.engine.door.hooks import OwnedHook, drop_sink, in_recompute, other_threads, register, traced
from hookscope.engine.naming.function_names import (
    bind_arguments,
    custom_function,
    function_name,
    function_refusal,
    parse_op,
)
from hookscope.errors import EditError, HookscopeError

__all__ = ["FunctionCall", "FunctionWatcher", "FunctionHooks", "Watch", "entered", "each_call", "take_off"]

OnCall = Callable[["FunctionCall"], Any]
_dynamo_tracing = torch.compiler.is_dynamo_compiling  # False unless dynamo traces the caller


@dataclass
class FunctionCall:
    """One call of a torch function made by a watched module's own forward.

    Attributes:
        module: the watched module whose forward made the call.
        name: the function's name as written in code: ``"relu"`` for ``F.relu``, ``torch.relu``
            and ``Tensor.relu`` alike; ``"add"`` for ``x + y``; ``"getitem"`` for ``x[0]``.
        func: the function object torch dispatched (``torch.nn.functional.relu``, ...).
        args, kwargs: the arguments as passed (references, not copies).
        output: what the function returned.
        module_call: index of the module's forward call this happened in (0, 1, ... per watch).
        occurrence: index of this call among the calls of ``name`` in that forward call.
    """

    module: nn.Module
    name: str
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    module_call: int
    occurrence: int

    def named_arguments(self) -> dict[str, Any]:
        """The arguments bound to the function's parameter names (see ``bind_arguments``)."""
        return bind_arguments(self.func, self.args, self.kwargs)


@dataclass
class Watch:
    """What to intercept in one module's forward.

    Attributes:
        module: the module watched.
        on_call: called with each ``FunctionCall`` whose name is in ``names``.
        names: function names to report; ``None`` for every call.
        deep: also report calls made inside its children (used to find the one attention
            computation of a whole block); by default only the module's own calls.
        in_recompute: also report the calls of a forward that activation checkpointing re-runs
            during backward (edits, so the recompute equals the real forward); such a forward
            is never counted in ``module_calls``.
        occurrence: only the call with this index among the calls of its name in each forward
            (``relu#1``): while dynamo traces, the others are not handed out of the graph.
        edits: ``on_call`` may return a value that replaces the call's result: inside a
            compiled graph, the call goes through ``hookscope::replace``.
        module_calls: the module's forward calls seen so far (its own thread's, not recomputes).
        made: the names of the calls its own forward made, in order of their first call (so a
            target that matched none can name what the forward did call).
        functions: the names of the custom ``torch.autograd.Function``s its own forward called
            (``function_names.custom_function``), also in ``made``: the calls inside them are theirs.
        enter: the installed forward pre-hook that opens the module's frame (its
            ``foreign_calls`` count the module's calls in other threads); ``None`` until
            ``FunctionWatcher.install``.
        leave: the installed forward hook that closes it (in a compiled call, the one that
            counts other threads' calls); ``None`` until ``FunctionWatcher.install``.
    """

    module: nn.Module
    on_call: OnCall
    names: frozenset[str] | None = None
    deep: bool = False
    in_recompute: bool = False
    occurrence: int | None = None
    edits: bool = False
    module_calls: int = field(default=0, init=False)
    made: dict[str, None] = field(default_factory=dict, init=False)
    functions: dict[str, None] = field(default_factory=dict, init=False)
    enter: OwnedHook | None = field(default=None, init=False)
    leave: OwnedHook | None = field(default=None, init=False)

    def foreign_calls(self) -> int:
        """The module's calls in other threads than the watch's (``OwnedHook.foreign_calls``)."""
        return max((h.foreign_calls for h in (self.enter, self.leave) if h is not None), default=0)


class FunctionWatcher:
    """Intercept torch function calls made by the forward of watched modules.

    Use ``watch`` for each module, then ``install()`` (returns the hook handles, which the
    caller removes) and, once the forward passes are over, ``close()``, which leaves a mode that
    an interrupted forward (``KeyboardInterrupt``) left entered; the caller holds interrupts
    back around it (``interrupts.deferred``). Sessions do all three (``FunctionHooks``); the
    hooks are owned (``hooks.register``), so a forward run by another thread, or by a copy of a
    watched module, never enters the mode and is never reported.

    Args:
        wrapper: the ``torch.compile`` wrapper (``OptimizedModule``) that the watched modules
            are called through, if any: its calls hold the mode whole (see the module's
            docstring).
    """

    def __init__(self, wrapper: nn.Module | None = None) -> None:
        self._watches: dict[nn.Module, list[Watch]] = {}
        self._frames: list[_Frame] = []  # one per running watched forward, innermost last
        # While dynamo traces in the block's thread (only then): the frames of the traced
        # forward (the compiled module's own is in _frames: _enter_call). Dynamo writes a list
        # a trace changed back after each compiled call with what the trace left (nothing).
        self._traced: list[_Frame] = []
        self._thread = threading.get_ident()  # the block's (install)
        self._mode = _Mode(self)
        # Whether self._mode is entered (once). Set before the push and cleared after the pop:
        # an interrupt in between makes it claim the mode, never lose it; close() goes by
        # torch's stack itself.
        self._entered = False
        self._wrapper = wrapper
        self._root = getattr(wrapper, "_orig_mod", None)  # the module the wrapper compiles
        self.for_compiled = wrapper is not None  # read while dynamo traces (not the module)
        self._whole = False  # entered for a whole call of the wrapper (_enter_call)
        self._keyed: list[OwnedHook] = []  # hooks with a compiled sink (closed by close())
        self._replaying: dict[int, _Frame] = {}  # id(watches) -> a compiled forward's frame (_replayed)
        self._root_frame: _Frame | None = None  # the compiled module's, during a call (_enter_call)
        self._claimed = False  # whether this thread's claim on the wrapper is held (_claim)

    def watch(self, module: nn.Module, on_call: OnCall, *, names: Iterable[str] | None = None,
              deep: bool = False, in_recompute: bool = False, occurrence: int | None = None,
              edits: bool = False) -> Watch:
        """Report the calls of ``names`` (every call when ``None``) in ``module``'s forward; see
        ``Watch`` for ``deep``, ``in_recompute``, ``occurrence`` and ``edits``."""
        entry = Watch(module, on_call, None if names is None else frozenset(names), deep,
                      in_recompute, occurrence, edits)
        self._watches.setdefault(module, []).append(entry)
        return entry

    def install(self, handles: list[RemovableHandle]) -> None:
        """Add the forward pre-hooks and hooks on watched modules and their direct children,
        appending each handle to ``handles`` (the caller removes them) on the line that makes it:
        no exception comes between a registration and its record."""
        # On a child that is watched too, the parent's frame is suspended before the child's
        # frame is pushed (prepend) and resumed after it is popped (appended).
        suspending = {child: None for module, watches in self._watches.items()
                      if not all(w.deep for w in watches) for child in module.children()}
        again = any(w.in_recompute for watches in self._watches.values() for w in watches)
        # Under a compile wrapper, whose forward hook ends every frame, the hooks inside are not
        # always called: dynamo guards on their ids in that table (a recompile per block).
        wrapper = self._wrapper
        self._thread = threading.get_ident()
        always = wrapper is None
        if wrapper is not None and self._watches:  # outside the compiled code
            self._claimed = _claim(wrapper, +1)  # first: refused, nothing is registered
            _trace_constants()
            handles.append(register(wrapper, self._enter_call, pre=True))
            handles.append(register(wrapper, self._leave_call, always_call=True))
        for child in suspending:  # first in, last out: the child's other hooks are not ours
            handles.append(register(child, OwnedHook(self._suspend_hook, child, in_recompute=again,
                                                     traceable=True), pre=True, prepend=True))
            handles.append(register(child, OwnedHook(self._resume_hook, child, in_recompute=again,
                                                     traceable=True), always_call=always))
        for module, watches in self._watches.items():
            again = any(w.in_recompute for w in watches)
            root = module is self._root  # its frame is the call's (_enter_call)
            enter = OwnedHook(self._enter_hook(watches, root), module, in_recompute=again, traceable=True)
            leave = OwnedHook(self._leave_hook(watches, root), module, in_recompute=again, traceable=True,
                              pick=self._taken(root), on_kept=self._replayed(watches))
            for watch in watches:
                watch.enter, watch.leave = enter, leave
            handles.append(register(module, enter, pre=True))
            self._keyed.append(leave)  # before register opens its sink: close() closes it
            handles.append(register(module, leave, prepend=True, always_call=always))

    def close(self) -> None:
        """Take the mode off torch's mode stack wherever it is (a forward interrupted inside a
        watched module leaves it entered, maybe under modes entered after it, which stay in
        their order); nothing is popped when it is not there."""
        self._frames.clear()
        self._replaying.clear()
        if self._entered:
            take_off(self._mode)
        else:
            _take_off(self._mode)
        self._entered = self._whole = False
        _reporting.active = False  # an exception between its set and reset left it on
        for hook in self._keyed:
            drop_sink(hook)
        if self._claimed and self._wrapper is not None:
            self._claimed = _claim(self._wrapper, -1)

    # ---------------------------------------------------------------- hooks
    # While dynamo traces, a hook reads only what no other thread changes (dynamo guards what
    # it reads): never _whole, which the block's thread sets for each call (an attack's threads
    # without a block recompiled on it until dynamo's limit). ``root``: the hook is on the
    # compiled module, whose frame is the call's (_enter_call), whether dynamo traces its hooks
    # or runs them apart.
    def _enter_hook(self, watches: list[Watch], root: bool) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if traced():  # a frame of the trace (_Frame.note), ended by the leave hook (_taken)
                if not self.for_compiled:  # set up for eager calls: an error at the call
                    compiled.refuse(-1, compiled.CALLS_UNCOMPILED)
                elif not root and self._tracing_here():
                    self._traced.append(_Frame(watches, [], watches[0].leave))
                return
            if root and self._whole:  # begun by the call
                return
            frame = _counted(watches)
            if self._whole:  # run apart during a compiled call (at a graph break): the rest of
                frame.leave = watches[0].leave  # its forward may be traced, as the compiled
                self._replaying[id(watches)] = frame  # module's own frame is (_enter_call)
            self._frames.append(frame)
            self._sync()
        return hook

    def _leave_hook(self, watches: list[Watch], root: bool) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if traced():
                if not root and self._tracing_here() and self._traced:
                    self._traced.pop()
                return
            if root and self._whole:  # ended by the call (_leave_call)
                return
            if self._frames:
                frame = self._frames.pop()
                if frame.leave is not None:  # (see the enter hook) the names dynamo noted in it
                    self._replaying.pop(id(watches), None)
                    _note_made(frame, frame.heads)
            self._sync()
        return hook

    def _tracing_here(self) -> bool:
        """While dynamo traces: whether in the block's thread. A trace in another thread (a
        call without this block) leaves the block's frames alone: its graph serves calls
        without this block's mode, which note nothing."""
        return self.for_compiled and _thread_now[0]() == self._thread

    def _innermost(self) -> _Frame | None:
        """While dynamo traces in the block's thread: the innermost frame (of the trace, or
        the compiled module's own, begun by the call: ``_enter_call``)."""
        return self._traced[-1] if self._traced else self._frames[-1] if self._frames else None

    def _taken(self, root: bool) -> Callable[..., tuple[str, ...]]:
        """``pick`` of the leave hook while dynamo traces: the frame ends, handing out the
        heads of all its calls in order (``_Frame.note``), after ``_END`` (the compiled
        module's frame ends with the call: ``_leave_call``)."""
        def taken(module: nn.Module, args: Any, output: Any) -> tuple[str, ...]:
            if not root and self._tracing_here() and self._traced:
                return (_END, *self._traced.pop().heads)
            return (_END,)
        return taken

    def _replayed(self, watches: list[Watch]) -> Callable[[Any], Any]:
        """The sink of a compiled call's watched forward (``on_kept``, run after the thread and
        recompute checks of ``OwnedHook.kept``). Each value handed out of the graph, in the
        order the forward made them (``compiled.hold``: inductor runs the operators in an order
        of its own), is:

        - a call a watch wants (``_CALL``, head, args, kwargs, output: copies), reported to the
          watches as ``dispatch`` does;
        - a call an edit wants (``_EDIT``, head, a copy of its result, from
          ``hookscope::replace``, at once), whose watches' return (None: the result as it was)
          is what the forward goes on with;
        - the end of the forward (``_END`` and the heads of all its calls: the names it made,
          in order).

        The first value of a forward counts its call (``_counted``); the compiled module's own
        frame is counted by the call (``_enter_call``)."""
        key = id(watches)

        def replay(value: Any) -> Any:
            if key not in self._replaying:  # the forward's first value
                self._replaying[key] = _counted(watches)
            frame = self._replaying[key]
            if value[0] == _END:
                del self._replaying[key]
                _note_made(frame, value[1:])
                return None
            if value[0] in (_EDIT, _EDIT_SHARED):
                return self._edited(frame, watches, *value)
            return self._replay(frame, watches, *value[1:])
        return replay

    def _edited(self, frame: _Frame, watches: list[Watch], kind: str, head: str, output: Any) -> Any:
        """Report a call an edit wants (``_replay``) with a copy of its result; return what the
        forward goes on with.

        Raises:
            EditError: the edit wrote the copy in place, and the call's result is a view
                (``h.view(...)``): eagerly that write reaches the viewed tensor too, in a compiled
                graph it cannot (found by an attack: the outputs differed silently)."""
        tensors = [t for t in _results(output) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        new = self._replay(frame, watches, head, (), {}, output)
        if kind == _EDIT_SHARED and [t._version for t in tensors] != versions:
            raise EditError(_SHARED_WRITE.format(name=head.split(" ")[1]))
        return new

    def _replay(self, frame: _Frame, watches: list[Watch], head: str, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any) -> Any:
        """Report one call of a compiled forward, written as ``_Frame.note``'s ``head`` (the
        names made are noted at its end: ``_replayed``); return what replaces its result."""
        code, _, suspended, occurrences = head.split(" ")
        frame.suspended = int(suspended)
        counted = {id(w): int(k) for w, k in zip(watches, occurrences.split(","))}
        _reporting.active = True  # as dispatch: the torch calls on_call makes are its own
        try:
            return self._report(frame, _FUNCTIONS[int(code)], args, kwargs, output, made=False,
                                occurrences=counted)
        finally:
            _reporting.active = False

    def _suspend_hook(self, module: nn.Module, args: Any) -> None:
        frame = (self._innermost() if self._tracing_here() else None) if traced() else \
            self._frames[-1] if self._frames else None
        if frame is not None:
            frame.suspended += 1
            self._sync()

    def _resume_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        frame = (self._innermost() if self._tracing_here() else None) if traced() else \
            self._frames[-1] if self._frames else None
        if frame is not None and frame.suspended:
            frame.suspended -= 1
            self._sync()

    def _enter_call(self, module: nn.Module, args: Any) -> None:
        """The compile wrapper's pre-hook: the mode on the stack for the whole call, where
        dynamo traces it (and its guards find it), and the frame of the compiled module when
        it is watched, begun here for the whole call: dynamo runs that module's own hooks
        outside the graph (they are frames of their own, ``compiled.eager_when_called``), so
        they do nothing then. One frame object per call, which dynamo reads while it traces
        and to which it replays the heads noted in it (``_leave_call``)."""
        if self._entered:
            return
        self._entered = self._whole = True  # set before the push: claimed, never lost
        torch._C._push_on_torch_function_stack(self._mode)
        watches = self._watches.get(self._root)  # type: ignore[arg-type]
        if watches:
            frame = self._root_frame = _counted(watches)
            frame.leave = watches[0].leave
            self._frames.append(frame)  # read while dynamo traces (note)
            self._replaying[id(watches)] = frame  # the sink's, at run time (_replayed)

    def _leave_call(self, module: nn.Module, args: Any, output: Any) -> None:
        """The compile wrapper's forward hook (also when the call raised; after the session's
        ``compiled.release`` handed the call's values out): the names the compiled module's
        forward made noted, the mode off, and the frames of forwards that raised ended."""
        try:
            if self._root_frame is not None:
                _note_made(self._root_frame, self._root_frame.heads)  # its dynamo-replayed list
        finally:
            self._root_frame = None
            self._frames.clear()
            self._replaying.clear()
            if self._whole:
                take_off(self._mode)
                self._entered = self._whole = False

    def _sync(self) -> None:
        """Have the mode entered exactly while the innermost watched forward wants calls: not
        while one of its children runs (unless a watch is deep), so children run at full speed.
        Leaving needs the mode on top of torch's stack; if another mode is above it (one that
        the model entered), it stays, and ``dispatch`` passes the children's calls through.
        Nothing changes while the wrapper's call holds it (``_enter_call``), or while dynamo
        traces (a hook there is traced into the graph, not run)."""
        if traced() or self._whole:  # (traced first: dynamo guards what it reads)
            return
        frame = self._frames[-1] if self._frames else None
        wanted = frame is not None and (not frame.suspended or frame.deep)
        if wanted and not self._entered:
            self._entered = True
            torch._C._push_on_torch_function_stack(self._mode)
        elif not wanted and self._entered and _on_top(self._mode):
            torch._C._pop_torch_function_stack()
            self._entered = False

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, func: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        """Run ``func`` and report it to the innermost running watched forward."""
        output = func(*args, **kwargs)
        frames = self._frames
        if self._traced or (frames and frames[-1].leave is not None):  # a compiled call's
            if traced() and not compiled.making[0]:  # noted in the graph, reported by the sink
                return (self._traced or frames)[-1].note(func, args, kwargs, output)  # (_replayed)
            return output  # at run time: its graph's calls (eager backend), or hookscope's own
        if not frames or _reporting.active:
            return output
        if _dynamo_tracing():  # an eager frame of a block set up for eager calls, in code dynamo
            compiled.refuse(-1, compiled.CALLS_UNCOMPILED)  # traces: an error at the call
            return output
        frame = frames[-1]
        function = custom_function()
        if function is not None:  # made inside a custom autograd.Function: not the module's own
            _note_function(frame, function.__name__)
            return output
        _reporting.active = True  # torch calls made by on_call are hookscope's, not the module's
        try:
            return self._report(frame, func, args, kwargs, output)
        finally:
            _reporting.active = False

    def _report(self, frame: _Frame, func: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, *, made: bool = True,
                occurrences: dict[int, int] | None = None) -> Any:
        """Hand a call to the frame's watches that see it (``on_call``); return what replaces
        its output. ``occurrences`` (``{id(watch): index}``): the call's index among its
        name's calls as dynamo counted them while tracing (a compiled call hands out only the
        calls a watch wants), instead of counting here."""
        name = function_name(func)
        for watch, module_call in zip(frame.watches, frame.module_calls):
            if frame.suspended and not watch.deep:
                continue
            if made:
                watch.made.setdefault(name)
            if watch.names is not None and name not in watch.names:
                continue
            occurrence = frame.count(watch, name) if occurrences is None else occurrences[id(watch)]
            call = FunctionCall(watch.module, name, func, args, kwargs, output, module_call,
                                occurrence)
            new = watch.on_call(call)
            if new is not None:
                output = new
        return output


class _Reporting(threading.local):
    """``active`` is True while some watcher's ``on_call`` runs in this thread: the torch calls
    it makes are seen by the modes of other watchers still on this thread's stack (two sessions
    watching one forward), which must pass them through. Per thread, as torch's function-mode
    stack is: a capture of ``a::relu`` in one thread and an edit of ``b::relu`` in another never
    see each other's flag (one flag per process lost edits and captures: issue 35)."""

    active = False


_reporting = _Reporting()


class FunctionHooks:
    """Forward hooks on function calls: how sessions serve targets that address a call.

    ``add(module, op, hook)`` makes ``hook(module, args, output)`` (or ``hook(module, args,
    kwargs, output)``) run after each call of ``op`` in ``module``'s own forward, exactly as a
    forward hook runs after the module: ``args``/``kwargs`` are the function's, ``output`` its
    return value, and a non-``None`` return replaces it.

    Args:
        wrapper: the ``torch.compile`` wrapper the model is called through, if any (see
            ``FunctionWatcher``).
    """

    def __init__(self, wrapper: nn.Module | None = None) -> None:
        self._watcher = FunctionWatcher(wrapper)
        self._watches: dict[str, tuple[Watch, str]] = {}
        self.called: set[str] = set()  # record names whose function was called
        self.functions: dict[str, Callable[..., Any]] = {}  # record name -> function called

    def add(self, key: str, module: nn.Module, op: str, hook: Callable[..., Any], *,
            with_kwargs: bool = False, in_recompute: bool = False, edits: bool = False) -> None:
        """Call ``hook`` for the calls ``op`` (``"relu"``, ``"relu#1"``) selects in ``module``;
        ``key`` is the record name (``"conv_stack::relu"``); ``in_recompute`` also for the
        forward that activation checkpointing re-runs during backward, ``edits`` when
        ``hook`` may return a value (see ``Watch``)."""
        name, occurrence = parse_op(op)
        called, functions = self.called, self.functions

        def on_call(call: FunctionCall) -> Any:
            if occurrence is not None and call.occurrence != occurrence:
                return None
            called.add(key)
            functions[key] = call.func
            if with_kwargs:
                return hook(call.module, call.args, call.kwargs, call.output)
            return hook(call.module, call.args, call.output)
        self._watches[key] = (self._watcher.watch(module, on_call, names={name},
                                                  in_recompute=in_recompute, occurrence=occurrence,
                                                  edits=edits), op)

    def watch(self, module: nn.Module, on_call: OnCall, *, names: Iterable[str] | None = None,
              deep: bool = False) -> Watch:
        """Have ``on_call(call)`` see the calls of ``names`` (every call when ``None``) in
        ``module``'s forward, as ``FunctionWatcher.watch`` (``tree --ops``, ``attention``);
        enter the session afterwards, which installs the hooks and removes them on exit."""
        return self._watcher.watch(module, on_call, names=names, deep=deep)

    def install(self, handles: list[RemovableHandle]) -> None:
        """Add the hooks (see ``FunctionWatcher.install``) into ``handles``; the caller removes
        them."""
        self._watcher.install(handles)

    def close(self) -> None:
        """Leave the mode if a forward was interrupted (see ``FunctionWatcher.close``)."""
        self._watcher.close()

    def explain(self, exc: BaseException) -> None:
        """Add a note to ``exc`` when dynamo refused to trace what the watches need (inside
        ``torch.utils.checkpoint``, dynamo refuses any change to state from outside the
        checkpointed function, as a frame of a watched forward is: found by an attack)."""
        if (self._watches and self._watcher.for_compiled and type(exc).__name__ == "Unsupported"
                and "Unsafe side effect" in str(exc)):
            exc.add_note(_UNSAFE)

    def refuses(self, key: str) -> bool:
        """Whether record ``key`` addresses a custom ``torch.autograd.Function`` its module's
        forward called (``unfired`` gives the refusal: such an address never records)."""
        watch, op = self._watches[key]
        return key not in self.called and parse_op(op)[0] in watch.functions

    def unfired(self, key: str, path: str) -> str | None:
        """Why the calls of record ``key`` were never seen although its module ran (in this
        block's thread, or only in other threads), or ``None`` when they were seen or the module
        itself never ran (a module-level reason then)."""
        watch, op = self._watches[key]
        if key in self.called:
            return None
        if not watch.module_calls:
            foreign = watch.foreign_calls()
            return other_threads(path, foreign) if foreign else None
        name, occurrence = parse_op(op)
        where = f"'{path}'" if path else "the model"
        if name in watch.functions:
            return function_refusal(where, name)
        what = f"call {occurrence} of {name}" if occurrence is not None else f"any {name}"
        return (f"{where} ran {watch.module_calls} time{'s' if watch.module_calls > 1 else ''} "
                f"but its own forward never made {what}; {_made(watch)} (calls made inside "
                f"its children are theirs: address the child that makes it). 'hookscope tree "
                f"MODEL --input X --ops' lists the calls of every module's own forward")


_SHARED_WRITE = (
    "an edit wrote the result of '{name}' in place inside a torch.compile graph, and that result "
    "is a view of another tensor (x.view(...), x.transpose(...)): eagerly the write reaches "
    "that tensor too, inside a compiled graph it cannot. "
    "Return a new tensor instead (o = o.clone(); o[..., 0] = 0; return o), or edit the eager "
    "model (compiled._orig_mod)")


def _results(output: Any) -> tuple[Any, ...]:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def _shares_memory(output: Any) -> bool:
    """While dynamo traces: whether a call's result is a view of another tensor (``_base``)."""
    return any(isinstance(r, torch.Tensor) and r._base is not None for r in _results(output))


def _in_place(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """While dynamo traces: whether a call returned one of its tensor arguments (an in-place
    call: ``x.relu_()``, ``x += y``)."""
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return any(r is a for r in _results(output) for a in inputs)


_UNSAFE = ("hookscope: a function address ('path::fn') inside a torch.utils.checkpoint region "
           "of a torch.compile(fullgraph=True) model: dynamo refuses the state hookscope keeps "
           "while it traces a watched forward there. Compile with fullgraph=False (checkpointing "
           "then runs outside the graph), address a module (without '::') in that region, or "
           "capture on the eager model (compiled._orig_mod)")
_NAMED = 12  # calls an unfired reason names (then a count)


def _note_function(frame: _Frame, name: str) -> None:
    """Note in ``made`` and ``functions`` a custom ``autograd.Function`` that the forward of
    ``frame`` called (one of whose inner calls was just seen), for the watches that see it."""
    for watch in frame.watches:
        if watch.deep or not frame.suspended:
            watch.made.setdefault(name)
            watch.functions.setdefault(name)


def _made(watch: Watch) -> str:
    """``"it made: a, b, c"``: the calls a forward made, listed for an address that matched none
    (GPT-2's attention makes ``scaled_dot_product_attention``, no ``softmax``); a custom
    ``autograd.Function`` it called is listed by its name, marked, never the calls inside it."""
    made = watch.made
    if not made:
        return "it made no torch call of its own"
    names = [f"{n} (a custom autograd.Function)" if n in watch.functions else n for n in made]
    rest = f", … {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return f"it made: {', '.join(names[:_NAMED])}{rest}"


def _note_made(frame: _Frame, heads: Iterable[str]) -> None:
    """Note in ``made`` the names of a compiled forward's calls (``_Frame.note``'s heads), for
    the watches that see each (not inside a child, unless deep)."""
    for head in heads:
        _, name, suspended, _ = head.split(" ")
        for watch in frame.watches:
            if watch.deep or suspended == "0":
                watch.made.setdefault(name)


def _counted(watches: list[Watch]) -> _Frame:
    """The frame of a watched forward that begins (eagerly, or replayed from a compiled call),
    counted as a call of each watch; a checkpoint recompute (the same call again) is counted by
    none and reported only to the watches that ask for recomputes."""
    if in_recompute():
        active = [w for w in watches if w.in_recompute]
        return _Frame(active, [max(w.module_calls - 1, 0) for w in active])
    calls = [w.module_calls for w in watches]
    for watch in watches:
        watch.module_calls += 1
    return _Frame(watches, calls)


class _Frame:
    """One running forward of a watched module (or, while dynamo traces, of its trace, whose
    calls go to the compiled sink of ``leave``)."""

    __slots__ = ("watches", "module_calls", "suspended", "counts", "deep", "leave", "heads")

    def __init__(self, watches: list[Watch], module_calls: list[int], leave: OwnedHook | None = None):
        self.watches = watches
        self.deep = any(w.deep for w in watches)
        self.module_calls = module_calls
        self.suspended = 0  # > 0 while a direct child runs
        self.counts: dict[tuple[int, str], int] = {}
        self.leave = leave
        self.heads: list[str] = []  # traced: the head of each call, in order (note)

    def note(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             output: Any) -> Any:
        """While dynamo traces: write a call as its head, ``"<code> <name> <suspended> <k,...>"``
        (``_function_code``; k: the call's index among its name's calls for each watch, -1 for a
        watch that does not see it; strings are constants of the graph); return what the
        forward goes on with. A call a watch wants goes out of the graph here, with copies of its ``args``,
        ``kwargs`` and ``output`` made before the forward goes on (``engine.compiled.keep``);
        one an edit wants, its result through ``engine.compile.graph.replace_call``; every head
        goes out at the end (``_taken``): the names a forward made, in order."""
        called = _function_code[0](func)
        name = called.partition(" ")[2]
        wanted = edits = False
        occurrences = []
        for place, watch in enumerate(self.watches):  # as _report and FunctionHooks.add choose
            if (self.suspended and not watch.deep) or (watch.names is not None and name not in watch.names):
                occurrences.append("-1")
                continue
            seen = self.counts.get((place, name), 0)  # by place: an id() is a guard per object
            self.counts[place, name] = seen + 1
            occurrences.append(str(seen))
            if watch.occurrence in (None, seen):
                wanted, edits = True, edits or watch.edits
        head = f"{called} {self.suspended} {','.join(occurrences)}"
        self.heads.append(head)
        key = None if self.leave is None else self.leave.key
        if key is None or not wanted:
            return output
        refusal = compiled.call_refusal(output) if edits else None
        if edits and refusal is None and _in_place(output, args, kwargs):
            refusal = compiled.CALL_IN_PLACE
        if refusal is not None:  # raises EditError at the call, before anything is reported
            compiled.refuse(key, refusal)
        else:
            if edits:  # (a view of an input: an edit writing it in place is refused)
                kind = _EDIT_SHARED if _shares_memory(output) else _EDIT
                output = compiled.replace_call(output, key, (kind, head))
            else:
                values, spec = compiled.flatten((_CALL, head, args, kwargs, output))
                compiled.keep(values, spec, key)
        return output

    def count(self, watch: Watch, name: str) -> int:
        key = (id(watch), name)
        seen = self.counts.get(key, 0)
        self.counts[key] = seen + 1
        return seen


class entered:  # noqa: N801 - used as a function: ``with entered(mode):``
    """Have ``mode`` (a ``TorchFunctionMode``) on this thread's torch function-mode stack for
    the block: the one way hookscope enters a mode of its own for a whole block
    (``each_call``). However the block ends (an exception, a KeyboardInterrupt at any
    line, one inside the mode's own ``__torch_function__`` while torch holds it aside), the
    mode is taken off (``take_off``), modes entered after it staying in their order. torch's
    function-mode stack is per thread, so a mode entered here never sees another thread's
    calls."""

    def __init__(self, mode: TorchFunctionMode):
        self.mode = mode

    def __enter__(self) -> None:
        try:
            torch._C._push_on_torch_function_stack(self.mode)
        except BaseException:
            take_off(self.mode)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            take_off(self.mode)
        except BaseException:
            take_off(self.mode)  # idempotent: what an exception halfway left
            raise


OnOutput = Callable[[Callable[..., Any], tuple[Any, ...], Mapping[str, Any] | None, Any], None]


def each_call(on_output: OnOutput) -> entered:
    """A context (``with each_call(f):``) during which, on this thread, every torch function
    runs as usual and then ``on_output(func, args, kwargs, output)`` gets what it returned
    (``find_nonfinite`` notes which call made each value): a ``TorchFunctionMode`` of the engine's
    for a whole block, entered and taken off as ``entered`` does."""
    return entered(_EachCall(on_output))


class _EachCall(TorchFunctionMode):
    """Passes every torch function through, then hands its output to ``on_output``."""

    def __init__(self, on_output: OnOutput):
        super().__init__()
        self.on_output = on_output

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        output = func(*args, **(kwargs or {}))
        self.on_output(func, args, kwargs, output)
        return output


def take_off(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack wherever it is, also when an interrupt
    left it held aside by torch (``_stashes``); nothing when it is not there."""
    if _depth(mode) is None:  # interrupted: torch may hold it aside
        for stash in _stashes(mode):
            stash.close()  # puts it back on the stack now, not when garbage-collected
    _take_off(mode)


def _on_top(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is the innermost torch function mode (so that leaving it pops it)."""
    depth = torch._C._len_torch_function_stack()
    return bool(depth) and torch._C._get_function_stack_at(depth - 1) is mode


def _stashes(mode: TorchFunctionMode) -> list[Generator[Any, None, None]]:
    """The suspended ``torch.overrides._pop_mode_temporarily`` generators holding ``mode``.

    ``handle_torch_function`` takes the innermost mode off the stack around its
    ``__torch_function__`` in such a generator; an interrupt inside its ``__enter__`` or
    ``__exit__`` leaves it suspended, and it pushes the mode back whenever it is
    garbage-collected: long after the block took the mode away for good."""
    if _STASH_CODE is None:
        return []
    return [holder for holder in gc.get_referrers(mode)
            if isinstance(holder, GeneratorType) and holder.gi_code is _STASH_CODE
            and holder.gi_frame is not None and not holder.gi_running]


_STASH_CODE = getattr(getattr(getattr(torch.overrides, "_pop_mode_temporarily", None),
                              "__wrapped__", None), "__code__", None)


def _depth(mode: TorchFunctionMode) -> int | None:
    """Where ``mode`` is on torch's function-mode stack (0: outermost), or None."""
    return next((i for i in range(torch._C._len_torch_function_stack())
                 if torch._C._get_function_stack_at(i) is mode), None)


def _take_off(mode: TorchFunctionMode) -> None:
    """Remove ``mode`` from torch's function-mode stack, if there, keeping the others in order."""
    at = _depth(mode)
    if at is None:
        return
    depth = torch._C._len_torch_function_stack()
    above = [torch._C._pop_torch_function_stack() for _ in range(depth - at)][::-1]
    for other in above:
        if other is not mode:
            torch._C._push_on_torch_function_stack(other)


_claims: weakref.WeakKeyDictionary[nn.Module, dict[int, int]] = weakref.WeakKeyDictionary()
_claims_lock = threading.Lock()


def _claim(wrapper: nn.Module, change: int) -> bool:
    """Count a block of function addresses on the compile ``wrapper`` opening (``change=+1``)
    or closing (-1) in this thread; return whether this one holds a claim now.

    Raises:
        HookscopeError: opening while a block of another thread holds one (see the module's
            docstring), naming the fixes."""
    with _claims_lock:
        return _claimed(wrapper, threading.get_ident(), change)


def _claimed(wrapper: nn.Module, thread: int, change: int) -> bool:
    threads = _claims.setdefault(wrapper, {})
    if change > 0 and any(other != thread for other in threads):
        raise HookscopeError(
            "another thread has a block open with a function address ('path::fn') on this "
            "torch.compile'd model: its compiled graph hands a call's values to the blocks of "
            "the thread that traced it, so a second thread's block would record nothing. Open "
            "such blocks in one thread at a time, give each thread its own compiled copy "
            "(torch.compile(copy.deepcopy(model))), or capture in the eager model "
            "(model._orig_mod); module addresses (without '::') may be open in many threads")
    threads[thread] = threads.get(thread, 0) + change
    if threads[thread] <= 0:
        del threads[thread]
    return change > 0


#: the first item of what a compiled forward hands out (_replayed)
_CALL, _EDIT, _EDIT_SHARED, _END = "call", "edit", "edit-shared", "end"
_FUNCTIONS: list[Callable[..., Any]] = []  # code -> function (_code_of)


def _code_of(func: Callable[..., Any]) -> str:
    """``"<code> <name>"`` of a torch function: its place in ``_FUNCTIONS`` and
    ``function_name``. Dynamo runs it once per function while it traces, and the graph holds
    the string (``torch._dynamo.assume_constant_result``: ``_function_code``)."""
    if func not in _FUNCTIONS:
        _FUNCTIONS.append(func)
    return f"{_FUNCTIONS.index(func)} {function_name(func)}"


_function_code: list[Callable[[Callable[..., Any]], str]] = [_code_of]  # see _trace_constants
def _thread() -> int:
    """The calling thread's ident (``threading.get_ident``; a Python function, which dynamo can
    hold as a constant: ``_trace_constants``)."""
    return threading.get_ident()


_thread_now: list[Callable[[], int]] = [_thread]  # the tracing thread's (see _trace_constants)


def _trace_constants() -> None:
    """Have dynamo run ``_code_of`` while it traces and hold its result as a constant (once;
    ``torch._dynamo`` is loaded: a compile wrapper exists)."""
    if _function_code[0] is _code_of:
        _function_code[0] = torch._dynamo.assume_constant_result(_code_of)  # type: ignore[no-untyped-call]
        _thread_now[0] = torch._dynamo.assume_constant_result(_thread)  # type: ignore[no-untyped-call]


class _Mode(TorchFunctionMode):
    """The mode entered while a watched forward runs; it hands every call to the watcher."""

    def __init__(self, watcher: FunctionWatcher):
        super().__init__()
        self._watcher = watcher

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        return self._watcher.dispatch(func, args, dict(kwargs or {}))
