"""Read a monitor's run folder and draw it: heat maps of modules x steps (absmax and zero
fraction of the activations), gradient norms over steps, and the guard's events."""

from __future__ import annotations

import bisect
import json
import math
import os
from pathlib import Path
from typing import Any

from hookscope.errors import HookscopeError, SpecError, warn
from hookscope.util import DPI, FIGURE_SIZE_PX, advice, new_figure, read_regular, save_figure

__all__ = ["draw_records", "draw_run", "read_run", "run_figure"]

MAX_RECORDS_BYTES = 2**30  # a records file larger than this (1 GiB) is refused before reading


def read_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(records, events)`` of every ``records*.jsonl`` file in ``run_dir`` (all ranks).

    A run folder is read as a store is: each records file must be a regular file of the folder
    (a FIFO, a folder or a link leading out of it is refused before it is opened) of at most
    ``MAX_RECORDS_BYTES``, and every field is checked for its type before use. A torn last line
    (no newline at its end: the process died, or the disk filled, while writing it) is skipped
    with a warning that says so.

    Raises:
        SpecError: ``run_dir`` holds no records file.
        HookscopeError: a records file cannot be read, or a line of it is not a monitor record
            (the message names the file, the line and the field).
    """
    files = sorted(Path(run_dir).glob("records*.jsonl"))
    if not files:
        raise SpecError(f"{run_dir} holds no records.jsonl: pass the run_dir given to "
                             "hookscope.monitor(..., run_dir=...)")
    lines = [record for file in files for record in _records(file)]
    return [r for r in lines if "event" not in r], [r for r in lines if "event" in r]


def _records(file: Path) -> list[dict[str, Any]]:
    """The checked records of ``file``, one a line (see ``read_run``)."""
    if os.path.dirname(os.path.realpath(file)) != os.path.realpath(file.parent):
        raise HookscopeError(f"{file} is a link leading outside the run folder; hookscope reads "
                             f"only the folder's own files: {_FIX}")
    try:
        text = read_regular(file, max_bytes=MAX_RECORDS_BYTES).decode("utf-8", errors="replace")
    except OSError as err:
        raise HookscopeError(f"cannot read {file}: {advice(err)}; {_FIX}") from err
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline, as every whole record does
    records = [_record(file, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if torn.strip():
        try:
            records.append(_record(file, len(lines) + 1, torn))
        except HookscopeError:
            warn(f"{file}: skipped 1 torn line at its end (line {len(lines) + 1}, no newline: "
                 f"the run stopped while writing it); read the {len(records)} records before it",
                 UserWarning)
    return records


_FIX = "pass the run_dir the monitor wrote (the file is damaged or not written by hookscope.monitor)"
_NUMBER = (int, float)


def _record(file: Path, number: int, line: str) -> dict[str, Any]:
    """Line ``number`` of ``file`` as a record whose fields ``draw_run`` and the CLI read are
    of their types."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as err:
        record = err
    if not isinstance(record, dict):
        raise HookscopeError(f"{file}, line {number}: not a monitor record (a JSON object): "
                             f"{line[:60]!r}; {_FIX}")
    problem = _event_problem(record) if "event" in record else _stats_problem(record)
    if problem:
        raise HookscopeError(f"{file}, line {number}: field {problem}; {_FIX}")
    return record


def _is_step(value: Any) -> bool:
    return type(value) is int and value >= 0


def _stats_problem(record: dict[str, Any]) -> str | None:
    if not _is_step(record.get("step")):
        return "step must be a whole number >= 0"
    if not isinstance(record.get("module"), str):
        return "module must be a module name"
    for kind in ("activation", "gradient"):
        summary = record.get(kind)
        if summary is not None and not (isinstance(summary, dict) and all(
                isinstance(v, _NUMBER) and not isinstance(v, bool) for v in summary.values())
                and {"absmax", "frac_zeros"} <= summary.keys()):
            return f"{kind} must be null or an object of numbers (absmax, frac_zeros, ...)"
    for name in ("grad_norm", "update_ratio"):
        value = record.get(name)
        if value is not None and (not isinstance(value, _NUMBER) or isinstance(value, bool)):
            return f"{name} must be null or a number"
    return None


def _event_problem(record: dict[str, Any]) -> str | None:
    if not isinstance(record["event"], str):
        return "event must be a string"
    if record["event"] in ("nonfinite", "overflow_skipped", "fault") and \
            not _is_step(record.get("step")):
        return "step must be a whole number >= 0"
    if record["event"] == "nonfinite":
        for key in ("rank", "module", "direction", "tensor", "op", "bundle", "class"):
            if key not in record:
                return f"{key} is missing"
        if not all(record[k] is None or isinstance(record[k], str)
                   for k in ("module", "direction", "tensor", "op", "bundle")):
            return "module, direction, tensor, op and bundle must be null or strings"
    return None


def draw_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run in ``run_dir`` as a PNG (default ``RUN_DIR/monitor.png``); return its path.

    Panels (``run_figure``): absmax of each module's activation (log10) and its zero fraction,
    modules (rows) x sampled steps (columns); each module's gradient norm over the steps (log
    scale). A red line marks each step where the guard fired, a grey one each step a GradScaler
    skipped. A run recorded with ``monitor(..., hist=N)`` adds a fourth panel: each module's
    activation histogram at the last sampled step (fraction of its values per bin, over its
    fixed edges).

    Raises:
        HookscopeError: no records file, or no sampled step in it.
        MissingExtraError: matplotlib is not installed.
    """
    return draw_records(*read_run(run_dir), run_dir, out)


def draw_records(records: list[dict[str, Any]], events: list[dict[str, Any]],
                 run_dir: str | Path, out: str | Path | None = None) -> Path:
    """``draw_run`` of what ``read_run(run_dir)`` returned (the CLI reads the folder once)."""
    if not records:
        raise HookscopeError(f"{run_dir} has no sampled step yet: the monitor writes statistics at "
                             "steps 0, every, 2*every, ... (every=0 writes none)")
    return save_figure(run_figure(records, events),
                       Path(out) if out is not None else Path(run_dir) / "monitor.png")


def run_figure(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> Any:
    """The figure ``draw_run`` writes, of ``read_run``'s records (at least one) and events.

    The heat maps have one column per sampled step (labelled with the step), so a guard line
    lies on its own step's column, between the columns of the sampled steps around it, or
    after the last column: never inside another step's column. Module names are drawn as large
    as their rows allow (6 to 11 pt). A gradient norm that is not finite (a step the GradScaler
    skipped: its gradients overflowed) is left out, so each module's line goes on past it; the
    grey line and the legend mark the step.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    steps = sorted({r["step"] for r in records})
    modules = list(dict.fromkeys(r["module"] for r in records))
    figure = new_figure("hookscope monitor-report")
    figure.set_layout_engine("constrained")  # module names of any length stay clear of the bars
    hists = {r["module"]: r for r in records if r.get("activation_hist")}  # last one per module
    axes = figure.subplots(1, 4 if hists else 3)
    fired = sorted({e["step"] for e in events if e["event"] == "nonfinite"})
    skipped = sorted({e["step"] for e in events if e["event"] == "overflow_skipped"})
    for ax, (title, value) in zip(axes[:2], (("activation absmax (log10)", _log_absmax),
                                             ("activation zero fraction", _zeros)), strict=True):
        _heat_map(figure, ax, title, records, steps, modules, value, fired)
    _gradient_norms(axes[2], records, modules, fired, skipped)
    if hists:
        _draw_histograms(axes[3], hists)
    return figure


def _heat_map(figure: Any, ax: Any, title: str, records: list[dict[str, Any]], steps: list[int],
              modules: list[str], value: Any, fired: list[int]) -> None:
    """Modules x sampled steps of ``value(record)``, a column per step; the guard's lines."""
    grid = [[math.nan] * len(steps) for _ in modules]
    for r in records:
        grid[modules.index(r["module"])][steps.index(r["step"])] = value(r)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest")
    figure.colorbar(image, ax=ax)
    rows_pt = 0.6 * FIGURE_SIZE_PX[1] / len(modules) * 72 / DPI  # a row's height in points
    ax.set_yticks(range(len(modules)), modules, fontsize=max(6.0, min(11.0, 0.8 * rows_pt)))
    shown = range(0, len(steps), -(-len(steps) // 12))  # at most 12 step labels
    ax.set_xticks(list(shown), [str(steps[i]) for i in shown])
    right = len(steps) - 0.5
    for step in fired:
        x = _column_x(steps, step)
        right = max(right, x + 0.25)
        ax.axvline(x, color="red", linewidth=1.5)
    ax.set_xlim(-0.5, right)
    ax.set_title(title)
    ax.set_xlabel("sampled step")


def _column_x(steps: list[int], step: int) -> float:
    """Where ``step`` lies on a heat map whose column ``i`` is sampled step ``steps[i]``: on
    its column, on the edge between the columns around it, or a quarter column past the last."""
    i = bisect.bisect_left(steps, step)
    if i < len(steps) and steps[i] == step:
        return float(i)
    return i - 0.5 if i < len(steps) else len(steps) - 0.25


def _gradient_norms(ax: Any, records: list[dict[str, Any]], modules: list[str],
                    fired: list[int], skipped: list[int]) -> None:
    """Each module's finite gradient norms over the steps (log scale); the events' lines."""
    for module in modules:
        points = [(r["step"], r["grad_norm"]) for r in records if r["module"] == module
                  and r["grad_norm"] is not None and math.isfinite(r["grad_norm"])
                  and r["grad_norm"] > 0]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=module)
    for steps, color, width, label in ((fired, "red", 1.5, "guard fired"),
                                       (skipped, "grey", 0.5,
                                        "step skipped by the GradScaler (overflow)")):
        for k, step in enumerate(steps):
            ax.axvline(step, color=color, linewidth=width, label=label if k == 0 else "_nolegend_")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("gradient norm")
    ax.set_xlabel("step")


def _draw_histograms(ax: Any, last: dict[str, dict[str, Any]]) -> None:
    """One step line per module: the fraction of its activation values in each bin."""
    for module, record in last.items():
        h = record["activation_hist"]
        total = sum(h["counts"]) + h["below"] + h["above"] + h["nonfinite"]
        bins = len(h["counts"])
        edges = [h["lo"] + (h["hi"] - h["lo"]) * i / bins for i in range(bins + 1)]
        ax.stairs([c / max(total, 1) for c in h["counts"]], edges,
                  label=f"{module} (step {record['step']})")
    ax.legend(fontsize=8)
    ax.set_title("activation histogram")
    ax.set_xlabel("value")


def _log_absmax(record: dict[str, Any]) -> float:
    activation = record["activation"]
    return math.log10(activation["absmax"]) if activation and activation["absmax"] > 0 else math.nan


def _zeros(record: dict[str, Any]) -> float:
    return record["activation"]["frac_zeros"] if record["activation"] else math.nan
