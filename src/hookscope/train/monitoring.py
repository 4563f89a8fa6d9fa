"""``hookscope.monitor``: statistics every N optimizer steps, with a NaN guard on every step.

What runs when:

- **every forward** of the root module: with the guard on, a forward-pre hook keeps
  references to the inputs and a copy of the CPU/CUDA RNG states (a few KB), and a forward
  hook puts a gradient hook on each floating-point output tensor; on a sampled step the
  pre-hook also reads the attention mask. No other module is hooked.
- **every backward** (guard on): the first output gradient (a pre-hook of the output's
  autograd node, ``engine.door.tables.on_output_grad``) queues one callback at the end of the
  backward (``engine.door.tables.after_backward``): one ``torch._foreach_norm`` of all
  gradients, the sum of those norms and one host sync (``guard.gradients_finite``); the
  outputs' finiteness is an ``aminmax`` per output taken at the forward, read only on a finding
  or under a scaler. When it is not finite the weights are copied and the step
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

from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.train.watcher import GuardMode, Monitor

__all__ = ["monitor"]


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
    ``module.parameters()``, each tensor flattened and joined into one vector, sums of squares
    in float64, ``p_after - p_before`` in the parameter's dtype):
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
