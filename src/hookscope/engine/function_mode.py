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
out of the graph where it is made (``_Frame.note``, ``engine.compile.function_calls``: its
arguments and result, by one
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

Hooks on these calls for sessions: ``engine.function_hooks``; entering and leaving the mode:
``engine.mode_stack``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from hookscope.engine.compile import graph as compiled
from hookscope.engine.compile.function_calls import (
    _EDIT,
    _EDIT_SHARED,
    _END,
    _FUNCTIONS,
    _SHARED_WRITE,
    _claim,
    _Frame,
    _results,
    _thread_now,
    _trace_constants,
)
from hookscope.engine.door.hooks import OwnedHook, drop_sink, in_recompute, register, traced
from hookscope.engine.mode_stack import _on_top, _take_off, take_off
from hookscope.engine.naming.function_names import bind_arguments, custom_function, function_name
from hookscope.errors import EditError

__all__ = ["FunctionCall", "FunctionWatcher", "Watch"]

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
    back around it (a block's exit, where ``engine.interrupts`` holds signals back). Sessions
    do all three (``engine.function_hooks.FunctionHooks``); the
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
        appending each handle to ``handles`` (the caller removes them) before its hook is written
        (``register(..., into=)``):
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
            register(wrapper, self._enter_call, pre=True, into=handles)
            register(wrapper, self._leave_call, always_call=True, into=handles)
        for child in suspending:  # first in, last out: the child's other hooks are not ours
            register(child, OwnedHook(self._suspend_hook, child, in_recompute=again, traceable=True),
                     pre=True, prepend=True, into=handles)
            register(child, OwnedHook(self._resume_hook, child, in_recompute=again, traceable=True),
                     always_call=always, into=handles)
        for module, watches in self._watches.items():
            again = any(w.in_recompute for w in watches)
            root = module is self._root  # its frame is the call's (_enter_call)
            enter = OwnedHook(self._enter_hook(watches, root), module, in_recompute=again, traceable=True)
            leave = OwnedHook(self._leave_hook(watches, root), module, in_recompute=again, traceable=True,
                              pick=self._taken(root), on_kept=self._replayed(watches))
            for watch in watches:
                watch.enter, watch.leave = enter, leave
            register(module, enter, pre=True, into=handles)
            self._keyed.append(leave)  # before register opens its sink: close() closes it
            register(module, leave, prepend=True, always_call=always, into=handles)

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


def _note_function(frame: _Frame, name: str) -> None:
    """Note in ``made`` and ``functions`` a custom ``autograd.Function`` that the forward of
    ``frame`` called (one of whose inner calls was just seen), for the watches that see it."""
    for watch in frame.watches:
        if watch.deep or not frame.suspended:
            watch.made.setdefault(name)
            watch.functions.setdefault(name)


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



class _Mode(TorchFunctionMode):
    """The mode entered while a watched forward runs; it hands every call to the watcher."""

    def __init__(self, watcher: FunctionWatcher):
        super().__init__()
        self._watcher = watcher

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        return self._watcher.dispatch(func, args, dict(kwargs or {}))
