"""``Monitor``: the running watch of a training loop that ``hookscope.monitor`` returns (what runs
when, and the faults it keeps to itself: ``hookscope.train.monitoring``'s docstring)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from hookscope.diagnostics import MAX_BINS, NonFiniteOrigin
from hookscope.engine import (
    MaskWatcher,
    Observer,
    Target,
    after_backward,
    as_patterns,
    brief,
    check_int,
    check_model,
    check_run_dir,
    critical,
    fullgraph,
    input_device,
    never_skipped,
    on_optimizer_step,
    on_output_grad,
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
from hookscope.train.bundle import SUFFIX as BUNDLE_SUFFIX
from hookscope.train.findings import _event, _message, finding_key
from hookscope.train.guard import (
    ReplayBundle,
    StepInputs,
    drop_gradients,
    extremes,
    extremes_finite,
    grad_outputs,
    gradients_finite,
    replay,
)
from hookscope.train.records_file import RecordsFile
from hookscope.train.sampling import _Sample, _to_tensorboard
from hookscope.util import advice

__all__ = ["GuardMode", "Monitor"]

Tensor = torch.Tensor
T = TypeVar("T")
GuardMode = Literal["raise", "warn", "skip"]


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
        # aminmax of each output (no sync), read only on a finding or under a scaler
        self._out_extremes: list[tuple[Tensor, Tensor]] = []
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
        self._refuse_reopen()  # before the try: a refused entry closes nothing of the open one
        try:
            return self.open()
        except BaseException:
            self.close()  # idempotent: what an exception after open's return left
            raise

    @never_skipped(lambda monitor: monitor._closed() or monitor.close(),  # exit cut short
                   is_open=lambda monitor: monitor._root_session is not None)  # re-entry
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
        self._refuse_reopen()
        try:
            self._start()
            release_signals()  # a signal held back so far: a failed open
        except BaseException:
            self.close()  # nothing it registered or opened outlives a failed open (releases)
            raise
        return self

    def _refuse_reopen(self) -> None:
        if self._root_session is not None:
            raise HookscopeError("this monitor is already open: open it once, or build a new one")

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

    def _closed(self) -> bool:
        """Whether ``close`` has nothing left to do (never opened, or closed)."""
        return (self._root_session is None and self._file is None and not self._handles
                and self._sample is None and self._pending is None)

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
        """After the weights changed: nothing here may raise (monitoring.py's "Faults")."""
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
        except Exception as err:  # the monitor never stops training (monitoring.py's docstring)
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
        # each training step runs this: one try, no lambdas (monitoring.py's "Faults" still hold)
        if self._sample is not None:  # only a sampled step's statistics read the tokens
            try:
                self._tokens.hook(module, args, kwargs)
            except Exception as err:  # noqa: BLE001  (the monitor never stops training)
                self._fault("statistics", err)
        if self.guard is not None and module is self.root:  # only a replay needs the step's inputs
            try:
                self._inputs = StepInputs.now(args, kwargs, self._device_type)
            except Exception as err:  # noqa: BLE001
                self._inputs = None
                self._fault("guard", err)

    def _forward_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.guard is not None and module is self.root:  # not an encoder-decoder's stack
            try:
                self._watch_outputs(output)
            except Exception as err:  # noqa: BLE001
                self._fault("guard", err)

    def _watch_outputs(self, output: Any) -> None:
        tensors = grad_outputs(output)
        grads: list[Tensor | None] = [None] * len(tensors)
        self._out_grads = grads
        for i, tensor in enumerate(tensors):
            on_output_grad(tensor, self._grad_catcher(grads, i))
        # no sync here: read in _check only when the gradients are not finite, or under a scaler
        self._out_extremes = [extremes(t) for t in tensors if t.numel()]

    def _grad_catcher(self, grads: list[Tensor | None], i: int) -> Any:
        def hook(grad: Tensor) -> None:
            grads[i] = grad
            if not self._queued:
                self._queued = True
                after_backward(self._checked)
        return hook

    def _checked(self) -> None:
        try:
            self._check()
        except Exception as err:  # noqa: BLE001
            self._fault("guard", err)

    def _check(self) -> None:
        """End of a backward: the cheap check; on a finding, keep what the replay needs."""
        self._queued = False
        if self._pending is not None:
            return
        grads_ok = gradients_finite(self._params)
        if grads_ok and self.scaler is None:
            return
        forward_ok = extremes_finite(self._out_extremes)
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
