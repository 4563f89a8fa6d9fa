"""Private: forward hooks on the torch function calls a module's own forward makes.

Sessions serve targets that address a call (``path::fn``) with ``FunctionHooks``, over the
watcher of ``engine.function_mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope.engine.door.hooks import other_threads
from hookscope.engine.function_mode import FunctionCall, FunctionWatcher, OnCall, Watch
from hookscope.engine.naming.function_names import function_refusal, parse_op

__all__ = ["FunctionHooks"]


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



_UNSAFE = ("hookscope: a function address ('path::fn') inside a torch.utils.checkpoint region "
           "of a torch.compile(fullgraph=True) model: dynamo refuses the state hookscope keeps "
           "while it traces a watched forward there. Compile with fullgraph=False (checkpointing "
           "then runs outside the graph), address a module (without '::') in that region, or "
           "capture on the eager model (compiled._orig_mod)")
_NAMED = 12  # calls an unfired reason names (then a count)


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
