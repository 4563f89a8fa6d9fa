"""``hookscope monitor-report RUN_DIR``: draw a ``hookscope.monitor`` run as a PNG."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from hookscope.cli._common import add_parents_argument, add_positional, check_output_path, say
from hookscope.diagnostics import INPUT, OUTSIDE
from hookscope.errors import SpecError
from hookscope.train import draw_records, read_run

__all__ = ["HELP", "add_arguments", "run"]

HELP = ("draw a hookscope.monitor run folder as a PNG: modules x steps heat maps of activation "
        "absmax and zero fraction, gradient norms, the guard's events")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the verb's options to ``parser``."""
    add_positional(parser, "run_dir", "RUN_DIR", "the run_dir given to hookscope.monitor")
    parser.add_argument("--out", type=Path, default=None, metavar="PNG",
                        help="where to write the picture (default RUN_DIR/monitor.png); an "
                             "existing file is replaced only with --overwrite")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out PNG")
    add_parents_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Draw the run; print the picture's path and the guard's findings; exit 1 when it fired."""
    check_output_path(args.out, "--out", parents=args.parents)
    _check_out(args.out, args.overwrite)
    records, events = read_run(args.run_dir)
    path = draw_records(records, events, args.run_dir, args.out)
    fired = [e for e in events if e["event"] == "nonfinite"]
    skipped = sum(e["event"] == "overflow_skipped" for e in events)
    for event in fired:
        print(_finding(event))
    for event in events:
        if event["event"] == "fault":  # the monitor's own work failed; training went on
            lost = f", {event['lost']} record(s) lost" if "lost" in event else ""
            print(f"step {event.get('step')}: the monitor's {event.get('where')} failed "
                  f"({event.get('error')}){lost}")
    if skipped:
        print(f"{skipped} step(s) skipped by the GradScaler (overflow)")
    print(path)
    if fired:
        say(f"{args.run_dir}: the guard fired {len(fired)} time(s)")
    return 1 if fired else 0


def _finding(event: dict[str, Any]) -> str:
    """One line per guard event: where, or why no module is named."""
    where = f"step {event['step']} (rank {event['rank']}): "
    if event["direction"] == "all-reduce":
        return where + "non-finite gradients from another rank's step (DDP all-reduce)"
    if event["module"] is None:
        return where + "non-finite gradients, the replay of the step was finite"
    if event["module"] == INPUT:
        return where + f"the batch input {event['tensor']} is already non-finite (no module made it)"
    if event["class"] == OUTSIDE:
        return where + (f"the loss computed outside the model is non-finite (its {event['tensor']} "
                        f"is; no module made it)")
    op = f", op {event['op']}" if event["op"] is not None else ""
    return (where + f"non-finite {event['direction']} in '{event['module']}' ({event['class']}), "
            f"call {event['call']}{op}, {event['tensor']}")


def _check_out(out: Path | None, overwrite: bool) -> None:
    """A picture the user names is a new ``.png`` file, or an existing regular one replaced on
    purpose (``--overwrite``): ``--out notes.txt`` replaced a user's file with a PNG."""
    if out is None:
        return
    if out.suffix.lower() != ".png":
        raise SpecError(f"--out {out}: the picture is a PNG; give a file name ending in .png")
    if os.path.lexists(out):
        if not out.is_file() or out.is_symlink():
            raise SpecError(f"--out {out} exists and is not a regular file; choose another name")
        if not overwrite:
            raise SpecError(f"--out {out} exists; pass --overwrite to replace it, or choose "
                            f"another name")
