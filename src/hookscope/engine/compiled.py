"""Private: module hooks that a ``torch.compile`` graph holds whole (``fullgraph=True``).

A forward hook that only reads its module's output (a capture, ``stats``) runs, inside a
compiled graph, as one opaque operator, ``hookscope::keep(values, kind, key)``: dynamo puts it
in the graph as it is (a custom operator, ``torch.library.custom_op``), registered as an ordered
side effect (``EffectType.ORDERED``: no compiler pass drops it, though it returns nothing, or
moves it across another). At run time the operator calls the sink registered under ``key``
with the real output, rebuilt as the module returned it. So:

- no graph break, and the graph runs at compiled speed: the only added work is a copy of each
  kept tensor (``keep`` copies: inductor reuses and writes intermediate buffers through raw
  pointers, which a copy-on-write view would not see);
- no per-object guard: dynamo guards the hook's ``key`` (an ``int``) and its type. A key names a
  *place* (module object, n-th hookscope hook on it), not a session, so each new block on the
  same modules reuses the code compiled for the last one: a model compiles twice in all (with
  the hooks, without them), however many blocks open and close.

A sink runs eagerly, on real tensors, in the thread running the compiled call.

Code compiled without hooks must check that the hook tables are still empty, or it would run on
silently when a block adds hooks: dynamo skips that check by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``); ``prepare`` turns it off when
``torch._dynamo`` is loaded, for code compiled from then on (a few dictionary-length checks per
module per call). Code compiled before that still ignores new hooks: a block reports it
(``diagnose._COMPILED_WHY``, with the fix ``torch._dynamo.reset()``).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._library.effects import EffectType

__all__ = ["prepare", "eager_when_called", "open_sink", "close_sink", "keep", "flat_output"]

Tensor = torch.Tensor
Sink = Callable[[Any], None]

TENSOR, TUPLE, LIST = 0, 1, 2  # how ``keep`` rebuilds what the module returned
_sinks: dict[int, Sink] = {}
_places: weakref.WeakKeyDictionary[nn.Module, list[int]] = weakref.WeakKeyDictionary()
_next_key = [0]
_keys_lock = threading.Lock()  # two threads opening blocks on one module get two keys
_op: list[Any] = []  # the operator, defined once on first use
_checked: list[bool] = []  # whether torch._dynamo was set up (prepare)
_hook_codes: list[Any] = []  # code objects of hooks' __call__ (eager_when_called)


def prepare() -> None:
    """Define the ``hookscope::keep`` operator (once, 30 ms) and make code that dynamo compiles
    from now on check the hook tables; ``engine.hooks`` calls it once ``torch._dynamo`` is
    loaded, before it gives any hook a key."""
    if not _op:
        _op.append(_define())
    if not _checked and (dynamo := sys.modules.get("torch._dynamo")) is not None:
        dynamo.config.skip_nnmodule_hook_guards = False
        frames: Any = dynamo.eval_frame
        skip = frames.FrameExecStrategy(frames.FrameAction.SKIP, frames.FrameAction.SKIP)
        for code in _hook_codes:  # a frame of its own: eager, whole (see eager_when_called)
            frames.set_code_exec_strategy(code, skip)
        _checked.append(True)


def eager_when_called(code: Any) -> None:
    """Never compile ``code`` (a hook's ``__call__``) as a frame of its own, nor what it calls.

    Dynamo runs the hooks of a compiled model's root module outside the graph, and would then
    compile each such hook call as a frame of its own: a third compile, redone per hook object.
    Called there, the hook is plain Python (``torch.compiler.is_compiling()`` is False) and
    runs eagerly. Traced inline, inside a module's call in the graph, it still is: dynamo's
    frame strategy concerns frames it is handed, not code it inlines."""
    _hook_codes.append(code)


def _define() -> Any:
    @torch.library.custom_op("hookscope::keep", mutates_args=())
    def keep_op(values: list[Tensor | None], kind: int, key: int) -> None:
        sink = _sinks.get(key)
        if sink is None:  # the block closed: code compiled with its hooks is never run then
            return
        kept = [None if v is None else v.detach().clone() for v in values]
        sink(kept[0] if kind == TENSOR else tuple(kept) if kind == TUPLE else kept)

    @keep_op.register_fake
    def _(values: list[Tensor | None], kind: int, key: int) -> None:
        return None

    keep_op.register_effect(EffectType.ORDERED)
    return torch.ops.hookscope.keep.default


def open_sink(module: nn.Module, sink: Sink) -> int:
    """Register ``sink(output)`` to run for each compiled call of a hook on ``module``; return
    its key (the first free place on ``module``: the same key as the last block's hook there).
    Thread-safe: blocks opened at once in several threads get distinct keys."""
    # one line (engine.interrupts): an exception at a line event of the body still unlocks
    with _keys_lock: return _claim(module, sink)  # noqa: E701


def _claim(module: nn.Module, sink: Sink) -> int:
    places = _places.setdefault(module, [])
    key = next((k for k in places if k not in _sinks), None)
    if key is None:
        key = _next_key[0]
        _next_key[0] += 1
        places.append(key)
    _sinks[key] = sink
    return key


def close_sink(key: int) -> None:
    """Stop running the sink of ``key`` (again: nothing happens)."""
    _sinks.pop(key, None)


def flat_output(output: Any) -> tuple[list[Tensor | None], int] | None:
    """``(values, kind)`` for an output ``keep`` can pass: a tensor, None, or a tuple or list of
    tensors and ``None`` (a transformer block's ``(hidden, None)``); else None."""
    if output is None or isinstance(output, Tensor):
        return [output], TENSOR
    if type(output) in (tuple, list) and all(v is None or isinstance(v, Tensor) for v in output):
        return list(output), TUPLE if type(output) is tuple else LIST
    return None


def keep(values: list[Tensor | None], kind: int, key: int) -> None:
    """Call ``hookscope::keep``: inside a compiled graph, one opaque ordered operator."""
    _op[0](values, kind, key)
