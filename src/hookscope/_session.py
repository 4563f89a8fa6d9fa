"""Private: the life cycle that every hookscope block adding hooks shares.

``capture``, the edits and ``stats`` all: resolve patterns before anything is registered, add
their hooks plus *witness* pre-hooks (which tell, afterwards, why a selected module did not run),
remove every hook on exit whatever happened, add a note naming the module where a forward pass
broke, and report selected modules whose hooks never fired. ``HookSession`` does this once;
subclasses only add their own hooks (``_register``) and say what a silent module costs
(``_unfired_consequence``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal

from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope import diagnose
from hookscope._early_stop import SKIPPED_BY_STOP, EarlyStop, StopForward, stopped_by, stops
from hookscope.errors import HookNeverFiredError, HookNeverFiredWarning, HookscopeError
from hookscope.select import Target, resolve, unwrap

OnUnfired = Literal["warn", "error", "ignore"]


class HookSession:
    """A ``with`` block that owns hooks on selected modules of ``model``.

    Attributes:
        model: the root module given.
        targets: the selected targets, ``named_modules()`` order.
        unfired: ``{record name: reason}`` for selected modules that never ran (set on exit).

    Raises:
        SelectorError: at construction, when a pattern matches nothing or names a container.
        HookscopeError: at construction, for TorchScript or a bad ``on_unfired``; on entering
            twice.
        HookNeverFiredError: on exit with ``on_unfired="error"`` when a selected module never ran.
    """

    _unfired_consequence = "nothing was recorded"
    _allow_no_patterns = False  # an edit of nothing is a valid no-op; a capture of nothing is not

    def __init__(self, model: nn.Module, patterns: Sequence[str], on_unfired: OnUnfired):
        if on_unfired not in ("warn", "error", "ignore"):
            raise HookscopeError(f"on_unfired={on_unfired!r} is not one of 'warn', 'error', 'ignore'")
        diagnose.preflight(model)
        self.model = model
        no_op = not patterns and self._allow_no_patterns
        self.targets = [] if no_op else resolve(model, list(patterns))
        diagnose.check_targets(model, self.targets)
        self.unfired: dict[str, str] = {}
        self._on_unfired = on_unfired
        self._handles: list[RemovableHandle] = []
        self._ran: set[str] = set()  # paths of selected modules and witnesses that ran
        self._stopper: EarlyStop | None = None  # set by _register for early_stop=True
        self._stops_before = 0  # forwards of this model cut short before the block began
        self._active = False

    def __enter__(self) -> Any:
        if self._active:
            raise HookscopeError(f"this {type(self).__name__} is already active: enter it once, "
                                 f"and build a new one for another block")
        self._active = True
        self._stops_before = stops(unwrap(self.model)[0])
        try:
            self._register()
            for path, module in diagnose.witnesses(self.model, self.targets).items():
                self._add(module.register_forward_pre_hook(self._witness(path)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        self._remove()
        self._finish()
        stopped = stopped_by(exc, self._stopper)  # our early stop: the block ends cleanly
        if exc is not None and not stopped:
            if not isinstance(exc, StopForward):  # another block's stop is no error
                diagnose.locate_error(self.model, exc)
            return None
        ran = self._ran_paths()
        silent = [t for t in self.targets if t.path not in ran]
        if silent and stops(unwrap(self.model)[0]) > self._stops_before:
            self.unfired = {t.key: SKIPPED_BY_STOP for t in silent}  # not their fault: no report
        else:
            self.unfired = diagnose.explain_unfired(self.model, silent, ran)
            self._report_unfired()
        return True if stopped else None

    def _register(self) -> None:
        """Add this session's hooks with ``self._add``; mark a selected module that runs by
        adding its path to ``self._ran``."""
        raise NotImplementedError

    def _stop_early(self) -> None:
        """Cut each forward short once every selected module has returned (``early_stop``);
        call at the end of ``_register``, so the stop runs after this session's hooks."""
        root, _ = unwrap(self.model)
        self._stopper = EarlyStop(root, (t.module for t in self.targets))
        self._stopper.register(self._add)

    def _finish(self) -> None:
        """Run after every hook is removed, before the unfired report."""

    def _ran_paths(self) -> set[str]:
        """Paths of the selected modules and witnesses that ran."""
        return self._ran

    def _add(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active = False

    def _witness(self, path: str) -> Callable[..., None]:
        ran = self._ran

        def hook(module: nn.Module, args: Any) -> None:
            ran.add(path)
        return hook

    def _report_unfired(self) -> None:
        if not self.unfired or self._on_unfired == "ignore":
            return
        lines = "\n".join(f"  - {key}: {why}" for key, why in self.unfired.items())
        n = len(self.unfired)
        message = (f"{n} selected module{'s' if n > 1 else ''} never ran, so no hook fired and "
                   f"{self._unfired_consequence}:\n{lines}")
        if self._on_unfired == "error":
            raise HookNeverFiredError(message + "\n(what the modules that ran did is in err.capture)",
                                      capture=self, unfired=self.unfired)
        warnings.warn(message + "\n(pass on_unfired='error' (--on-unfired error) to make this an "
                      "error, 'ignore' to silence it)", HookNeverFiredWarning, stacklevel=3)


def by_module(targets: Sequence[Target]) -> dict[nn.Module, list[Target]]:
    """Group targets by module, keeping order: one hook per module serves all its targets."""
    grouped: dict[nn.Module, list[Target]] = {}
    for target in targets:
        grouped.setdefault(target.module, []).append(target)
    return grouped
