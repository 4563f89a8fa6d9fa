"""``hookscope.monitor``: statistics every N optimizer steps and a NaN guard on every step.

What runs when:

- **every forward** of the root module: a forward-pre hook keeps references to the inputs and
  a copy of the CPU/CUDA RNG states (a few KB); with the guard on, a forward hook puts a
  gradient hook on each floating-point output tensor. No other module is hooked.
- **every backward** (guard on): the first output gradient queues one callback at the end of
  the backward (``engine.hooks.after_backward``): one fused norm of all gradients and one host
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
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

import torch
from torch import nn

from hookscope.diagnostics.nonfinite import NonFiniteOrigin
from hookscope.diagnostics.stats import RunningStats
from hookscope.engine.checks import check_run_dir
from hookscope.engine.hooks import after_backward, on_optimizer_step, on_tensor_grad
from hookscope.engine.run import detached_clones, input_device, state_snapshot
from hookscope.engine.select import Target, as_patterns, unwrap
from hookscope.engine.session import Observer, resolve_checked
from hookscope.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    HookscopeError,
    NonFiniteStepError,
    NonFiniteStepWarning,
    warn,
)
from hookscope.train.guard import (
    ReplayBundle,
    StepInputs,
    drop_gradients,
    grad_outputs,
    gradients_finite,
    replay,
)
from hookscope.util.nested import get_part, iter_tensors

Tensor = torch.Tensor
GuardMode = Literal["raise", "warn", "skip"]
STATS = ("mean", "std", "absmax", "frac_zeros", "frac_nonfinite", "count")


def monitor(model: nn.Module, layers: str | list[str] = "**", *, every: int = 100,
            optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
            run_dir: str | Path | None = None, guard: GuardMode | None = "raise",
            writer: Any = None) -> Monitor:
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
    (elements), float64 as in ``hookscope.stats``; and of its
    parameters: ``grad_norm`` (L2 over all ``.grad``, read at the end of the step) and
    ``update_ratio`` = ||W_after - W_before|| / ||W_before|| (L2 over all its parameters).

    The guard (every backward, see the module docstring) detects the first non-finite gradient
    (or, with ``scaler``, a non-finite output: gradient overflows there are the scaler's and
    are only counted in ``overflows``). It then replays the step with ``find_nonfinite`` and
    names the step, module, call, direction (forward/backward), op and tensor; the replay bundle
    is written to ``RUN_DIR/nonfinite-step-<N>.pt`` for ``hookscope.replay(path, model)``.

    DDP under ``torchrun``: each rank guards its own step (its own gradients, checked at the end
    of its backward, before DDP's all-reduce writes the averaged ones) and writes its own files
    (``records-rank<R>.jsonl``, ``nonfinite-step-<N>-rank<R>.pt``); messages and events carry
    the rank. Before ``optimizer.step`` every rank checks the all-reduced gradients once more
    (one fused norm): a rank whose own step was finite reports ``direction="all-reduce"``
    (another rank's step was not; that rank names the module) and raises, warns or skips too.

    ``torch.compile``: the hooks are on ``compiled._orig_mod``'s modules and dynamo traces
    them into the compiled calls (with graph breaks where a hook reads a value on the host:
    the guard's RNG copy, the statistics' counters), so records and the guard's finding equal
    the eager model's, whether the monitor opens before or after the first compiled call
    (torch 2.13; ``test_compiled_model_is_watched_through_orig_mod``). What it costs: the
    compiled step runs in pieces while the hooks exist, a sampled step's hooks come and go
    (a recompile each time, up to dynamo's recompile limit, then that frame runs eagerly),
    and ``fullgraph=True`` cannot hold a graph break (dynamo raises). The replay runs eagerly
    on a copy of ``_orig_mod``.

    Args:
        model: the root module being trained (``DataParallel``/DDP wrappers are looked
            through, and ``torch.compile``'s: a compiled model's ``_orig_mod`` is watched, see
            the note below).
        layers: ``hookscope.select`` patterns of the modules to take statistics of.
        every: take statistics at steps 0, every, 2*every, ...; 0: none (guard only).
        optimizer: hook its ``step()``: steps are counted, and a fired guard acts before the
            weights change. Not with ``scaler`` (skipped steps never call it).
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

    Raises:
        ArgumentTypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, ``scaler`` lacks a
            GradScaler's ``scale``/``update``/``get_scale``, ``run_dir`` is not a path (at the call).
        ArgumentValueError: ``every`` < 0, an unknown ``guard``, ``run_dir`` is an existing
            file (at the call).
        HookscopeError: both ``optimizer`` and ``scaler``, or ``run_dir`` already holds a run
            (on entry; a failed entry removes every hook it registered).
        SelectorError: a pattern matches no module.
    """
    return Monitor(model, layers, every=every, optimizer=optimizer, scaler=scaler,
                   run_dir=run_dir, guard=guard, writer=writer)


class Monitor:
    """A running ``hookscope.monitor`` (see there for the arguments).

    Attributes:
        step_index: the step in progress (0-based).
        overflows: steps a GradScaler skipped for non-finite gradients (with ``scaler``).
        latest: ``{module: record}`` of the last sampled step.
        events: the guard's findings, as written to the records file.
        records_file: the JSON Lines file, or None.
    """

    def __init__(self, model: nn.Module, layers: str | list[str], *, every: int,
                 optimizer: torch.optim.Optimizer | None, scaler: Any, run_dir: str | Path | None,
                 guard: GuardMode | None, writer: Any):
        _check_arguments(every, optimizer, scaler, guard)
        check_run_dir("run_dir", run_dir)
        self.root, _ = unwrap(model)
        self.every, self.guard, self.scaler, self.writer = every, guard, scaler, writer
        self._optimizer = optimizer
        self.targets = resolve_checked(self.root, as_patterns(layers))[0] if every else []
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
        self._out_grads: list[Tensor | None] = []
        self._out_sum: Tensor | None = None
        self._queued = False
        self._overflowed = False
        self._pending: ReplayBundle | None = None
        self._sample: _Sample | None = None
        self._file: IO[str] | None = None
        self._root_session: Observer | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> Monitor:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try: self.close()  # noqa: E701 - one line (engine.interrupts)
        except BaseException:
            self.close()  # idempotent: what an exception (Ctrl-C) halfway through left
            raise

    def open(self) -> Monitor:
        """Start watching (hooks, records file); return self.

        Raises:
            HookscopeError: already open, or ``run_dir`` holds a records file already.
        """
        if self._root_session is not None:
            raise HookscopeError("this monitor is already open: open it once, or build a new one")
        try: self._start(); return self  # noqa: E701, E702 - one line (engine.interrupts)
        except BaseException:
            self.close()  # nothing it registered or opened outlives a failed open
            raise

    def _start(self) -> None:
        self._file = self._open_file()
        self._write({"event": "start", "rank": self.rank, "every": self.every,
                     "modules": [t.key for t in self.targets], "guard": self.guard})
        root = Target("", self.root)
        self._root_session = Observer(self.root, [root], pre=lambda t: self._forward_begins,
                                      forward=lambda t: self._forward_ends, with_kwargs=True,
                                      explain_unfired=False)
        self._root_session.__enter__()
        if self._optimizer is not None:
            # one at a time: a failure on the second still leaves the first to close()
            self._handles.append(on_optimizer_step(self._optimizer, self._before_update, pre=True))
            self._handles.append(on_optimizer_step(self._optimizer, self._end_step, pre=False))
        self._start_sample_if_due()

    def close(self) -> None:
        """Stop watching: replay a guard still pending (it may raise), then remove every hook,
        end a sampled step without writing it, and close the records file."""
        try:
            self._resolve_pending()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if self._sample is not None:
                self._sample.session.__exit__(None, None, None)
                self._sample = None
            if self._root_session is not None:
                self._root_session.__exit__(None, None, None)
                self._root_session = None
            if self._file is not None:
                self._file.close()
                self._file = None

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
        if self._sample is not None:
            self._finish_sample(self._sample)
            self._sample = None
        if self._overflowed:
            self.overflows += 1
            self._write({"event": "overflow_skipped", "step": self.step_index, "rank": self.rank,
                         "scale": float(self.scaler.get_scale())})
            self._overflowed = False
        self.step_index += 1
        self._start_sample_if_due()
        if self._file is not None:
            self._file.flush()

    # -- the guard ---------------------------------------------------------------------------

    def _forward_begins(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.guard is not None:  # only a replay needs the step's inputs and RNG
            self._inputs = StepInputs.now(args, kwargs, self._device_type)

    def _forward_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.guard is None:
            return
        tensors = grad_outputs(output)
        grads: list[Tensor | None] = [None] * len(tensors)
        self._out_grads = grads
        for i, tensor in enumerate(tensors):
            on_tensor_grad(tensor, self._grad_catcher(grads, i))
        if self.scaler is not None and tensors:
            self._out_sum = torch.stack([t.detach().float().sum() for t in tensors])

    def _grad_catcher(self, grads: list[Tensor | None], i: int) -> Any:
        def hook(grad: Tensor) -> None:
            grads[i] = grad
            if not self._queued:
                self._queued = True
                after_backward(self._check)
        return hook

    def _check(self) -> None:
        """End of a backward: the cheap check; on a finding, keep what the replay needs."""
        self._queued = False
        if self._pending is not None:
            return
        grads_ok = gradients_finite(self._params)
        forward_ok = self._out_sum is None or bool(torch.isfinite(self._out_sum).all())
        if grads_ok and forward_ok:
            return
        if self.scaler is not None and forward_ok:  # the scaler skips this step on purpose
            self._overflowed = True
            return
        assert self._inputs is not None  # a backward through the root's output follows a forward
        self._pending = ReplayBundle(self.step_index, self.rank, self._inputs,
                                     list(self._out_grads), state_snapshot(self.root))
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
        elif self.world > 1 and self.guard is not None and not gradients_finite(self._params):
            if self.scaler is not None:  # the scaler skips this step on every rank
                self._overflowed = True
                return
            event = {"event": "nonfinite", "step": self.step_index, "rank": self.rank,
                     "module": None, "class": None, "call": None, "direction": "all-reduce",
                     "op": None, "tensor": None, "bundle": None}
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
        origin = replay(bundle, copy.deepcopy(self.root))
        path = None
        if self.run_dir is not None:
            suffix = f"-rank{self.rank}" if self.records_file and "rank" in self.records_file.name else ""
            path = bundle.save(self.run_dir / f"nonfinite-step-{bundle.step}{suffix}.pt")
        event = _event(bundle, origin, path)
        self.events.append(event)
        self._write(event)
        self._alarm(_message(bundle, origin, path, self.latest.get(event["module"] or "")),
                    origin, bundle.step, path)

    def _alarm(self, message: str, origin: NonFiniteOrigin | None, step: int, path: Path | None) -> None:
        if self.guard == "raise":
            error = NonFiniteStepError(message)
            error.origin, error.step, error.bundle = origin, step, path  # type: ignore[attr-defined]
            raise error
        warn(message, NonFiniteStepWarning)

    # -- sampled steps -----------------------------------------------------------------------

    def _start_sample_if_due(self) -> None:
        if self.every and self.step_index % self.every == 0:
            self._sample = _Sample(self.root, self.targets)
            self._sample.session.__enter__()  # held first: close() exits it, whatever happens

    def _finish_sample(self, sample: _Sample) -> None:
        sample.session.__exit__(None, None, None)
        for target in self.targets:
            record = sample.record(target, self.step_index, self.rank)
            self.latest[target.key] = record
            self._write(record)
            if self.writer is not None:
                _to_tensorboard(self.writer, record)

    # -- the records file --------------------------------------------------------------------

    def _open_file(self) -> IO[str] | None:
        if self.records_file is None:
            return None
        self.records_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self.records_file.open("x", encoding="utf-8")
        except FileExistsError:
            raise HookscopeError(f"{self.records_file} exists: each run writes its own folder; "
                                 "pass a new run_dir (or delete the old run)") from None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")


class _Sample:
    """One sampled step: hooks on the selected modules and the weights they started with."""

    def __init__(self, root: nn.Module, targets: list[Target]):
        self.activations = {t.key: RunningStats() for t in targets}
        self.gradients = {t.key: RunningStats() for t in targets}
        self.before = {t.key: detached_clones(t.module.parameters()) for t in targets}
        self.session = Observer(root, targets, forward=self._hook, explain_unfired=False)

    def _hook(self, target: Target) -> Any:
        activations, gradients = self.activations[target.key], self.gradients[target.key]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensor = next((t for t in iter_tensors(get_part(output, target.parts))
                           if t.is_floating_point()), None)
            if tensor is None:
                return
            activations.update(tensor)
            if tensor.requires_grad:
                on_tensor_grad(tensor, gradients.update)
        return hook

    def record(self, target: Target, step: int, rank: int) -> dict[str, Any]:
        """The JSON record of ``target`` for this step."""
        params = list(target.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return {"step": step, "rank": rank, "module": target.key,
                "activation": _summary(self.activations[target.key]),
                "gradient": _summary(self.gradients[target.key]),
                "grad_norm": float(torch.nn.utils.get_total_norm(grads)) if grads else None,
                "update_ratio": _update_ratio(self.before[target.key], params)}


def _summary(stats: RunningStats) -> dict[str, float] | None:
    """``hookscope.stats``' numbers with ``absmax`` = max(|min|, |max|); None when nothing ran."""
    values = stats.as_dict()
    if values["count"] == 0:
        return None
    values["absmax"] = max(abs(values["min"]), abs(values["max"]))
    return {key: values[key] for key in STATS}


def _update_ratio(before: list[Tensor], params: list[nn.Parameter]) -> float | None:
    """||W_after - W_before|| / ||W_before|| over all of a module's parameters (float64)."""
    if not params:
        return None
    delta = sum(float((p.detach().double() - b.double()).square().sum())
                for p, b in zip(params, before, strict=True))
    size = sum(float(b.double().square().sum()) for b in before)
    return math.sqrt(delta) / math.sqrt(size) if size > 0 else math.inf if delta > 0 else 0.0


def _to_tensorboard(writer: Any, record: dict[str, Any]) -> None:
    for kind in ("activation", "gradient"):
        for stat, value in (record[kind] or {}).items():
            writer.add_scalar(f"{record['module']}/{kind}/{stat}", value, record["step"])
    for name in ("grad_norm", "update_ratio"):
        if record[name] is not None:
            writer.add_scalar(f"{record['module']}/{name}", record[name], record["step"])


def _event(bundle: ReplayBundle, origin: NonFiniteOrigin | None, path: Path | None) -> dict[str, Any]:
    where: dict[str, Any] = {"module": None, "class": None, "call": None, "direction": None,
                             "op": None, "tensor": None}
    if origin is not None:
        where = {"module": origin.path, "class": origin.class_name, "call": origin.call_index,
                 "direction": origin.phase, "op": origin.op, "tensor": origin.bad_label}
    return {"event": "nonfinite", "step": bundle.step, "rank": bundle.rank, **where,
            "bundle": str(path) if path is not None else None}


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
        raise ArgumentValueError(f"every={every!r}: pass a whole number of steps >= 0 (0: no statistics)")
    if guard not in ("raise", "warn", "skip", None):
        raise ArgumentValueError(f"guard={guard!r} is not one of 'raise', 'warn', 'skip', None")
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


def _rank() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
