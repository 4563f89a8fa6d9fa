"""``python -m tests.zoo``: every architecture of transformers' auto mappings through hookscope's
verbs; writes the table to docs/zoo.md (``--out``) and prints the counts.

Options: ``--only SUBSTRING`` (classes whose name contains it), ``--limit N``, ``--out FILE``
(``-`` prints the page instead of writing it), ``--jobs N`` (processes), ``--resume-log LOG``
(repeatable: the cells of previous runs' progress output), ``--reverse`` (last class first).
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.zoo.table import page, resume_from, run_zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo")
    parser.add_argument("--only", default="")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--out", default="docs/zoo.md")
    parser.add_argument("--jobs", type=int, default=1, help="processes (spawned)")
    parser.add_argument("--resume-log", action="append", default=[],
                        help="a previous run's progress output (repeat it for several)")
    parser.add_argument("--reverse", action="store_true",
                        help="run the last class first (a second run from the other end)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    for log in args.resume_log:
        resume_from(log)
    rows = run_zoo(only=args.only, limit=args.limit, progress=True, jobs=args.jobs,
                   reverse=args.reverse)
    text = page(rows, seconds=time.monotonic() - started)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    silent = sum(cell.status in ("silent", "crash") for _, cells in rows for cell in cells.values())
    return 1 if silent else 0


if __name__ == "__main__":
    raise SystemExit(main())
