"""How cases are measured: interleaved wall-clock timing, value checks, and peak memory.

Timing: after ``warmups`` rounds of every case, ``runs`` rounds follow; each round runs every
case once, starting one case later than the round before, so that noise on this 2-core machine
(other jobs, frequency changes) hits all cases alike and no case always follows the same one. The
cyclic garbage collector runs between rounds and is off inside a timed call. A case's time covers
everything its user pays for: setting the capture up, the forward pass, taking it down.

Memory, two figures:
- tensor bytes: the distinct storages behind the kept tensors (exact; views count once);
- RSS: the peak resident set (``VmHWM``) reached during one captured forward, minus the resident
  set just before it, in a process of its own per case (the caller's job), after a warm-up run,
  ``malloc_trim`` and a reset of the peak (``/proc/self/clear_refs``). It includes the forward's
  own transient working set: compare with the bare forward's row. tracemalloc is of no use here:
  torch allocates tensors outside Python's allocator.
"""

from __future__ import annotations

import ctypes
import gc
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.peers import Case, Values, tensor_bytes


def time_interleaved(cases: Sequence[Case], runs: int, warmups: int,
                     on_error: Callable[[Case, BaseException], None]) -> dict[str, list[float]]:
    """Return ``{case name: [seconds per run]}``; a case that raises is dropped after
    ``on_error(case, err)``."""
    live = list(cases)
    times: dict[str, list[float]] = {case.name: [] for case in cases}
    for round_index in range(warmups + runs):
        gc.collect()
        shift = round_index % len(live) if live else 0
        for case in live[shift:] + live[:shift]:
            try:
                seconds = _time_once(case)
            except Exception as err:  # noqa: BLE001 - recorded in the results, run goes on
                on_error(case, err)
                live.remove(case)
                continue
            if round_index >= warmups:
                times[case.name].append(seconds)
    return times


def _time_once(case: Case) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        kept = case.run()
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    del kept
    return seconds


def summarise(times: dict[str, list[float]], floors: dict[str, str]) -> dict[str, dict[str, float]]:
    """Return per case: median seconds, ratio of medians to its floor, and the spread of the
    per-round ratios (each run divided by the floor's run in the same round).

    Args:
        times: ``{case: [seconds per round]}`` from ``time_interleaved``.
        floors: ``{case: name of the bare case it is compared with}``.
    """
    summary: dict[str, dict[str, float]] = {}
    for name, seconds in times.items():
        floor = times.get(floors[name], [])
        if not seconds or not floor:
            continue
        paired = sorted(s / f for s, f in zip(seconds, floor))
        summary[name] = {
            "median_s": statistics.median(seconds),
            "ratio": statistics.median(seconds) / statistics.median(floor),
            "ratio_q1": paired[len(paired) // 4],
            "ratio_q3": paired[(3 * len(paired)) // 4 if len(paired) > 1 else 0],
        }
    return summary


def check_values(kept: Values, reference: Values) -> dict[str, int]:
    """Compare each kept tensor with the reference call of the same path, exactly.

    A float16 capture is compared with the reference cast to float16.

    Returns:
        ``{"checked": number of (path, call) compared, "wrong": how many differ, "refused": how
        many the tool refused to return because they were overwritten in place}``.
    """
    checked = wrong = refused = 0
    for path, calls in kept.items():
        for k, value in enumerate(calls):
            expected = reference.get(path, [])
            if k >= len(expected):
                continue
            checked += 1
            if value is None:
                refused += 1
                continue
            want = expected[k].to(value.dtype)  # type: ignore[union-attr]
            if value.shape != want.shape or not torch.equal(value, want):
                wrong += 1
    return {"checked": checked, "wrong": wrong, "refused": refused}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def peak_rss(case: Case, bare: Case) -> dict[str, Any]:
    """Measure one captured forward's memory in this process (give each case its own process).

    Returns:
        ``{"rss_peak_mib": peak resident set during the run minus before it,
        "rss_kept_mib": resident set after the run (kept records alive) minus before it,
        "tensor_mib": bytes of the kept tensors}``,
        MiB; RSS figures are 0 where ``/proc/self/clear_refs`` cannot reset the peak.
    """
    bare.run()
    kept = case.run()  # warm-up, and hookscope's first (learning) capture
    del kept
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM to the current RSS
        resettable = True
    except OSError:
        resettable = False
    before = _status_kib("VmRSS")
    kept = case.run()
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    result = {"tensor_mib": tensor_bytes(case.tensors(kept)) / 2**20,
              "rss_peak_mib": (peak - before) / 1024 if resettable else 0.0,
              "rss_kept_mib": (after - before) / 1024 if resettable else 0.0}
    del kept
    return result
