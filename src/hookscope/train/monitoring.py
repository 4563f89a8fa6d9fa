"""``hookscope.monitor``: statistics every N optimizer steps and a NaN guard on every step.

What runs when:

- **every forward** of the root module: a forward-pre hook keeps references to the inputs and
  a copy of the CPU/CUDA RNG states (a few KB); with the guard on, a forward hook puts a
  gradient hook on each floating-point output tensor. No other module is hooked.
- **every backward** (guard on): the first output gradient queues one callback at the end of
  the backward (``engine.door.hooks.after_backward``): one fused norm of all gradients and one host
  sync (``guard.gradients_finite``). When it is not finite the weights are copied and the step
  waits for its replay (below); ``guard="skip"`` drops the gradients there.
- **sampled steps** (``step % every == 0``): forward hooks on the selected modules fold each
  output into a ``RunningStats`` and hang a gradient hook on it; the parameters of the selected
  modules are copied at the start of the step (for the update-to-weight ratio). At the end of
  the step one record per module is written. Between sampled steps these hooks do not exist.
- **the end of a step**: ``optimizer.step()``'s post hook when ``optimizer=`` is given, else the
  loop's own ``mon.step()`` call. A step that a ``GradScaler`` skips does not call
  ``optimizer.step``, so with ``scaler=`` the loop calls ``mon.step()`` after
  ``scaler.update()``. A fired guard is replayed before ``optimizer.step`` (its pre hook), or
  at ``mon.step()``.

Only statistics are kept (``latest``: the last record of each module, and ``events``); the
records go to ``RUN_DIR/records.jsonl``, so memory does not grow with the number of steps.

Faults: the monitor never makes training wrong nor stops it. A failure of its own work (the
disk is full when a record or a bundle is written, a value its statistics cannot summarise, an
optimizer whose step it cannot hook, a ``writer`` that raises) is one ``MonitorFaultWarning``
and one ``{"event": "fault", "step", "rank", "where", "error"}`` in ``events`` and in the
records (written once the file takes writes again; ``lost`` counts the records that could not
be), and the step goes on and is counted. Only the guard's own finding stops a step
(``NonFiniteStepError``, ``guard="raise"``), whatever the disk does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from hookscope.diagnostics import MAX_BINS, Histogram, NonFiniteOrigin, RunningStats
from hookscope.engine import (
    MaskWatcher,
    Observer,
    OwnedHook,
    Target,
    after_backward,
    as_patterns,
    brief,
    check_int,
    check_model,
    check_run_dir,
    critical,
    detached_clones,
    fullgraph,
    input_device,
    on_optimizer_step,
    on_tensor_grad,
    output_of,
    release_signals,
    resolve_checked,
    state_snapshot,
    unwrap,
)
from hookscope.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    HookscopeError,
    MonitorFaultWarning,
    NonFiniteStepError,
    NonFiniteStepWarning,
    warn,
)
from hookscope.record import padding_dropped
from hookscope.train.bundle import SUFFIX as BUNDLE_SUFFIX
from hookscope.train.guard import (
    ReplayBundle,
    StepInputs,
    drop_gradients,
    grad_outputs,
    gradients_finite,
    replay,
)
from hookscope.train.records_file import RecordsFile
from hookscope.util import advice, get_part, iter_tensors_with_keys

__all__ = ["GuardMode", "Monitor", "finding_key", "monitor"]

Tensor = torch.Tensor
T = TypeVar("T")
GuardMode = Literal["raise", "warn", "skip"]
STATS = ("mean", "std", "absmax", "frac_zeros", "frac_nonfinite", "count")


def monitor(model: nn.Module, layers: str | list[str] = "**", *, every: int = 100,
            optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
            run_dir: str | Path | None = None, guard: GuardMode | None = "raise",
            writer: Any = None, hist: int = 0) -> Monitor:
    """Watch a training loop: per-module statistics every ``every`` steps and a NaN guard.

    Use it as a context (``with hookscope.monitor(...) as mon:``) or hold the object and call
    ``mon.open()`` / ``mon.close()``. A *step* is an optimizer step: counted by
    ``optimizer.register_step_post_hook`` when ``optimizer`` is given, else by the loop calling
    ``mon.step()`` once per step (after ``optimizer.step()``, or ``scaler.update()``). Steps
    are numbered from 0.

    Statistics (sampled steps, for each selected module, over every call in the step): of its
    output (``"activation"``) and of the gradient of the loss with respect to that output
    (``"gradient"``): ``mean``, ``std`` (population, ``ddof=0``: ``torch.std(x,
    correction=0)``), ``absmax``, ``frac_zeros`` (dead units), ``frac_nonfinite``, ``count``
    (elements), float64 as in ``hookscope.stats``, and like it over the real tokens of a batch
    called with an ``attention_mask`` (padding and its zero gradients are not counted); with
    ``scaler``, the gradient statistics
    are of the true gradient (each gradient divided by ``scaler.get_scale()`` in force during
    its backward; the record's ``loss_scale`` gives it, 1.0 without a scaler), as ``grad_norm``
    (read after ``scaler.step`` unscaled the ``.grad``) is; and of its
    parameters, all of them together (weight and bias, and its submodules':
    ``module.parameters()``, each tensor flattened and joined into one vector, float64):
    ``grad_norm`` = sqrt(sum over p of sum(p.grad ** 2)) (parameters without ``.grad`` left
    out, ``None`` when none has one; read at the end of the step) and ``update_ratio`` =
    sqrt(sum over p of sum((p_after - p_before) ** 2)) / sqrt(sum over p of sum(p_before ** 2))
    (``p_before`` when the sampled step starts, ``p_after`` at its end; not the weight's own
    ratio: the bias counts too; ``inf`` when the parameters were all zero and moved, ``None``
    for a module without parameters). docs/training.md shows both computed by hand.

    The guard (every backward, see the module docstring) detects the first non-finite gradient
    (or, with ``scaler``, a non-finite output: gradient overflows there are the scaler's and
    are only counted in ``overflows``). It then replays the step with ``find_nonfinite`` and
    names the step, module, call, direction (forward/backward), op and tensor; the replay bundle
    is written to ``RUN_DIR/nonfinite-step-<N>.safetensors`` for ``hookscope.replay(path, model)``.

    DDP under ``torchrun``: each rank guards its own step (its own gradients, checked at the end
    of its backward, before DDP's all-reduce writes the averaged ones) and writes its own files
    (``records-rank<R>.jsonl``, ``nonfinite-step-<N>-rank<R>.safetensors``); messages and events carry
    the rank. Before ``optimizer.step`` every rank checks the all-reduced gradients once more
    (one fused norm): a rank whose own step was finite reports ``direction="all-reduce"``
    (another rank's step was not; that rank names the module) and raises, warns or skips too.

    ``torch.compile``: the hooks are on ``compiled._orig_mod``'s modules. A sampled step's
    statistics run inside the compiled graph (``engine.compile.graph``: the activation's on a copy
    of the output, the gradient's in the backward graph), so records equal the eager model's
    and sampled steps make no recompile (a graph with their hooks, one without, in all). The
    root's hooks (the inputs and RNG copy kept for a replay, the guard's gradient hooks) run
    outside the graph, a split ``fullgraph=True`` cannot hold (dynamo raises). Records and the
    guard's finding equal eager whether the monitor opens before or after the first compiled
    call (torch 2.13; ``test_compiled_model_is_watched_through_orig_mod``). The replay runs
    eagerly on a copy of ``_orig_mod``.

    Args:
        model: the root module being trained (``DataParallel``/DDP wrappers are looked
            through, and ``torch.compile``'s: a compiled model's ``_orig_mod`` is watched, see
            the note below).
        layers: ``hookscope.select`` patterns of the modules to take statistics of.
        every: take statistics at steps 0, every, 2*every, ...; 0: none (guard only).
        optimizer: hook its ``step()``: steps are counted, and a fired guard acts before the
            weights change. Not with ``scaler`` (skipped steps never call it). A wrapper that
            steps another optimizer without torch's step hooks (Opacus's ``DPOptimizer``) is
            hooked through the optimizer it steps (``original_optimizer``); one with neither is
            a ``MonitorFaultWarning``, and the loop counts steps with ``mon.step()``.
        scaler: the ``torch.amp.GradScaler`` of the loop (call ``mon.step()`` after
            ``scaler.update()``).
        run_dir: folder for ``records.jsonl`` (``records-rank<R>.jsonl`` in a process group
            of several ranks) and replay bundles; None: nothing is written.
        guard: ``"raise"`` (``NonFiniteStepError``), ``"warn"`` (``NonFiniteStepWarning``,
            the step goes on), ``"skip"`` (warn and drop the step's gradients, so
            ``optimizer.step`` changes nothing; with a scaler, the gradients are set to NaN so
            the scaler skips the step), or None (no guard).
        writer: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar(tag, value,
            step)``): every statistic as ``<module>/<activation|gradient>/<stat>``.
        hist: > 0: each record also holds ``"activation_hist"``, a ``Histogram`` of ``hist``
            bins of the activation over the sampled step (``Histogram.as_dict()``: ``lo``,
            ``hi``, ``counts``, ``below``, ``above``, ``nonfinite``), equal to ``torch.histc``.
            A module's edges are fixed at its first sampled call (that output's finite
            ``[min, max]``) and kept for the run, so steps compare bin for bin; later values
            outside are counted in ``below``/``above``. 0: none.

    Raises:
        ArgumentTypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, ``scaler`` lacks a
            GradScaler's ``scale``/``update``/``get_scale``, ``run_dir`` is not a path (at the call).
        ArgumentValueError: ``every`` < 0, an unknown ``guard``, ``run_dir`` is an existing
            file (at the call).
        HookscopeError: ``model`` is a ``torch.compile(..., fullgraph=True)`` model (at the
            call: see the note above).
        HookscopeError: both ``optimizer`` and ``scaler``, or ``run_dir`` already holds a run
            (on entry; a failed entry removes every hook it registered).
        SelectorError: a pattern matches no module.
    """
    return Monitor(model, layers, every=every, optimizer=optimizer, scaler=scaler,
                   run_dir=run_dir, guard=guard, writer=writer, hist=hist)


class Monitor:
    """A running ``hookscope.monitor`` (see there for the arguments).

    Attributes:
        step_index: the step in progress (0-based).
        overflows: steps a GradScaler skipped for non-finite gradients (with ``scaler``).
        latest: ``{module: record}`` of the last sampled step, each module by the name asked
            (``"resid_post.1"``, else its path); a record's ``"path"`` is its module path.
        events: the guard's findings and the monitor's own faults (``{"event": "fault"}``),
            as written to the records file.
        records_file: the JSON Lines file, or None.
    """

    def __init__(self, model: nn.Module, layers: str | list[str], *, every: int,
                 optimizer: torch.optim.Optimizer | None, scaler: Any, run_dir: str | Path | None,
                 guard: GuardMode | None, writer: Any, hist: int = 0):
        _check_arguments(every, optimizer, scaler, guard)
        check_int("hist", hist, minimum=0, maximum=MAX_BINS)
        self.hist = hist
        self._hist_ranges: dict[str, tuple[float, float]] = {}  # module -> edges fixed at its first sample
        check_run_dir("run_dir", run_dir)
        check_model(model)  # before any attribute of it is read
        _refuse_fullgraph(model)
        self.root, _ = unwrap(model)
        self.every, self.guard, self.scaler, self.writer = every, guard, scaler, writer
        self._optimizer = optimizer
        # resolved on the model as given: names with wrapper segments ("_module.0") work as in capture
        self.targets = resolve_checked(model, as_patterns(layers))[0] if every else []
        self.rank, self.world = _rank()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        name = "records.jsonl" if self.world == 1 else f"records-rank{self.rank}.jsonl"
        self.records_file = self.run_dir / name if self.run_dir is not None else None
        self.step_index = 0
        self.overflows = 0
        self.latest: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._params = [p for p in self.root.parameters() if p.requires_grad]
        self._device_type = input_device(self.root).type
        self._inputs: StepInputs | None = None
        self._tokens = MaskWatcher(self.root)  # the running forward's mask, for the statistics
        self._out_grads: list[Tensor | None] = []
        self._out_finite: Tensor | None = None  # (outputs,) bool, read only on a finding
        self._queued = False
        self._overflowed = False
        self._pending: ReplayBundle | None = None
        self._findings: dict[tuple[Any, ...] | None, int] = {}  # finding_key -> first step
        self._sample: _Sample | None = None
        self._file: RecordsFile | None = None
        self._unwritten: dict[str, Any] | None = None  # the fault event of records not written
        self._root_session: Observer | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> Monitor:
        try:
            return self.open()
        except BaseException:
            self.close()  # idempotent: what an exception after open's return left
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except BaseException:
            self.close()  # idempotent: what an exception (Ctrl-C) halfway through left
            raise
        finally:
            release_signals()  # a signal held back during the exit surfaces here

    @critical
    def open(self) -> Monitor:
        """Start watching (hooks, records file); return self.

        Raises:
            HookscopeError: already open, or ``run_dir`` holds a records file already.
        """
        if self._root_session is not None:
            raise HookscopeError("this monitor is already open: open it once, or build a new one")
        try:
            self._start()
            release_signals()  # a signal held back so far: a failed open
        except BaseException:
            self.close()  # nothing it registered or opened outlives a failed open (releases)
            raise
        return self

    def _start(self) -> None:
        self._file = self._open_file()
        self._write({"event": "start", "rank": self.rank, "every": self.every,
                     "modules": [t.key for t in self.targets], "guard": self.guard})
        roots = [Target(path, module) for path, module in self._tokens.modules]  # stacks' tokens too
        self._root_session = Observer(self.root, roots, pre=lambda t: self._forward_begins,
                                      forward=lambda t: self._forward_ends, with_kwargs=True,
                                      explain_unfired=False)
        self._root_session.__enter__()
        if self._optimizer is not None:
            stepped = _stepped_optimizer(self._optimizer)
            if stepped is None:
                self._fault("optimizer", TypeError(
                    f"{type(self._optimizer).__name__} has no torch step hooks and steps no "
                    f"torch.optim.Optimizer (original_optimizer)"),
                    "steps are not counted by its step(): call mon.step() after each one")
                self._optimizer = None
            else:
                # one at a time: a failure on the second still leaves the first to close()
                on_optimizer_step(stepped, self._before_update, pre=True, record=self._handles.append)
                on_optimizer_step(stepped, self._end_step, pre=False, record=self._handles.append)
        self._contained("statistics", self._start_sample_if_due)

    @critical
    def close(self) -> None:
        """Stop watching: replay a guard still pending (it may raise), then remove every hook,
        end a sampled step without writing it, and close the records file."""
        # each part in a finally of its own: one that raises (a pending guard, an interrupt
        # lost inside a sampled step, reported by its session's exit) never keeps the others
        # from running; each clears its field after it succeeded, so a retried close() redoes
        # only what failed
        try:
            self._resolve_pending()
        finally:
            try:
                for handle in self._handles:
                    handle.remove()
                self._handles = []
                if self._sample is not None:  # held until its session has exited (idempotent)
                    self._sample.session.__exit__(None, None, None)
                    self._sample = None
            finally:
                try:
                    if self._root_session is not None:
                        self._root_session.__exit__(None, None, None)
                        self._root_session = None
                finally:
                    if self._file is not None:
                        self._file.close()
                        self._file = None
                    release_signals()  # a signal held back while closing surfaces here

    def step(self) -> None:
        """End the step in progress (call once per optimizer step, after ``optimizer.step()``
        or ``scaler.update()``, before ``zero_grad()``): replay a fired guard, write a sampled
        step's records, count a skipped overflow, start the next step.

        Raises:
            HookscopeError: the monitor counts the optimizer's steps itself (``optimizer=``).
            NonFiniteStepError: the guard fired in this step and ``guard="raise"``.
        """
        if self._optimizer is not None:
            raise HookscopeError("this monitor counts steps by the optimizer's step hook "
                                 "(optimizer= was given): remove the mon.step() call")
        self._before_update()
        self._end_step()

    def before_optimizer_step(self) -> None:
        """Act on a guard that fired in this step now, before ``optimizer.step`` changes the
        weights (replay, record, raise/warn); for a loop that hooks its optimizer itself, as
        the Hugging Face callback does. Nothing when the guard did not fire.

        Raises:
            NonFiniteStepError: the guard fired in this step and ``guard="raise"``.
        """
        self._before_update()

    def _end_step(self) -> None:
        """After the weights changed: nothing here may raise (see "Faults" above)."""
        try:
            if self._sample is not None:
                self._finish_sample(self._sample)
            if self._overflowed:
                self._overflowed = False
                self.overflows += 1
                scale = self._contained("statistics", lambda: float(self.scaler.get_scale()))
                self._write({"event": "overflow_skipped", "step": self.step_index,
                             "rank": self.rank, "scale": scale})
        finally:
            self.step_index += 1
        self._contained("statistics", self._start_sample_if_due)

    # -- faults ------------------------------------------------------------------------------

    def _contained(self, where: str, work: Callable[[], T]) -> T | None:
        """``work()``; a fault in it (hookscope's own, never the training's) is one warning and
        one event, and None is returned."""
        try:
            return work()
        except Exception as err:  # the monitor never stops training (module docstring)
            self._fault(where, err)
            return None

    def _fault(self, where: str, err: BaseException, then: str = "") -> None:
        """One ``MonitorFaultWarning`` and one ``fault`` event for ``err`` in ``where``."""
        error = advice(err) if isinstance(err, OSError) and err.errno is not None else \
            f"{type(err).__name__}: {err}"
        event = {"event": "fault", "step": self.step_index, "rank": self.rank, "where": where,
                 "error": error[:500]}
        self.events.append(event)
        self._write(event)
        warn(f"hookscope.monitor, step {self.step_index}: {where} failed ({error:.300}); training "
             f"goes on{', ' + then if then else ''}; the event is in mon.events and the records",
             MonitorFaultWarning)

    # -- the guard ---------------------------------------------------------------------------

    def _forward_begins(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._contained("statistics", lambda: self._tokens.hook(module, args, kwargs))
        if self.guard is not None and module is self.root:  # only a replay needs the step's inputs
            self._inputs = self._contained(
                "guard", lambda: StepInputs.now(args, kwargs, self._device_type))

    def _forward_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.guard is not None and module is self.root:  # not an encoder-decoder's stack
            self._contained("guard", lambda: self._watch_outputs(output))

    def _watch_outputs(self, output: Any) -> None:
        tensors = grad_outputs(output)
        grads: list[Tensor | None] = [None] * len(tensors)
        self._out_grads = grads
        for i, tensor in enumerate(tensors):
            on_tensor_grad(tensor, self._grad_catcher(grads, i))
        # no sync here: read in _check only when the gradients are not finite, or under a scaler
        self._out_finite = torch.stack([torch.isfinite(t.detach()).all() for t in tensors]) \
            if tensors else None

    def _grad_catcher(self, grads: list[Tensor | None], i: int) -> Any:
        def hook(grad: Tensor) -> None:
            grads[i] = grad
            if not self._queued:
                self._queued = True
                after_backward(lambda: self._contained("guard", self._check))
        return hook

    def _check(self) -> None:
        """End of a backward: the cheap check; on a finding, keep what the replay needs."""
        self._queued = False
        if self._pending is not None:
            return
        grads_ok = gradients_finite(self._params)
        if grads_ok and self.scaler is None:
            return
        forward_ok = self._out_finite is None or bool(self._out_finite.all())
        if grads_ok and forward_ok:
            return
        if self.scaler is not None and forward_ok:  # the scaler skips this step on purpose
            self._overflowed = True
            return
        if self._inputs is None:  # the forward's fault was reported: no replay, still the finding
            raise HookscopeError("non-finite gradients, but the step's inputs were not kept")
        self._pending = ReplayBundle(self.step_index, self.rank, self._inputs,
                                     list(self._out_grads), state_snapshot(self.root),
                                     forward_ok)
        if self.guard == "skip":
            self._skip_step()

    def _skip_step(self) -> None:
        if self.scaler is None:
            drop_gradients(self._params)
        else:  # a GradScaler steps only on finite gradients
            for p in self._params:
                if p.grad is not None:
                    p.grad.fill_(math.nan)

    def _before_update(self) -> None:
        """Before the weights change: the replay of a fired guard; in a process group of
        several ranks, also the gradients after DDP's all-reduce (one more fused norm): this
        rank's own were finite at the end of its backward, so a non-finite one came from
        another rank, whose own guard names the module."""
        if self._pending is not None:
            self._resolve_pending()
        elif self.world > 1 and self.guard is not None and self._contained(
                "guard", lambda: gradients_finite(self._params)) is False:
            if self.scaler is not None:  # the scaler skips this step on every rank
                self._overflowed = True
                return
            event = {"event": "nonfinite", "step": self.step_index, "rank": self.rank,
                     "module": None, "class": None, "call": None, "direction": "all-reduce",
                     "op": None, "tensor": None, "parameters": [], "bundle": None}
            self.events.append(event)
            self._write(event)
            if self.guard == "skip":
                self._skip_step()
            self._alarm(f"step {self.step_index} (rank {self.rank}): this rank's forward and "
                        "backward were finite, its gradients after DDP's all-reduce are not: "
                        f"another rank's step was not finite; of the {self.world} ranks, the one "
                        "whose records-rank<R>.jsonl has a 'nonfinite' event with a module names it",
                        None, self.step_index, None)

    def _resolve_pending(self) -> None:
        """Replay a fired step on a copy of the model, record and report what it found."""
        bundle, self._pending = self._pending, None
        if bundle is None:
            return
        if self.guard == "skip":  # again: DDP's all-reduce may have refilled the gradients
            self._skip_step()
        # the finding is raised or recorded whatever the replay or the disk does
        origin = self._contained("replay", lambda: replay(bundle, copy.deepcopy(self.root)))
        if self._seen_before(bundle, origin):
            return
        path = self._contained("bundle", lambda: self._save(bundle)) if self.run_dir else None
        event = _event(bundle, origin, path)
        self.events.append(event)
        self._write(event)
        self._alarm(_message(bundle, origin, path, self.latest.get(event["module"] or "")),
                    origin, bundle.step, path)

    def _save(self, bundle: ReplayBundle) -> Path:
        """Write ``bundle`` into the run folder; a file of that name is never replaced (it is
        not this run's: a run writes a bundle per step once)."""
        suffix = f"-rank{self.rank}" if self.records_file and "rank" in self.records_file.name else ""
        path = self.run_dir / f"nonfinite-step-{bundle.step}{suffix}{BUNDLE_SUFFIX}"  # type: ignore[operator]
        if path.exists() or path.is_symlink():
            raise FileExistsError(f"{path} exists and is not this run's: hookscope never "
                                  f"replaces a file it did not write")
        return bundle.save(path)

    def _seen_before(self, bundle: ReplayBundle, origin: NonFiniteOrigin | None) -> bool:
        """True when a previous step of this run had the same finding (``finding_key``): the
        step is recorded as an event ``{"same_as_step": first step, "bundle": None}`` and
        neither a bundle nor a warning is written again (NaN weights would fire every step).
        Under ``guard="raise"`` every finding raises (a caught error must not hide the next)."""
        if self.guard == "raise":
            return False
        key = finding_key(origin)
        first = self._findings.setdefault(key, bundle.step)
        if first == bundle.step:
            return False
        event = _event(bundle, origin, None) | {"same_as_step": first}
        self.events.append(event)
        self._write(event)
        return True

    def _alarm(self, message: str, origin: NonFiniteOrigin | None, step: int, path: Path | None) -> None:
        if self.guard == "raise":
            error = NonFiniteStepError(message)
            error.origin, error.step, error.bundle = origin, step, path  # type: ignore[attr-defined]
            raise error
        warn(message, NonFiniteStepWarning)

    # -- sampled steps -----------------------------------------------------------------------

    def _start_sample_if_due(self) -> None:
        if self.every and self.step_index % self.every == 0:
            self._sample = _Sample(self.root, self.targets, self.scaler, self._contained,
                                   self._tokens)
            self._sample.session.__enter__()  # held first: close() exits it, whatever happens
            if self.hist:
                self._sample.count_histograms(self.hist, self._hist_ranges)

    def _finish_sample(self, sample: _Sample) -> None:
        """Exit the sampled step's session, then let go of it (held until then, so an
        interrupt before the exit leaves it to ``close()``), then write its records."""
        sample.session.__exit__(None, None, None)
        self._sample = None  # ended once, whatever follows
        for target in self.targets:
            record = self._contained(f"statistics of {target.key!r}",
                                     lambda t=target: sample.record(t, self.step_index, self.rank))  # type: ignore[misc]
            if record is None:
                continue
            self.latest[target.name] = record
            self._write(record)
            if self.writer is not None and self._contained(
                    "writer", lambda r=record: _to_tensorboard(self.writer, r)) is None:  # type: ignore[misc]
                self.writer = None  # one warning for a writer that fails: not one per record

    # -- the records file --------------------------------------------------------------------

    def _open_file(self) -> RecordsFile | None:
        if self.records_file is None:
            return None
        self.records_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            return RecordsFile(self.records_file)
        except FileExistsError:
            raise HookscopeError(f"{self.records_file} exists: each run writes its own folder; "
                                 "pass a new run_dir (or delete the old run)") from None

    def _write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a failure is one warning and one fault event (``lost`` counts the
        records not written), written before the next record the file takes."""
        if self._file is None:
            return
        try:
            if self._unwritten is not None:
                self._file.append(self._unwritten)
                self._unwritten = None
            self._file.append(record)
        except Exception as err:  # the disk is full: training goes on
            if self._unwritten is None:
                error = advice(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
                self._unwritten = {"event": "fault", "step": self.step_index, "rank": self.rank,
                                   "where": "records", "error": error[:500], "lost": 0}
                self.events.append(self._unwritten)
                warn(f"hookscope.monitor, step {self.step_index}: {self.records_file} cannot be "
                     f"written ({error:.300}); training goes on, and the records are dropped "
                     f"until the file takes writes again (then a 'fault' event counts them)",
                     MonitorFaultWarning)
            self._unwritten["lost"] += 1


class _Sample:
    """One sampled step: hooks on the selected modules and the weights they started with.

    ``scaler``: the loop's GradScaler (or None): each gradient is divided by its scale in force
    during the backward, so the statistics are of the true gradient. ``contained``: the
    monitor's fault handler, around each hook's work. ``tokens``: the root's ``MaskWatcher``:
    activations and gradients count the real tokens of a batch given with an attention mask
    (``record.padding_dropped``), as ``hookscope.stats`` does."""

    def __init__(self, root: nn.Module, targets: list[Target], scaler: Any,
                 contained: Callable[[str, Callable[[], Any]], Any], tokens: MaskWatcher):
        self.scaler, self.contained, self.tokens = scaler, contained, tokens
        self.scales: set[float] = set()
        self.activations = {t.key: RunningStats() for t in targets}
        self.gradients = {t.key: RunningStats() for t in targets}
        self.before = {t.key: detached_clones(t.module.parameters()) for t in targets}
        self.histograms: dict[str, Histogram] = {}
        self._hist: tuple[int, dict[str, tuple[float, float]]] | None = None
        self.session = Observer(root, targets, forward=self._hook, explain_unfired=False)

    def count_histograms(self, bins: int, ranges: dict[str, tuple[float, float]]) -> None:
        """Also histogram each activation in ``bins`` bins, with the edges in ``ranges``; a
        module not in it gets its first call's finite range, written into ``ranges``."""
        self._hist = (bins, ranges)

    def _histogram(self, key: str, tensor: Tensor) -> None:
        assert self._hist is not None
        bins, ranges = self._hist
        if key not in self.histograms:
            h = Histogram(bins, *ranges[key]) if key in ranges else Histogram.fitting(bins, tensor)
            ranges[key] = (h.lo, h.hi)
            self.histograms[key] = h
        self.histograms[key].update(tensor)

    def _hook(self, target: Target) -> Any:
        activations, gradients = self.activations[target.key], self.gradients[target.key]

        def observe(output: Any) -> None:
            keys, tensor = next(((k, t) for k, t in iter_tensors_with_keys(get_part(output, target.parts))
                                 if t.is_floating_point()), ((), None))
            if tensor is None:
                return
            tokens = self.tokens.tokens  # this forward's: the backward may come after others
            real = padding_dropped(tensor.detach(), target, tokens, keys)
            activations.update(real)
            if self._hist is not None:
                self._histogram(target.key, real)
            if tensor.requires_grad:
                on_tensor_grad(tensor, lambda g: self.contained(
                    f"statistics of {target.key!r}",
                    lambda: gradients.update(self._true(padding_dropped(g, target, tokens, keys)))))

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.contained(f"statistics of {target.key!r}", lambda: observe(output))
        if target.parts:
            return hook

        def gradient(grad: Tensor) -> None:
            self.contained(f"statistics of {target.key!r}", lambda: gradients.update(
                self._true(padding_dropped(grad, target, self.tokens.tokens))))
        # inside a compiled graph: ``hook`` on a copy of the output (detached: no tensor hook),
        # and the gradient that the backward graph hands over (engine.compile.graph)
        return OwnedHook(hook, target.module, pick=output_of, on_gradient=gradient)

    def _true(self, grad: Tensor) -> Tensor:
        """``grad`` with the GradScaler's scale in force divided out (float32, as the scaler's
        own ``unscale_`` does)."""
        if self.scaler is None:
            return grad
        scale = float(self.scaler.get_scale())
        self.scales.add(scale)
        return grad.float() / scale

    def record(self, target: Target, step: int, rank: int) -> dict[str, Any]:
        """The JSON record of ``target`` for this step."""
        params = list(target.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        # "module": the name asked (a standard name as given, else the path), "path" beside it
        record = {"step": step, "rank": rank, "module": target.name, "path": target.key,
                "activation": _summary(self.activations[target.key]),
                "gradient": _summary(self.gradients[target.key]),
                "loss_scale": max(self.scales, default=1.0),
                "grad_norm": float(torch.nn.utils.get_total_norm(grads)) if grads else None,
                "update_ratio": _update_ratio(self.before[target.key], params)}
        if self._hist is not None:
            h = self.histograms.get(target.key)
            record["activation_hist"] = h.as_dict() if h is not None else None
        return record


def _refuse_fullgraph(model: nn.Module) -> None:
    """Refuse a ``torch.compile(model, fullgraph=True)`` model at the call: the root's hooks run
    outside the graph, a split that a full graph forbids (dynamo would raise at the first step)."""
    if fullgraph(model):
        raise HookscopeError(
            "hookscope.monitor cannot watch a torch.compile(model, fullgraph=True) model: its "
            "root hooks (the step's inputs and RNG kept for a replay, the guard's gradient hooks) "
            "run outside the compiled graph, a split that fullgraph=True forbids. Compile with "
            "fullgraph=False (sampled steps' statistics still run inside the graph, with no "
            "recompile per sampled step), or monitor the eager model")


def _summary(stats: RunningStats) -> dict[str, float] | None:
    """``hookscope.stats``' numbers with ``absmax`` = max(|min|, |max|); None when nothing ran."""
    values = stats.as_dict()
    if values["count"] == 0:
        return None
    values["absmax"] = max(abs(values["min"]), abs(values["max"]))
    return {key: values[key] for key in STATS}


def _update_ratio(before: list[Tensor], params: list[nn.Parameter]) -> float | None:
    """||W_after - W_before|| / ||W_before||, W all of a module's parameters (weight and bias)
    flattened and joined into one vector, float64; ``inf`` when ||W_before|| is 0 and W moved,
    0.0 when nothing moved, ``None`` without parameters."""
    if not params:
        return None
    delta = sum(float((p.detach().double() - b.double()).square().sum())
                for p, b in zip(params, before, strict=True))
    size = sum(float(b.double().square().sum()) for b in before)
    return math.sqrt(delta) / math.sqrt(size) if size > 0 else math.inf if delta > 0 else 0.0


def _to_tensorboard(writer: Any, record: dict[str, Any]) -> bool:
    """Write ``record``'s numbers with ``writer.add_scalar``; return True (``_contained`` gives
    None when it raised)."""
    for kind in ("activation", "gradient"):
        for stat, value in (record[kind] or {}).items():
            writer.add_scalar(f"{record['module']}/{kind}/{stat}", value, record["step"])
    for name in ("grad_norm", "update_ratio"):
        if record[name] is not None:
            writer.add_scalar(f"{record['module']}/{name}", record[name], record["step"])
    return True


def _event(bundle: ReplayBundle, origin: NonFiniteOrigin | None, path: Path | None) -> dict[str, Any]:
    where: dict[str, Any] = {"module": None, "class": None, "call": None, "direction": None,
                             "op": None, "tensor": None, "parameters": []}
    if origin is not None:
        where = {"module": origin.path, "class": origin.class_name, "call": origin.call_index,
                 "direction": origin.phase, "op": origin.op, "tensor": origin.bad_label,
                 "parameters": origin.parameter_names}
    return {"event": "nonfinite", "step": bundle.step, "rank": bundle.rank, **where,
            "bundle": str(path) if path is not None else None}


def finding_key(origin: NonFiniteOrigin | None) -> tuple[Any, ...] | None:
    """What makes a guard finding new: the module, direction, op, tensor and whether the
    module's own parameters are non-finite (not the step, call or counts: NaN weights spread
    from weight to bias between steps and stay the same finding). None: a finite replay."""
    if origin is None:
        return None
    return (origin.path, origin.phase, origin.op, origin.bad_label, bool(origin.parameters))


def _message(bundle: ReplayBundle, origin: NonFiniteOrigin | None, path: Path | None,
             last: dict[str, Any] | None) -> str:
    rank = f" (rank {bundle.rank})" if bundle.rank else ""
    if origin is None:
        what = ("non-finite gradients, but the replay of the step was finite (a non-deterministic "
                "kernel, or more than one forward per backward?)")
    else:
        what = str(origin)
    lines = [f"step {bundle.step}{rank}: {what}"]
    if last is not None:
        lines += [f"  that module at step {last['step']}: {kind} {_numbers(last[kind])}"
                  for kind in ("activation", "gradient")]
    if path is not None:
        lines.append(f"  replay it: hookscope.replay('{path}', model)")
    return "\n".join(lines)


def _numbers(summary: dict[str, float] | None) -> str:
    if summary is None:
        return "none"
    return ", ".join(f"{key} {value:.4g}" for key, value in summary.items())


def _check_arguments(every: int, optimizer: Any, scaler: Any, guard: Any) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ArgumentValueError(f"every={brief(every)}: pass a whole number of steps >= 0 "
                                 f"(0: no statistics)")
    if guard not in ("raise", "warn", "skip", None):
        raise ArgumentValueError(f"guard={brief(guard)} is not one of 'raise', 'warn', 'skip', None")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(f"optimizer must be a torch.optim.Optimizer (its step() is hooked "
                                f"to count steps), e.g. optimizer=torch.optim.SGD(model.parameters"
                                f"(), lr=0.1); got {type(optimizer).__name__} {optimizer!r:.40}")
    if scaler is not None and not all(hasattr(scaler, a) for a in ("get_scale", "update", "scale")):
        raise ArgumentTypeError(f"scaler must be a torch.amp.GradScaler (or an object with its "
                                f"scale/update/get_scale); got {type(scaler).__name__} "
                                f"{scaler!r:.40}")
    if optimizer is not None and scaler is not None:
        raise HookscopeError("optimizer= and scaler= together: a step the GradScaler skips never "
                             "calls optimizer.step, so its hooks cannot count it; pass scaler= only "
                             "and call mon.step() after scaler.update()")


def _stepped_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step()`` runs torch's step hooks: ``optimizer`` itself, or the one
    a wrapper without them steps (Opacus's ``DPOptimizer``: ``original_optimizer``, stepped
    after the privacy noise is added); None when there is neither."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer  # type: ignore[no-any-return]
        optimizer = getattr(optimizer, "original_optimizer", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            return None
    return None


def _rank() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
