"""Shared entries: a session's module hooks, registered and removed in bulk, shared between
blocks of several threads.

``ModuleHooks`` writes ``OwnedHook`` entries (``engine.door.hooks``) straight into torch's module
hook tables and pops them on removal; when blocks of several threads hook one module, one entry
hosts the others (its guests), under ``_sharing``. ``locked`` runs a change to the tables under
dynamo's compile lock, so no thread compiles a half-written table.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

from hookscope.engine.compile import graph as compiled
from hookscope.engine.door.hooks import _FILLER, _NOBODY, OwnedHook, _kind, _place, _ready_for_compile, owner

__all__ = ["ModuleHooks", "locked", "hold_calls"]

class ModuleHooks:
    """A session's module hooks, registered and removed in bulk.

    ``add`` writes an ``OwnedHook`` (its bound ``__call__``) straight into its module's hook
    tables, as torch's ``register_forward_(pre_)hook`` does (the same tables, an id from torch's
    ``RemovableHandle`` counter), without a ``RemovableHandle`` per hook; ``remove`` pops every
    entry. For 200 hooks this halves set-up and take-down (``python -m bench.dispatch``).

    Blocks open at once in several threads share entries: a hook joins an entry of the same
    kind (``_kind``) made by a block of another thread, when only other threads' hookscope
    entries come after it (``_join``), instead of adding one (the entry's hook, its host,
    calls it for its thread: ``OwnedHook._guest``), and an entry stays until the last block it
    serves closes. So the tables, and what
    ``torch.compile`` traces from them and guards on, are the same however many threads have
    blocks open: without this, four threads opening blocks on one compiled model hit dynamo's
    recompile limit, and a table changed under another thread's trace broke it
    (``Unsupported``, or dynamo's "Guard failed on the same frame it was created"). Entries are
    written and popped under dynamo's compile lock once ``torch._dynamo`` is loaded: never
    while a trace reads them.

    Args:
        left_out: ``left_out(table, id)`` is called for each entry whose value is not the hook
            (the ``*_with_kwargs`` tables map an id to ``True``) before it is written, and for
            the entries of a host a hook joins: ``copies.KeptOut.add_entry`` leaves them out
            of copies by id.
    """

    __slots__ = ("hosted", "joined", "_left_out")

    def __init__(self, left_out: Callable[[dict[int, Any], int], None] = lambda table, key: None) -> None:
        self.hosted: list[OwnedHook] = []  # hooks whose own entries this session wrote
        self.joined: list[tuple[OwnedHook, OwnedHook]] = []  # (host, hook): hosted by another
        self._left_out = left_out

    def add(self, owned: OwnedHook, *, pre: bool = False, with_kwargs: bool = False) -> None:
        """Register ``owned`` on ``owned.module`` as a forward (``pre``: forward-pre) hook,
        last in its table; ``with_kwargs`` as torch's."""
        locked(self._add, owned, pre, with_kwargs)

    def _add(self, owned: OwnedHook, pre: bool, with_kwargs: bool) -> None:
        module = owned.module
        table = module._forward_pre_hooks if pre else module._forward_hooks
        flags = None
        if with_kwargs:
            flags = module._forward_pre_hooks_with_kwargs if pre else module._forward_hooks_with_kwargs
        keyed = _ready_for_compile() and owned.pick is not None
        if self._join(owned, table, flags, keyed):
            return
        key = RemovableHandle.next_id
        RemovableHandle.next_id = key + 1
        self._host(owned, table, flags, key, keyed)

    def add_forward(self, hooks: list[OwnedHook]) -> None:
        """``add`` each of ``hooks`` as a plain forward hook (no kwargs), in one loop: a
        capture of every module registers one per module."""
        locked(self._add_forward, hooks)

    def _add_forward(self, hooks: list[OwnedHook]) -> None:
        keyed = _ready_for_compile()
        key = RemovableHandle.next_id
        RemovableHandle.next_id = key + len(hooks)  # the ids are taken before any is written
        hosted = self.hosted
        for owned in hooks:
            table = owned.module._forward_hooks
            if table and self._join(owned, table, None, keyed and owned.pick is not None):
                key += 1
                continue
            if keyed:
                self._host(owned, table, None, key, owned.pick is not None)
            else:  # _host inlined, as in remove
                owned.entries = [(table, key)]
                hosted.append(owned)  # recorded before written, as _host
                table[key] = owned.__call__
            key += 1

    def _host(self, owned: OwnedHook, table: dict[int, Any], flags: dict[int, Any] | None,
              key: int, keyed: bool) -> None:
        """Write ``owned``'s own entry ``key`` in ``table`` (and ``flags``), with a compiled
        sink when ``keyed`` (it has a ``pick`` and dynamo is loaded: a process that has not
        loaded it compiles nothing)."""
        idle = _idle_place(owned, table, flags) if keyed else None
        key = key if idle is None else idle.entries[0][1]  # its place, in the order it has there
        # each entry recorded before it is written: an exception between leaves nothing unrecorded
        owned.entries = [(table, key)] if flags is None else [(table, key), (flags, key)]
        self.hosted.append(owned)
        if idle is not None:  # and its keys: freed for open_sink below; the idle hook keeps its
            idle.entries = []  # attributes until replaced (dynamo's guards read them meanwhile)
            for sink in (idle.key, idle.gradient_key):
                if sink is not None:
                    compiled.close_sink(sink)
        if keyed:
            filler = owned.thread == _FILLER  # acts for no call: no sink (OwnedHook.filler)
            kind = _place(owned)  # places per kind: stable keys (open_sink)
            owned.key = compiled.open_sink(owned.module, None if filler else owned.kept, kind)
            if owned.on_gradient is not None:
                owned.gradient_key = compiled.open_sink(
                    owned.module, None if filler else owned.gradient_kept, ("gradient", kind))
        if flags is not None:
            self._left_out(flags, key)  # out of copies before it exists (copies.KeptOut)
            flags[key] = True
        table[key] = owned.__call__  # a bound method: see owner()

    def _join(self, owned: OwnedHook, table: dict[int, Any], flags: dict[int, Any] | None,
              keyed: bool) -> bool:
        """Make ``owned`` a guest of the earliest entry of ``table`` of the same kind (``_kind``,
        with or without a compiled sink as ``keyed`` says), hosting no block of this thread,
        after which only entries of other threads' blocks come (each does nothing for this
        thread's calls, so ``owned`` runs as if last); False when ``owned`` needs an entry of its
        own. The earliest: a thread whose block makes two hooks of one kind (a capture's and a
        steer's witness) joins two entries, not the last one and then a new one."""
        kind = _kind(owned)
        if kind is None:
            return False
        found = None
        # a copy (one step, in C): hooks registered by torch's own calls (handles, other
        # threads' ``register``) change tables outside ``_sharing`` ('OrderedDict mutated
        # during iteration': compare beside a capture in another thread, tests/test_threads_generated)
        filler = owned.thread == _FILLER  # acts for no call: any entry of its kind serves
        for value in reversed(list(table.values())):
            host = owner(value)
            if host is None or (not filler and host.acts_for(owned.thread)):  # a user's, or ours
                break
            if (host.entries and host.module is owned.module and _kind(host) == kind
                    and (host.key is not None) == keyed and (len(host.entries) == 2) == (flags is not None)):
                found = host
        if found is None:
            return False
        self.joined.append((found, owned))  # recorded before written
        if flags is not None:  # left out of this block's copies too (copies.KeptOut)
            self._left_out(*found.entries[1])
        found.guests = [*found.guests, owned]
        if found.key is not None and not filler:  # a filler's place has no sink until now
            compiled.serve(found.key, found.kept)
            if found.gradient_key is not None:
                compiled.serve(found.gradient_key, found.gradient_kept)
        return True

    def remove(self) -> None:
        """Remove every hook added (again: nothing happens); an entry another thread's open
        block still uses stays, until that block closes."""
        locked(self._remove)

    def _remove(self) -> None:
        for host, guest in self.joined:
            host.guests = [other for other in host.guests if other is not guest]
            _release(host)
        for owned in self.hosted:
            owned.thread = _NOBODY  # its block is over: no call is its own now
        for owned in self.hosted:
            if owned.guests:
                continue
            if owned.key is not None:
                _release(owned)
            else:  # _release inlined: a block of every module removes hundreds
                for table, key in owned.entries:
                    table.pop(key, None)
        self.hosted.clear()
        self.joined.clear()


_sharing = threading.RLock()  # entries shared between blocks of several threads (ModuleHooks)

def _release(host: OwnedHook) -> None:
    """Pop ``host``'s entries and close its sinks once no open block uses them.

    An entry with a compiled sink stays, idle (``compiled.idle_sink``: its operator hands
    nothing out), while an open block still uses another hookscope entry of its module, and
    goes with the last of them (``_sweep``): the entries of a module then keep their order and
    keys while blocks of several threads, of different verbs, open and close around each other.
    Popped and written again, a capture's entry came back after a steer's in one block and
    before it in the next, and every such order, count and key was a graph of its own: threads
    running a capture, a steer, a patch and an ablation on one ``torch.compile(fullgraph=True)``
    model reached dynamo's recompile limit, after which even a plain call raised (issue 47)."""
    if _active(host):
        return
    if host.key is not None and _busy(host.module):
        for sink in (host.key, host.gradient_key):
            if sink is not None:
                compiled.idle_sink(sink)
        return
    _pop(host)
    _sweep(host.module)


def _active(host: OwnedHook) -> bool:
    """Whether an open block uses ``host``'s entry (its own, a filler's, a guest's)."""
    return host.thread != _NOBODY or bool(host.guests)


def _pop(host: OwnedHook) -> None:
    """Pop ``host``'s entries and close its sinks."""
    for table, key in host.entries:
        table.pop(key, None)
    for sink in (host.key, host.gradient_key):
        if sink is not None:
            compiled.close_sink(sink)
    host.key = host.gradient_key = None


def _hosts(module: Any) -> list[OwnedHook]:
    """The hookscope hosts of ``module``'s forward and forward-pre hook tables (a copy of each
    table, one step in C: other threads' ``register`` change them outside ``_sharing``)."""
    values = [*list(module._forward_hooks.values()), *list(module._forward_pre_hooks.values())]
    return [host for host in map(owner, values) if host is not None]


def _busy(module: Any) -> bool:
    """Whether an open block uses an entry with a compiled sink that a ``ModuleHooks`` wrote on
    ``module`` (not a hook ``hooks.register`` wrote, which its block removes by its handle)."""
    return any(host.key is not None and host.entries and _active(host) for host in _hosts(module))


def _idle_place(owned: OwnedHook, table: dict[int, Any], flags: dict[int, Any] | None) -> OwnedHook | None:
    """An idle entry of ``table`` (``_release``) of ``owned``'s place (``_place``: what it does in
    a graph) that ``owned`` can take over, its key and order kept: one after which no entry of
    ``owned``'s thread comes (``owned`` runs after that thread's hooks, as if last)."""
    place, found = _place(owned), None
    for value in reversed(list(table.values())):
        host = owner(value)
        if host is None or (owned.thread != _FILLER and host.acts_for(owned.thread)):
            break
        if (host.key is not None and not _active(host) and host.module is owned.module
                and len(host.entries) == (1 if flags is None else 2) and _place(host) == place):
            found = host
    return found


def _sweep(module: Any) -> None:
    """Pop the idle entries ``_release`` left on ``module`` once no open block uses any."""
    hosts = [host for host in _hosts(module) if host.key is not None and host.entries]
    if any(_active(host) for host in hosts):
        return
    for host in hosts:
        _pop(host)


def locked(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` under ``_sharing`` and, once ``torch._dynamo`` is loaded, dynamo's
    compile lock (both reentrant), so no trace (another thread's) reads a hook table while it
    changes: sessions register and remove a block's hooks under it."""
    # half made while another thread imports it (no trace runs before it is whole): ours alone
    lock = getattr(sys.modules.get("torch._dynamo.convert_frame"), "compile_lock", _sharing)
    with _sharing, lock:
        return function(*args)




class _HoldHook(OwnedHook):
    """A hook of a compile wrapper that runs ``function`` for every thread's call (see
    ``hold_calls``)."""

    __slots__ = ()

    def __call__(self, module: Any, *args: Any) -> Any:
        return self.function(module, *args)


_holds: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


class _Held:
    """What ``hold_calls`` returns: ``remove()`` ends the block's use of the pair (again:
    nothing); ``id``, ``hooks_dict_ref`` and ``extra_dict_ref`` name its entries as a torch
    ``RemovableHandle`` does (``copies.KeptOut`` leaves them out of copies)."""

    __slots__ = ("wrapper", "id", "hooks_dict_ref", "extra_dict_ref")

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.id: int | None = None  # set when the block's use is counted (``_hold``)
        self.hooks_dict_ref = weakref.ref(wrapper._forward_pre_hooks)
        self.extra_dict_ref = (weakref.ref(wrapper._forward_hooks),
                               weakref.ref(wrapper._forward_hooks_always_called))

    def remove(self) -> None:
        wrapper, self.wrapper = self.wrapper, None
        if wrapper is not None and self.id is not None:
            compiled.abandon(wrapper)  # a call of this thread interrupted before its release
            locked(_unhold, wrapper)


def hold_calls(wrapper: Any, record: Callable[[Any], object]) -> None:
    """Around each call of the ``torch.compile`` wrapper ``wrapper``, in any thread, hold what
    its graph hands to sinks and hand it out, in traced order, when the call returns
    (``compiled.hold``/``release``): one pair of entries per wrapper, written when the first
    block on it opens and popped when the last closes (the returned object's ``remove``), first
    in its tables, before the hooks a block adds to the wrapper later (a function watch's).

    One pair for all blocks, not one per block: a block's own pair, written with torch's
    ``register_forward_pre_hook`` while another thread called the wrapper, broke that call
    ('OrderedDict mutated during iteration', threads running different verbs at once).

    ``record`` gets the block's handle before its use is counted (as ``register``'s ``record``:
    an exception between the two cannot lose the handle)."""
    held = _Held(wrapper)
    record(held)
    locked(_hold, wrapper, held)


def _hold(wrapper: Any, held: _Held) -> None:
    entry = _holds.get(wrapper)
    if entry is not None:
        entry[0] += 1
        held.id = int(entry[1])
        return
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    before = _HoldHook(lambda module, args: _enter_call(module), wrapper)
    after = _HoldHook(lambda module, args, output: compiled.release(module), wrapper)
    _holds[wrapper] = [1, key]  # recorded before written
    wrapper._forward_pre_hooks[key] = before.__call__
    wrapper._forward_hooks_always_called[key] = True
    wrapper._forward_hooks[key] = after.__call__
    held.id = key


def _enter_call(wrapper: Any) -> None:
    compiled.abandon(wrapper)  # an interrupted call's hold (a KeyboardInterrupt skips release)
    compiled.hold(wrapper)


def _unhold(wrapper: Any) -> None:
    entry = _holds.get(wrapper)
    if entry is None:
        return
    entry[0] -= 1
    if entry[0] > 0:
        return
    del _holds[wrapper]
    key = entry[1]
    wrapper._forward_pre_hooks.pop(key, None)
    wrapper._forward_hooks.pop(key, None)
    wrapper._forward_hooks_always_called.pop(key, None)
