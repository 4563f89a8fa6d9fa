"""Private: a watched forward's frame, which hands its calls out of a ``torch.compile`` graph.

``engine.function_mode`` keeps one ``_Frame`` per running watched forward; while dynamo traces
one, ``_Frame.note`` writes each call as a head (a constant of the graph) and hands the calls a
watch wants out through ``engine.compile.graph``'s operators. Here too: the codes that name a
traced function (``_code_of``), the claims that keep a compiled model's function addresses to
one thread (``_claim``), and the checks of a call's result an edit wants.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hookscope.engine.compile import graph as compiled
from hookscope.engine.naming.function_names import function_name
from hookscope.errors import HookscopeError

if TYPE_CHECKING:
    from hookscope.engine.door.hooks import OwnedHook
    from hookscope.engine.function_mode import Watch

__all__: list[str] = []


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
        ``kwargs`` and ``output`` made before the forward goes on (``engine.compile.graph.keep``);
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
