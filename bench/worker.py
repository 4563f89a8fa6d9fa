"""One measurement in one process: ``python -m bench.worker WORKLOAD --mode time|memory ...``.

``--mode time`` runs every case of the workload interleaved and checks each case's kept values
against a reference; ``--mode memory --case I`` measures case ``I`` alone (a fresh process per
case keeps one case's freed memory from hiding another's peak). Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from bench import measure, models, workloads


@contextlib.contextmanager
def grad_mode(name: str) -> Iterator[None]:
    """``torch.inference_mode()`` for ``"inference"``, ``torch.no_grad()`` for ``"no_grad"``."""
    with (torch.inference_mode() if name == "inference" else torch.no_grad()):
        yield


def _error(err: BaseException) -> str:
    last = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    where = f" at {last.filename.split('/src/')[-1]}:{last.lineno}" if last else ""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}{where}"


def run_time(workload: workloads.Workload, runs: int, warmups: int,
             grad: str) -> dict[str, Any]:
    """Time every case of ``workload`` interleaved; check kept values; count kept bytes."""
    errors: dict[str, str] = {}

    def failed(case: Any, err: BaseException) -> None:
        errors[case.name] = _error(err)

    with grad_mode(grad):
        if workload.floor_first:  # the bare forward alone, before any case changes torch
            times = measure.time_interleaved(workload.cases[:1], runs, warmups, failed)
            times.update(measure.time_interleaved(workload.cases[1:], runs, warmups, failed))
        else:
            times = measure.time_interleaved(workload.cases, runs, warmups, failed)
        reference = workload.reference() if workload.reference else None
        checks = {case.name: _check(case, reference) for case in workload.cases
                  if case.name not in errors}
    bare = workload.cases[0].name
    floors = {case.name: case.floor or bare for case in workload.cases}
    summary = measure.summarise(times, floors)
    rows = []
    for case in workload.cases:
        row: dict[str, Any] = {"name": case.name, "tool": case.tool, "floor": floors[case.name],
                               "note": case.note, "meta": case.meta, "times_s": times[case.name]}
        row.update(summary.get(case.name, {}))
        if case.name in errors:
            row["error"] = errors[case.name]
        row.update(checks.get(case.name, {}))
        rows.append(row)
    return {"cases": rows}


def _check(case: Any, reference: Any) -> dict[str, Any]:
    kept = case.run()
    result: dict[str, Any] = {"tensor_mib": measure.tensor_bytes(case.tensors(kept)) / 2**20}
    if reference is not None and case.values is not None:
        result["values"] = measure.check_values(case.values(kept), reference)
    return result


def run_memory(workload: workloads.Workload, index: int, grad: str) -> dict[str, Any]:
    """Measure the peak memory of case ``index`` of ``workload`` in this process."""
    case = workload.cases[index]
    try:
        with grad_mode(grad):
            return {"name": case.name, **measure.peak_rss(case, workload.cases[0])}
    except Exception as err:  # noqa: BLE001 - recorded in the results
        return {"name": case.name, "error": _error(err)}


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    size = models.FULL if args.size == "full" else models.TINY
    with warnings.catch_warnings():  # peers' deprecation notices while they are set up
        warnings.simplefilter("ignore", DeprecationWarning)
        workload = workloads.build(args.workload, size, peers_wanted=not args.no_peers)
    gc.collect()
    gc.freeze()  # the collections between cases then skip the ~400k objects of torch & co.
    result: dict[str, Any] = {"workload": workload.name, "shape": workload.shape,
                              "info": workload.info, "skipped": workload.skipped}
    if args.mode == "time":
        result.update(run_time(workload, args.runs, args.warmups, args.grad_mode))
    elif args.mode == "memory":
        result.update(run_memory(workload, args.case, args.grad_mode))
    else:
        result["cases"] = [case.name for case in workload.cases]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker")
    parser.add_argument("workload", choices=sorted(workloads.WORKLOADS))
    parser.add_argument("--mode", choices=("time", "memory", "list"), default="time")
    parser.add_argument("--case", type=int, default=0, help="case index for --mode memory")
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grad-mode", choices=("inference", "no_grad"), default="inference")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = _measure(args)
    finally:  # leave a calling process (--in-process) as it was
        gc.unfreeze()
        torch.set_num_threads(threads)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
