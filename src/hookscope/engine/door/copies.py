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
open (``open_block``/``close_block``, under a lock), a reducer for ``collections.OrderedDict``
is registered there: a hook table holding hookscope's entries reduces to a plain ``OrderedDict``
of the other entries; every other ``OrderedDict`` reduces as it always does (through the reducer
the user had registered before, if any). hookscope's entries are those whose value is an
``OwnedHook``'s (``hooks.owner``) and those whose key is the id of a handle an open block added
to its ``KeptOut`` for that very table object (the ``*_with_kwargs``/ ``always_called`` tables
map ids to ``True``). The entry is removed when the last block closes, also on an error or an interrupt;
outside blocks ``copyreg`` is untouched.
"""

from __future__ import annotations

import copyreg
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

from hookscope.engine.door.hooks import owner

__all__ = ["KeptOut", "open_block", "close_block"]


class KeptOut:
    """The hook-table entries of one block: the handles in ``handles`` (the block's own list,
    read live: a handle is left out of copies from the moment the block records it) and the
    entries given to ``add_entry``."""

    __slots__ = ("tables", "handles")

    def __init__(self, handles: list[RemovableHandle]) -> None:
        # id(table) -> (the table, ids of the block's entries in it); changed by the block's
        # thread, read by a reducer in any thread (a lookup and set membership: atomic)
        self.tables: dict[int, tuple[Any, set[int]]] = {}
        self.handles = handles

    def add_entry(self, table: Any, key: int) -> None:
        """Leave entry ``key`` of hook table ``table`` out of copies (``sharing.ModuleHooks``
        gives the ``(table, key)`` of entries whose value is not an ``OwnedHook``)."""
        entry = self.tables.get(id(table))
        if entry is None or entry[0] is not table:
            entry = self.tables[id(table)] = (table, set())
        entry[1].add(key)

    def ids_in(self, table: Any) -> set[int]:
        entry = self.tables.get(id(table))
        ids = entry[1] if entry is not None and entry[0] is table else _NONE
        handles = {handle.id for handle in list(self.handles)
                   if any(ref() is table for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref))}
        return ids | handles if handles else ids


_NONE: set[int] = set()
_lock = threading.Lock()
_open: list[KeptOut] = []  # replaced, never changed in place: the reducer reads it without lock
_previous: Callable[[Any], Any] | None = None  # the user's reducer for OrderedDict, if any


def open_block(kept: KeptOut) -> None:
    """A block opens: until ``close_block(kept)``, copies and pickles of hook tables leave the
    entries in ``kept`` out (module docstring). The first open block registers the ``copyreg``
    entry."""
    with _lock:
        _open_block(kept)


def _open_block(kept: KeptOut) -> None:
    """``open_block`` under the lock (a lock's exit is C code: no exception, signal or
    asynchronous, lands between the body and the release)."""
    global _open, _previous
    if not _open:
        _previous = copyreg.dispatch_table.get(OrderedDict)
        copyreg.pickle(OrderedDict, _reduce)
    _open = [*_open, kept]


def close_block(kept: KeptOut) -> None:
    """The block of ``kept`` closes (its hooks are removed); the last one removes the
    ``copyreg`` entry and puts back the user's earlier reducer, unless the user replaced it
    meanwhile."""
    with _lock:
        _close_block(kept)


def _close_block(kept: KeptOut) -> None:
    global _open, _previous
    _open = [other for other in _open if other is not kept]
    kept.tables.clear()
    if not _open:
        if copyreg.dispatch_table.get(OrderedDict) is _reduce:
            if _previous is None:
                del copyreg.dispatch_table[OrderedDict]
            else:
                copyreg.dispatch_table[OrderedDict] = _previous
        _previous = None


def _reduce(table: OrderedDict[Any, Any]) -> Any:
    items = list(table.items())  # one step (C): a block of another thread may change the table
    ours = [ids for kept in _open if (ids := kept.ids_in(table))]
    if not ours and not any(owner(value) is not None for _, value in items):
        return table.__reduce__() if _previous is None else _previous(table)
    kept = [(key, value) for key, value in items
            if owner(value) is None and not any(key in ids for ids in ours)]
    return OrderedDict, (), None, None, iter(kept)
