"""``HookscopeCallback``: ``hookscope.monitor`` inside a Hugging Face ``transformers.Trainer``.

Imported only when asked for (``from hookscope.train import HookscopeCallback``): this module
imports transformers, which ``import hookscope`` does not.

Where the monitor's step events come from in the Trainer's loop (``Trainer._inner_training_loop``):

- ``on_train_begin``: the monitor opens on the Trainer's model (DDP/DataParallel wrappers are
  looked through), with the ``GradScaler`` of the Trainer's optimizer when fp16 has one
  (accelerate's ``AcceleratedOptimizer.scaler``), so its skipped overflows are counted.
- ``on_pre_optimizer_step``: a guard that fired in the step's backward(s) is replayed and
  reported (``Monitor.before_optimizer_step``) before the weights change.
- ``on_optimizer_step``: the step ends (``Monitor.step``): after ``optimizer.step()`` and before
  ``model.zero_grad()``, so gradient norms and update ratios are read. The monitor's step index
  is the Trainer's ``state.global_step`` of that step (0-based, as the Trainer counts before
  its increment). With gradient accumulation, the backwards of one step are one step.
- ``on_train_end``, or the guard raising: the monitor closes (every hook removed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hookscope.errors import HookscopeError
from hookscope.train.monitoring import monitor
from hookscope.train.watcher import GuardMode, Monitor

__all__ = ["HookscopeCallback"]


class HookscopeCallback(TrainerCallback):
    """A ``TrainerCallback`` that runs ``hookscope.monitor`` over ``Trainer.train()``.

    ``Trainer(..., callbacks=[HookscopeCallback(layers=..., every=..., run_dir=...)])``. The
    arguments are ``hookscope.monitor``'s (see there for the statistics, the guard and the run
    folder); the step is the Trainer's optimizer step (see this module's docstring).

    Attributes:
        monitor: the open ``Monitor`` during ``train()``, and the last one after it (its
            ``events``, ``latest``, ``overflows``, ``step_index``); None before.

    Raises:
        NonFiniteStepError: (from ``trainer.train()``) the guard fired and ``guard="raise"``;
            the monitor is closed first.
        HookscopeError: ``on_train_begin`` without a model; as ``hookscope.monitor``.
    """

    def __init__(self, layers: str | list[str] = "**", *, every: int = 100,
                 run_dir: str | Path | None = None, guard: GuardMode | None = "raise",
                 writer: Any = None):
        self.layers, self.every, self.run_dir, self.guard, self.writer = (
            layers, every, run_dir, guard, writer)
        self.monitor: Monitor | None = None
        self._open = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        """Open the monitor on ``model`` (a second ``train()`` opens a new one)."""
        if model is None:
            raise HookscopeError("HookscopeCallback got no model at on_train_begin: add it to "
                                 "a transformers.Trainer (callbacks=[...]), which passes its model")
        self.close()
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer under fp16
        self.monitor = monitor(model, self.layers, every=self.every, scaler=scaler,
                               run_dir=self.run_dir, guard=self.guard, writer=self.writer)
        self.monitor.open()
        self._open = True

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report a guard that fired in this step, before the weights change."""
        self._closing_on_error(self._live().before_optimizer_step)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End the step: its records (sampled steps), a counted overflow."""
        self._closing_on_error(self._live().step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the monitor: every hook removed, the records file closed."""
        self.close()

    def close(self) -> None:
        """Close the monitor if it is open (for a ``train()`` that an error other than the
        guard's left: the Trainer then calls no ``on_train_end``)."""
        if self._open and self.monitor is not None:
            self._open = False
            self.monitor.close()

    def _live(self) -> Monitor:
        if not self._open or self.monitor is None:
            raise HookscopeError("HookscopeCallback saw an optimizer step before on_train_begin: "
                                 "use it as a transformers.Trainer callback (callbacks=[...])")
        return self.monitor

    def _closing_on_error(self, action: Any) -> None:
        try:
            action()
        except BaseException:
            self.close()
            raise
