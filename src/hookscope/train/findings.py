"""The guard's findings: the event a fired step records, its message, whether it is new."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hookscope.diagnostics import NonFiniteOrigin
from hookscope.train.guard import (
    ReplayBundle,
)

__all__ = ["finding_key"]


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
