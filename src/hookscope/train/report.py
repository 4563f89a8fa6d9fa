"""Read a monitor's run folder and draw it: heat maps of modules x steps (absmax and zero
fraction of the activations), gradient norms over steps, and the guard's events."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hookscope.errors import HookscopeError, SpecError
from hookscope.util.figures import new_figure, save_figure


def read_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(records, events)`` of every ``records*.jsonl`` file in ``run_dir`` (all ranks).

    Raises:
        SpecError: ``run_dir`` holds no records file.
        HookscopeError: a line of a records file is not a JSON object (the message names the
            file and the line).
    """
    files = sorted(Path(run_dir).glob("records*.jsonl"))
    if not files:
        raise SpecError(f"{run_dir} holds no records.jsonl: pass the run_dir given to "
                             "hookscope.monitor(..., run_dir=...)")
    lines = [record for file in files for record in _records(file)]
    return [r for r in lines if "event" not in r], [r for r in lines if "event" in r]


def _records(file: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``file``, one a line; a line that is not one names the file and line."""
    records = []
    for number, line in enumerate(file.read_text("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            record = err
        if not isinstance(record, dict):
            raise HookscopeError(f"{file}, line {number}: not a monitor record (a JSON object): "
                                 f"{line[:60]!r}; the file is damaged or not written by "
                                 f"hookscope.monitor: pass the run_dir the monitor wrote")
        records.append(record)
    return records


def draw_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run in ``run_dir`` as a PNG (default ``RUN_DIR/monitor.png``); return its path.

    Panels: absmax of each module's activation (log10) and its zero fraction, modules (rows) x
    sampled steps (columns); each module's gradient norm over the steps (log scale). A red line
    marks each step where the guard fired, a grey tick each step a GradScaler skipped. A run
    recorded with ``monitor(..., hist=N)`` adds a fourth panel: each module's activation
    histogram at the last sampled step (fraction of its values per bin, over its fixed edges).

    Raises:
        HookscopeError: no records file, or no sampled step in it.
        MissingExtraError: matplotlib is not installed.
    """
    records, events = read_run(run_dir)
    if not records:
        raise HookscopeError(f"{run_dir} has no sampled step yet: the monitor writes statistics at "
                             "steps 0, every, 2*every, ... (every=0 writes none)")
    steps = sorted({r["step"] for r in records})
    modules = list(dict.fromkeys(r["module"] for r in records))
    half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else 0.5  # a column per sampled step
    figure = new_figure("hookscope monitor-report")
    hists = {r["module"]: r for r in records if r.get("activation_hist")}  # last one per module
    axes = figure.subplots(1, 4 if hists else 3)
    for ax, (title, value) in zip(axes[:2], (("activation absmax (log10)", _log_absmax),
                                             ("activation zero fraction", _zeros)), strict=True):
        grid = [[math.nan] * len(steps) for _ in modules]
        for r in records:
            grid[modules.index(r["module"])][steps.index(r["step"])] = value(r)
        image = ax.imshow(grid, aspect="auto", interpolation="nearest",
                          extent=(steps[0] - half, steps[-1] + half, len(modules) - 0.5, -0.5))
        figure.colorbar(image, ax=ax)
        ax.set_yticks(range(len(modules)), modules, fontsize=6)
        ax.set_title(title)
        ax.set_xlabel("step")
    for module in modules:
        points = [(r["step"], r["grad_norm"]) for r in records
                  if r["module"] == module and r["grad_norm"]]
        if points:
            axes[2].plot(*zip(*points, strict=True), marker=".", label=module)
    axes[2].set_yscale("log")
    axes[2].legend(fontsize=6)
    axes[2].set_title("gradient norm")
    axes[2].set_xlabel("step")
    if hists:
        _draw_histograms(axes[3], hists)
    for event in events:
        if event["event"] == "nonfinite":
            for ax in axes[:3]:
                ax.axvline(event["step"], color="red", linewidth=1.5)
        elif event["event"] == "overflow_skipped":
            axes[2].axvline(event["step"], color="grey", linewidth=0.5)
    return save_figure(figure, Path(out) if out is not None else Path(run_dir) / "monitor.png")


def _draw_histograms(ax: Any, last: dict[str, dict[str, Any]]) -> None:
    """One step line per module: the fraction of its activation values in each bin."""
    for module, record in last.items():
        h = record["activation_hist"]
        total = sum(h["counts"]) + h["below"] + h["above"] + h["nonfinite"]
        bins = len(h["counts"])
        edges = [h["lo"] + (h["hi"] - h["lo"]) * i / bins for i in range(bins + 1)]
        ax.stairs([c / max(total, 1) for c in h["counts"]], edges,
                  label=f"{module} (step {record['step']})")
    ax.legend(fontsize=6)
    ax.set_title("activation histogram")
    ax.set_xlabel("value")


def _log_absmax(record: dict[str, Any]) -> float:
    activation = record["activation"]
    return math.log10(activation["absmax"]) if activation and activation["absmax"] > 0 else math.nan


def _zeros(record: dict[str, Any]) -> float:
    return record["activation"]["frac_zeros"] if record["activation"] else math.nan
