"""Private: the life cycle that every hookscope block adding hooks shares.

``capture``, the edits and ``stats`` all: resolve patterns before anything is registered, add
their hooks plus *witness* pre-hooks (which tell, afterwards, why a selected module did not run),
remove every hook on exit whatever happened, add a note naming the module where a forward pass
broke, and report selected modules whose hooks never fired. ``HookSession`` does this once;
subclasses only add their own hooks (``_register``, through ``_hook``) and say what a silent
module costs (``_unfired_consequence``).

Every hook is an ``OwnedHook`` (``engine.door.hooks``): it acts only for this session's module
objects (not a ``deepcopy`` made inside the block), in the thread that entered the block, and not
for the forward that activation checkpointing re-runs during backward (counted in
``recomputes``; edits apply to it too, so the recompute equals the real forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, Self

from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope.engine import diagnose, interrupts
from hookscope.engine.door import copies
from hookscope.engine.door.hooks import OwnedHook, kind_of_hook, nothing, other_threads
from hookscope.engine.door.sharing import ModuleHooks, hold_calls, locked
from hookscope.engine.door.tables import on_node
from hookscope.engine.early_stop import (
    SKIPPED_BY_STOP,
    EarlyStop,
    StopForward,
    forward_boundary,
    stopped_by,
    stops,
)
from hookscope.engine.function_hooks import FunctionHooks
from hookscope.engine.naming.function_names import refuse_uninterceptable
from hookscope.engine.naming.names import ModuleIndex, index
from hookscope.engine.naming.selection import Target, resolve, unwrap
from hookscope.errors import (
    ArgumentValueError,
    EditError,
    HookNeverFiredError,
    HookNeverFiredWarning,
    HookscopeError,
    warn,
)

__all__ = ["HookSession", "Observer", "OnUnfired", "resolve_checked", "resolve_each"]

OnUnfired = Literal["warn", "error", "ignore"]


_LOST = ("an interrupt removed this block's hooks while it was entered, and its "
         "KeyboardInterrupt was lost on the way")


class HookSession:
    """A ``with`` block that owns hooks on selected modules of ``model``.

    Attributes:
        model: the root module given.
        targets: the selected targets, ``named_modules()`` order.
        unfired: ``{record name: reason}`` for selected modules that never ran (set on exit).
        unmatched: the function addresses (``path::fn``, ``::fn#k``) among ``unfired`` whose
            module ran but never made that call: they match nothing in this model (set on exit;
            the CLI makes them a usage error).

    Raises:
        SelectorError: at construction, when a pattern matches nothing or names a container.
        HookscopeError: at construction, for TorchScript or a bad ``on_unfired``; on entering
            twice.
        HookNeverFiredError: on exit with ``on_unfired="error"`` when a selected module never ran.
    """

    _unfired_consequence = "nothing was recorded"
    _explain_unfired = True  # find out why silent modules did not run, even when not reporting it
    _edits = False  # its hooks' returns replace what they hook (a compiled graph routes such calls)

    def __init__(self, model: nn.Module, patterns: Sequence[str], on_unfired: OnUnfired, *,
                 targets: Sequence[Target] | None = None, names: ModuleIndex | None = None):
        """``patterns`` are resolved here unless the caller passes ``targets`` it resolved
        itself (``resolve_checked``), with the ``names`` index it resolved them on; the session
        hands that one index to the witnesses, the unfired report and the error note."""
        if on_unfired not in ("warn", "error", "ignore"):
            raise ArgumentValueError(f"on_unfired={on_unfired!r} is not one of 'warn', 'error', 'ignore'")
        self.model = model
        if targets is None:
            targets, names = resolve_checked(model, patterns)
        self.targets = list(targets)
        self._names = names  # built on first use when the caller resolved without one
        for target in self.targets:
            if target.op is not None:  # before anything runs: calls there cannot be seen
                refuse_uninterceptable(model, target.key)
                refuse_uninterceptable(target.module, target.key)
        # serves targets that address a function call (in the compiled graph of a wrapper)
        self._functions = FunctionHooks(diagnose.compile_wrapper(model))
        self.unfired: dict[str, str] = {}
        self.unmatched: set[str] = set()
        self._on_unfired = on_unfired
        self._handles: list[RemovableHandle] = []  # function and autograd node hooks
        self._owned: list[tuple[OwnedHook, bool]] = []  # (hook, is a forward hook)
        self._layout: list[tuple[OwnedHook, bool, bool]] = []  # (hook, pre, with_kwargs)
        self._ran: set[str] = set()  # paths of selected modules and witnesses that ran
        self._stopper: EarlyStop | None = None  # set by _register for early_stop=True
        self._stops_before = 0  # forwards of this model cut short before the block began
        self._active = False  # hooks registered (until removed, also by an interrupt)
        self._entered = False  # __enter__ completed and __exit__ not yet called
        self._left_out = copies.KeptOut(self._handles)  # this block's hooks, left out of copies
        self._module_hooks = ModuleHooks(self._left_out.add_entry)
        self._copies_open = False  # whether copies.open_block(self._left_out) is in force

    def __enter__(self) -> Self:
        if self._active:
            raise HookscopeError(f"this {type(self).__name__} is already active: enter it once, "
                                 f"and build a new one for another block")
        # an exception anywhere in entering (an interrupt, a user's callback) leaves nothing
        # registered: _open writes down each thing before doing it, _remove undoes what is there
        self._before_entry()  # refusals, before anything is registered
        try:
            self._open()
            interrupts.release_signals()  # a signal held back so far: a failed entry
            return self  # in the try: an exception after the last call still undoes the entry
        except BaseException:
            self._entered = False  # a failed entry is no block: leaving it reports nothing
            try:
                self._remove()
            finally:
                interrupts.release_signals()  # one held back while the entry was undone
            raise

    def _before_entry(self) -> None:
        """Refuse, on entry and before anything is registered, what the block cannot do
        (subclasses; an override, not an ``__enter__`` of their own: ``__enter__`` alone
        returns the entered block, so nothing runs between its return and the ``with``)."""

    def _open(self) -> None:
        interrupts.guard(self)  # signals wait during entry and exit; _remove unguards
        self._active = True
        self._stops_before = stops(unwrap(self.model)[0])
        self._copies_open = True  # first: an exception inside open_block still closes it
        copies.open_block(self._left_out)
        locked(self._install)
        if diagnose.fullgraph(self.model):
            self._refuse_outside_graph()
        self._entered = True

    def _install(self) -> None:
        """Register every hook of the block, at once for traces in other threads
        (``sharing.locked``: a thread calling a compiled model meanwhile compiled a graph per
        half-registered table, up to dynamo's recompile limit)."""
        self._hold_compiled_values()
        self._register()
        padded = diagnose.fullgraph(self.model) and self._pad_for_compile()
        self._functions.install(self._handles)
        if self._explain_unfired:  # witnesses serve only the explanation on exit
            near = diagnose.witnesses(self.model, self._module_index(), self.targets)
            if padded:  # on every module, the selected ones too: the tables stay as they are
                near = {**self._each_module(), **near}
            for path, module in near.items():
                # a compiled graph holds a witness whole (engine.compile.graph)
                self._own(OwnedHook(self._witness(path), module, pick=nothing), pre=True)

    def _pad_for_compile(self) -> bool:
        """On a ``torch.compile(fullgraph=True)`` model: give every module this block does not
        select hooks of the kinds each selected module got (``OwnedHook.filler``: they act for
        no call), so the hook tables dynamo guards are the same whichever modules a block
        selects: a sweep over any number of layers, one block each, compiles one graph for
        them all (per kind of hook: a capture's, an edit's), never one per layer up to dynamo's
        recompile limit, after which even a plain call of a fullgraph model raised (issue 47).
        Every module then also gets a witness (``_install``). Return whether it padded: not
        when every module is selected (nothing to pad: a capture of every module pays for no
        witness on each), nor when the selected modules got hooks of different kinds (a block
        of several rules on one module), which stays as it was.

        The graph then holds an operator per module (a filler's hands nothing out: a capture's
        copies nothing; an edit's copies the module's output, as its operator must return
        tensors of its own), on every call while a block is open."""
        selected = {id(t.module) for t in self.targets if t.op is None}
        per_module: dict[int, list[tuple[OwnedHook, bool, bool]]] = {}
        for owned, pre, with_kwargs in self._layout:
            if id(owned.module) in selected:
                per_module.setdefault(id(owned.module), []).append((owned, pre, with_kwargs))
        shapes = {tuple((kind_of_hook(o), pre, kw) for o, pre, kw in hooks) for hooks in per_module.values()}
        if not per_module or len(per_module) != len(selected) or len(shapes) != 1 or any(
                kind is None for kind, _, _ in next(iter(shapes))):
            return False
        template = next(iter(per_module.values()))
        others = [module for module in self._each_module().values() if id(module) not in selected]
        for module in others:
            for owned, pre, with_kwargs in template:
                self._module_hooks.add(owned.filler(module), pre=pre, with_kwargs=with_kwargs)
        return bool(others)

    def _each_module(self) -> dict[str, nn.Module]:
        """``{path: module}`` of the model's modules, each once."""
        found: dict[int, tuple[str, nn.Module]] = {}
        for path, module in self._module_index().modules.items():
            found.setdefault(id(module), (path, module))
        return dict(found.values())

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hold_compiled_values(self) -> None:
        """On a ``torch.compile`` wrapper: around each of this thread's calls, hold what the
        compiled graph hands to this block's hooks and hand it out in the order the forward
        made it (``compiled.hold``), before any hook the block adds to the wrapper later
        runs (a function watch's ``_leave_call``)."""
        wrapper = diagnose.compile_wrapper(self.model)
        if wrapper is not None:  # one pair per wrapper, shared by every thread's blocks
            hold_calls(wrapper, self._handles.append)

    def _refuse_outside_graph(self) -> None:
        """Refuse, on entry, a block on a ``torch.compile(fullgraph=True)`` model with a hook
        that runs outside the graph (no ``pick``: ``engine.door.hooks._untraced``), which splits it:
        a full graph cannot split, and torch would raise its own ``Unsupported`` at the call
        (verbs that refuse an option first, as ``capture(grads=True)``, say which).

        Raises:
            HookscopeError: naming the module and the fixes."""
        outside = next((h for h, _ in self._owned if h.pick is None and not h.traceable), None)
        if outside is not None:
            raise HookscopeError(
                f"{type(self).__name__.strip('_').removesuffix('Session').lower()} runs a hook on "
                f"{type(outside.module).__name__} outside the "
                f"compiled graph, and a torch.compile(model, fullgraph=True) model cannot split "
                f"its graph there. Use the eager model (compiled._orig_mod), or compile with "
                f"fullgraph=False (the hook then splits the graph, and values equal eager)")

    @interrupts.never_skipped(lambda block: block._active and block._remove(),  # exit cut short
                              is_open=lambda block: block._active)  # a refused re-entry
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        # as __enter__: an exception anywhere in leaving still removes every hook; a second
        # exit (a caller's cleanup after its own failure) does nothing
        try:
            return self._close(exc)
        except BaseException:
            self._remove()
            raise
        finally:
            interrupts.release_signals()  # a signal held back during the exit surfaces here

    def _close(self, exc: BaseException | None) -> bool | None:
        entered, self._entered = self._entered, False
        # hooks gone before exit: an interrupt at the end of __enter__ removed them, and its
        # KeyboardInterrupt was swallowed (raised inside a gc callback, as hypothesis installs,
        # or a __del__), so the block ran unhooked: deliver the interrupt here
        lost = entered and not self._active and exc is None
        self._remove()
        if not entered:  # never entered, or left already: nothing to report twice
            return None
        if lost:
            raise KeyboardInterrupt(_LOST)
        self._finish()
        stopped = stopped_by(exc, self._stopper)  # our early stop: the block ends cleanly
        if exc is not None and not stopped:
            if not isinstance(exc, StopForward):  # another block's stop is no error
                diagnose.locate_error(self._module_index(), exc)
                self._functions.explain(exc)
            return None
        if not self._explain_unfired:
            return True if stopped else None
        ran = self._ran_paths()
        called = self._functions.called
        # A wide address ('h.*::softmax', '**::relu') matches modules that make no such call;
        # they are not reported as long as one module it matched made it.
        made = {t.op for t in self.targets if t.op and t.wide and t.key in called}
        silent = [t for t in self.targets if (t.key not in called and not (t.wide and t.op in made)
                                              if t.op else t.path not in ran)]
        if silent and stops(unwrap(self.model)[0]) > self._stops_before:
            self.unfired = {t.key: SKIPPED_BY_STOP for t in silent}  # not their fault: no report
            return True if stopped else None
        inside = {t.key: why for t in silent if t.op
                  and (why := self._functions.unfired(t.key, t.path)) is not None}
        refused = {key: why for key, why in inside.items() if self._functions.refuses(key)}
        if refused:  # an address that can never record: refused, whatever on_unfired says
            raise HookscopeError("\n".join(f"{key}: {why}" for key, why in refused.items()))
        self.unfired = diagnose.explain_unfired(self._module_index(),
                                                [t for t in silent if t.key not in inside], ran)
        self.unfired.update(inside)
        self.unmatched = set(inside)
        self.unfired.update(self._other_threads(silent))
        if self._edits and self._on_unfired == "warn":
            self._refuse_bypassed([t for t in silent if not t.op], ran)
        self._report_unfired()
        return True if stopped else None

    def _refuse_bypassed(self, silent: Sequence[Target], ran: set[str]) -> None:
        """Raise when an edit never applied because its module ran without its hooks
        (``diagnose.bypassed``): the model's output is then the unedited one, and a served
        model must never return it as edited (issue 46). A module the input never reached
        is only reported (``on_unfired``).

        Raises:
            EditError: naming each such module, the cause and the fix."""
        found = diagnose.bypassed(self._module_index(), silent, ran)
        if found:
            lines = "\n".join(f"  - {key}: {why}" for key, why in found.items())
            raise EditError(
                f"the model ran, but {len(found)} selected module{'s' if len(found) > 1 else ''} "
                f"ran without {'their' if len(found) > 1 else 'its'} hooks, so the edit was never "
                f"applied there and the output is the unedited model's:\n{lines}\n(pass "
                f"on_unfired='ignore' to accept an edit that did not apply)")

    def _register(self) -> None:
        """Add this session's hooks (``self._own``, ``self._hook``; a handle straight into
        ``self._handles`` on the line that makes it, so no exception comes between); mark a
        selected module that runs by adding its path to ``self._ran``."""
        raise NotImplementedError

    def forward_boundary(self) -> AbstractContextManager[None]:
        """Wrap one forward pass of a loop that keeps this session open across passes
        (``stats``, ``extract``): this session's early stop ends the pass there, and the loop
        goes on; a block that runs one pass needs nothing (``__exit__`` catches the stop)."""
        return forward_boundary(self._stopper)

    def _stop_early(self) -> None:
        """Cut each forward short once every selected module has returned (``early_stop``);
        call at the end of ``_register``, so the stop runs after this session's hooks."""
        root, _ = unwrap(self.model)
        self._stopper = EarlyStop(root, (t.module for t in self.targets))
        self._stopper.register(self._handles.append)

    def _finish(self) -> None:
        """Run after every hook is removed, before the unfired report."""

    def _ran_paths(self) -> set[str]:
        """Paths of the selected modules and witnesses that ran."""
        return self._ran

    def _module_index(self) -> ModuleIndex:
        """The model's ``ModuleIndex``: the one the targets were resolved on, else built once."""
        if self._names is None:
            self._names = index(self.model)
        return self._names

    @property
    def functions(self) -> FunctionHooks:
        """The function-call hooks this session installs on entry and removes on exit: watch
        more calls with ``functions.watch(module, on_call, ...)`` before entering."""
        return self._functions

    def hook_grad_node(self, node: Any, function: Callable[[tuple[Any, ...], tuple[Any, ...]], Any]
                       ) -> None:
        """Run ``function(grad_inputs, grad_outputs)`` after autograd node ``node`` (a
        ``grad_fn`` made by this block's forward) computes its gradients, until the block exits
        (``tables.on_node``). Call it inside the block, in the thread that entered it.

        Raises:
            HookscopeError: the session is not active (the hook would never be removed).
            KeyboardInterrupt: an interrupt removed the block's hooks and its own
                KeyboardInterrupt was lost (dropped in a gc callback).
        """
        if self._entered and not self._active:  # an interrupt removed the hooks (see _close)
            raise KeyboardInterrupt(_LOST)
        if not self._active:
            raise HookscopeError("hook_grad_node adds a hook until the block exits: call it "
                                 "inside the `with` block of this session")
        self._handles.append(on_node(node, function))  # recorded as made

    def _hook(self, module: nn.Module, function: Hook, *, pre: bool = False, with_kwargs: bool = False,
              in_recompute: bool = False) -> None:
        """Register ``function`` on ``module`` as this session's forward (``pre``: forward-pre)
        hook, wrapped in an ``OwnedHook``; ``in_recompute`` also runs it when activation
        checkpointing re-runs the forward during backward (edits)."""
        self._own(OwnedHook(function, module, in_recompute=in_recompute), pre=pre,
                  with_kwargs=with_kwargs)

    def _own(self, owned: OwnedHook, *, pre: bool = False, with_kwargs: bool = False) -> None:
        """Register ``owned`` (an ``OwnedHook``, or a subclass with its own fast ``__call__``)
        on its module as this session's hook. Its table entry is left out of copies by its
        value (``copies._reduce``), a ``with_kwargs`` flag by its id (``ModuleHooks``)."""
        self._module_hooks.add(owned, pre=pre, with_kwargs=with_kwargs)
        self._owned.append((owned, not pre))
        self._layout.append((owned, pre, with_kwargs))

    def _own_forward(self, hooks: list[OwnedHook]) -> None:
        """``_own`` for many plain forward hooks (no kwargs) at once, registered in bulk."""
        self._module_hooks.add_forward(hooks)
        self._owned.extend((owned, True) for owned in hooks)
        self._layout.extend((owned, False, False) for owned in hooks)

    @property
    def recomputes(self) -> dict[str, int]:
        """``{record name: forwards re-run during backward}`` (activation checkpointing); these
        are never counted as calls."""
        return {t.key: max((h.recomputes for h, forward in self._owned
                            if forward and h.module is t.module), default=0) for t in self.targets}

    def _other_threads(self, silent: Sequence[Target]) -> dict[str, str]:
        """Reasons for silent targets that ran only in threads other than this block's."""
        found = {}
        for target in silent:
            calls = max((h.foreign_calls for h, _ in self._owned if h.module is target.module), default=0)
            if calls:
                found[target.key] = other_threads(target.path, calls)
        return found

    def _hook_output(self, target: Target, hook: Hook, *, with_kwargs: bool = False,
                     in_recompute: bool = False) -> None:
        """Run ``hook(module, args, [kwargs,] output)`` after each call of ``target``: a forward
        hook on its module, or, for a function-level target (``target.op``), after each call of
        that function in the module's own forward, with the function's arguments and output.
        Either way a non-``None`` return replaces the output."""
        if target.op is None:
            self._hook(target.module, hook, with_kwargs=with_kwargs, in_recompute=in_recompute)
        else:
            self._functions.add(target.key, target.module, target.op, hook, with_kwargs=with_kwargs,
                                in_recompute=in_recompute, edits=self._edits)

    def _remove(self) -> None:
        """Remove everything the block added (idempotent: each step undoes what is there, so
        a pass that an exception stopped is completed by running it again, here at once)."""
        try:
            self._remove_once()
        except BaseException:
            self._remove_once()
            raise

    def _remove_once(self) -> None:
        self._module_hooks.remove()
        locked(self._remove_handles)
        self._functions.close()
        if self._copies_open:  # cleared once closed: close_block is idempotent, may rerun
            copies.close_block(self._left_out)
            self._copies_open = False
        self._active = False
        interrupts.unguard(self)

    def _witness(self, path: str) -> Callable[..., None]:
        ran = self._ran

        def hook(module: nn.Module, args: Any) -> None:
            ran.add(path)
        return hook

    def _report_unfired(self) -> None:
        if not self.unfired or self._on_unfired == "ignore":
            return
        wide = {t.key for t in self.targets if t.wide}
        if wide <= set(self.unfired):  # no glob member ran: the globs found nothing, say why
            wide = set()
        message = diagnose.unfired_message(self.unfired, wide, self._unfired_consequence,
                                           detailed=self._on_unfired == "error")
        if self._on_unfired == "error":
            raise HookNeverFiredError(message + "\n(what the modules that ran did is in err.capture)",
                                      capture=self, unfired=self.unfired)
        warn(message + "\n(pass on_unfired='error' (--on-unfired error) to make this an "
                      "error, 'ignore' to silence it)", HookNeverFiredWarning)


Hook = Callable[..., Any]


def resolve_checked(model: nn.Module, patterns: Sequence[str],
                    names: ModuleIndex | None = None) -> tuple[list[Target], ModuleIndex]:
    """``select.resolve`` after refusing models that cannot be hooked (TorchScript), then the
    checks on what was selected (``diagnose.check_targets``).

    Returns:
        ``(targets, names)``: the targets (as ``resolve``) and the ``ModuleIndex`` they were
        resolved on (``names`` when given, else built once here), for the session.

    Raises:
        SelectorError, HookscopeError: as ``resolve`` and ``diagnose.check_targets``.
    """
    each, names = resolve_each(model, [list(patterns)], names)
    return each[0], names


def resolve_each(model: nn.Module, groups: Sequence[Sequence[str]],
                 names: ModuleIndex | None = None) -> tuple[list[list[Target]], ModuleIndex]:
    """``resolve_checked`` for several groups of patterns on one index (an ``Edit`` resolves
    each pattern on its own): ``([targets of group 0, ...], names)``. No group is fine (a no-op
    edit): the model is still refused when it cannot be hooked."""
    diagnose.preflight(model)
    names = index(model) if names is None else names
    resolved = [resolve(model, list(group), names=names) for group in groups]
    diagnose.check_targets(names, [t for targets in resolved for t in targets])
    return resolved, names


class Observer(HookSession):
    """An observe-only session: hooks that read what runs and record nothing of their own
    (``compare``, ``tree``, ``find_nonfinite``), with the same life cycle as a capture.

    Args:
        model: the root module (wrappers are the caller's business: pass the module to hook).
        targets: resolved targets (``select.resolve``), or modules straight from
            ``named_modules()`` wrapped as ``Target(path, module)``.
        forward: ``forward(target) -> hook(module, args, [kwargs,] output)``, or an
            ``OwnedHook`` on ``target.module`` registered as it is (with a ``pick``: a compiled
            graph holds it, ``engine.compile.graph``), or None.
        pre: ``pre(target) -> hook(module, args, [kwargs])``, or None.
        with_kwargs: the hooks also take the call's keyword arguments.
        on_unfired: as ``capture``; default ``"ignore"``: ``unfired`` is still filled in on exit
            (with each cause) for the caller to report.
        explain_unfired: False skips the witness hooks and leaves ``unfired`` empty (``tree``
            and ``find_nonfinite`` hook every module and report silent ones themselves).
        names: the ``ModuleIndex`` the targets were resolved on (``resolve_checked``); None:
            built when first needed.
    """

    _unfired_consequence = "nothing was observed there"

    def __init__(self, model: nn.Module, targets: Sequence[Target], *,
                 forward: Callable[[Target], Hook] | None = None,
                 pre: Callable[[Target], Hook] | None = None, with_kwargs: bool = False,
                 on_unfired: OnUnfired = "ignore", explain_unfired: bool = True,
                 names: ModuleIndex | None = None):
        super().__init__(model, (), on_unfired, targets=targets, names=names)
        self._forward, self._pre, self._with_kwargs = forward, pre, with_kwargs
        self._explain_unfired = explain_unfired

    def _register(self) -> None:
        for target in self.targets:
            module = target.module
            if self._pre is not None and target.op is None:
                self._hook(module, self._marked(target, self._pre(target)), pre=True,
                           with_kwargs=self._with_kwargs)
            if self._forward is not None:
                hook = self._forward(target)
                if isinstance(hook, OwnedHook):  # made whole by the caller (engine.compile.graph)
                    hook.function = self._marked(target, hook.function)
                    self._own(hook)
                else:
                    self._hook_output(target, self._marked(target, hook), with_kwargs=self._with_kwargs)

    def _marked(self, target: Target, hook: Hook) -> Hook:
        """``hook``, also noting that the target ran when unfired modules are explained."""
        if not self._explain_unfired:
            return hook
        ran, path = self._ran, target.path

        def marked(*args: Any) -> Any:
            ran.add(path)
            return hook(*args)
        return marked
