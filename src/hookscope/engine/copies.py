"""Private: a copy or a checkpoint of a model carries nothing of hookscope.

What a user sees: ``copy.deepcopy(model)`` (an EMA or teacher copy), ``pickle.dumps(model)`` and
``torch.save(model)`` made inside any hookscope block give a model whose hook tables
(``_forward_hooks``, ``_forward_pre_hooks``, the ``*_with_kwargs`` and ``always_called`` tables,
backward tables) hold the user's own hooks and none of hookscope's, so the copy computes what the
model computes without hookscope, a checkpoint loads where hookscope is not installed, and a hook
that is a local function (a ``::relu`` address) never makes ``torch.save`` fail.

Why this way: torch has no per-hook way to stay out of a copy (``nn.Module.__getstate__`` copies
``__dict__``, hook tables included), and both ``copy.deepcopy`` and pickle's ``Pickler`` (also
torch.save's ``PyTorchPickler``, which sets no ``dispatch_table`` of its own) look up
``copyreg.dispatch_table`` for the exact type of each object. So while at least one block is
open (``open_block``/``close_block``, a count under a lock), a reducer for
``collections.OrderedDict`` is registered there: a hook table holding hookscope's entries
reduces to a plain ``OrderedDict`` of the other entries; every other ``OrderedDict`` reduces as
it always does (through the reducer the user had registered before, if any). hookscope's entries
are those whose value is an ``OwnedHook`` and those whose key is the id of a handle given to
``keep_out``, for that very table object (the ``*_with_kwargs``/``always_called`` tables map ids
to ``True``). The entry is removed when the last block closes, also on an error or an interrupt;
outside blocks ``copyreg`` is untouched.
"""

from __future__ import annotations

import copyreg
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.hooks import RemovableHandle

from hookscope.engine.hooks import OwnedHook

__all__ = ["open_block", "close_block", "keep_out", "let_in"]

_lock = threading.Lock()
_open_blocks = 0
_previous: Callable[[Any], Any] | None = None  # the user's reducer for OrderedDict, if any
# id(table) -> (the table, handle ids hookscope registered in it); changed under the lock, one
# atomic item assignment at a time, so the reducer reads it without the lock
_kept_out: dict[int, tuple[weakref.ref[Any], frozenset[int]]] = {}


def open_block() -> None:
    """A block opens: from now until its ``close_block``, copies and pickles of hook tables leave
    hookscope's entries out (module docstring). The first open block registers the ``copyreg``
    entry."""
    global _open_blocks, _previous
    with _lock:
        if _open_blocks == 0:
            _previous = copyreg.dispatch_table.get(OrderedDict)
            copyreg.pickle(OrderedDict, _reduce)
        _open_blocks += 1


def close_block() -> None:
    """A block opened by ``open_block`` closes; the last one removes the ``copyreg`` entry (and
    puts back the user's earlier reducer), unless the user replaced it meanwhile."""
    global _open_blocks, _previous
    with _lock:
        _open_blocks -= 1
        if _open_blocks == 0:
            if copyreg.dispatch_table.get(OrderedDict) is _reduce:
                if _previous is None:
                    del copyreg.dispatch_table[OrderedDict]
                else:
                    copyreg.dispatch_table[OrderedDict] = _previous
            _previous = None


def keep_out(handle: RemovableHandle) -> None:
    """Leave the entries of ``handle`` (in each table it was registered in) out of copies."""
    with _lock:
        for table in _tables(handle):
            ref, ids = _kept_out.get(id(table), (None, frozenset()))
            if ref is None or ref() is not table:  # an id reused by a new table
                ref, ids = weakref.ref(table), frozenset()
            _kept_out[id(table)] = (ref, ids | {handle.id})


def let_in(handle: RemovableHandle) -> None:
    """Forget ``handle`` (removed: its id is in no table any more)."""
    with _lock:
        for table in _tables(handle):
            ref, ids = _kept_out.get(id(table), (None, frozenset()))
            if ref is not None and ref() is table:
                if ids - {handle.id}:
                    _kept_out[id(table)] = (ref, ids - {handle.id})
                else:
                    del _kept_out[id(table)]


def _tables(handle: RemovableHandle) -> Iterator[Any]:
    for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
        table = ref()
        if table is not None:
            yield table


def _reduce(table: OrderedDict[Any, Any]) -> Any:
    entry = _kept_out.get(id(table))
    ours = entry[1] if entry is not None and entry[0]() is table else frozenset()
    if not ours and not any(isinstance(value, OwnedHook) for value in table.values()):
        return table.__reduce__() if _previous is None else _previous(table)
    kept = [(key, value) for key, value in table.items()
            if key not in ours and not isinstance(value, OwnedHook)]
    return OrderedDict, (), None, None, iter(kept)
