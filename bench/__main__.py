"""``python -m bench``: run every benchmark case and write bench/RESULTS.md and results.json.

Each workload is timed in a process of its own (torchlens's cases too, since it leaves torch
functions wrapped), and each case's memory in yet another process. The processes run in the
benchmark's environment ``.venv-bench`` (peers pinned in bench/requirements-peers.txt), which is
created on first use or with ``--setup``. ``--quick`` runs the same code on tiny models in
seconds (the smoke test uses it with ``--in-process --no-peers``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import env, report, workloads

TORCHLENS = ("gpt2-torchlens", "resnet-torchlens")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="store_true",
                        help="create or update .venv-bench with the pinned peers, then stop")
    parser.add_argument("--no-setup", action="store_true",
                        help="never install; without a current .venv-bench use this interpreter")
    parser.add_argument("--python", help="interpreter for the measuring processes")
    parser.add_argument("--only", nargs="+", choices=[*workloads.WORKLOADS, "dispatch"],
                        help="run only these workloads")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, 3 rounds: checks that everything runs, in seconds")
    parser.add_argument("--runs", type=int, help="timed rounds per case (default 9; quick 3)")
    parser.add_argument("--warmups", type=int, help="warm-up rounds (default 2; quick 1)")
    parser.add_argument("--torchlens-runs", type=int, help="timed rounds for torchlens (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--grad-mode", choices=("inference", "no_grad"), default="inference")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="run the whole comparison K times: each goal's figure pools the "
                             "per-round ratios of every run and reports the spread of the runs' "
                             "medians; memory is measured in the last run only (default 1)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case RSS processes")
    parser.add_argument("--no-peers", action="store_true", help="hookscope and plain hooks only")
    parser.add_argument("--in-process", action="store_true",
                        help="measure in this process (RSS figures then include earlier cases)")
    parser.add_argument("--note", action="append", default=[], help="a line for RESULTS.md's notes")
    parser.add_argument("--out", default=str(env.ROOT / "bench"),
                        help="folder for RESULTS.md and results.json (default bench/)")
    return parser


def _interpreter(args: argparse.Namespace) -> str:
    if args.python:
        return str(args.python)
    if env.is_current():
        return str(env.python())
    if args.no_setup or args.in_process:
        return sys.executable
    return str(env.setup())


def _worker(args: argparse.Namespace, interpreter: str, module: str, argv: list[str]) -> dict[str, Any]:
    """Run ``python -m module argv --out FILE`` (in this process with --in-process); return
    the JSON it wrote, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.json")
        full = [*argv, "--json" if module == "bench.dispatch" else "--out", out]
        if args.in_process:
            from bench import dispatch, worker

            (dispatch.main if module == "bench.dispatch" else worker.main)(full)
        else:
            done = subprocess.run([interpreter, "-m", module, *full], cwd=env.ROOT,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
                return {"error": f"{module} exited {done.returncode}: {tail[0]}"}
            if module == "bench.dispatch":
                print(done.stdout, end="", file=sys.stderr)
        result = dict(json.loads(Path(out).read_text()))
        return result


def _common(args: argparse.Namespace) -> list[str]:
    argv = ["--threads", str(args.threads), "--grad-mode", args.grad_mode]
    argv += ["--size", "tiny"] if args.quick else []
    return argv + (["--no-peers"] if args.no_peers else [])


def _run_workload(args: argparse.Namespace, interpreter: str, name: str, memory: bool) -> dict[str, Any]:
    title = workloads.WORKLOADS[name]
    runs = args.runs or (3 if args.quick else 9)
    if name in TORCHLENS:
        runs = args.torchlens_runs or (1 if args.quick else 3)
    warmups = args.warmups if args.warmups is not None else (1 if args.quick else 2)
    say(f"{name}: timing, {runs} rounds")
    result = _worker(args, interpreter, "bench.worker",
                     [name, "--mode", "time", "--runs", str(runs), "--warmups",
                      str(min(warmups, 1) if name in TORCHLENS else warmups), *_common(args)])
    result.update(workload=name, title=title)
    if "error" in result or not memory:
        return result
    for index, case in enumerate(result["cases"]):
        say(f"{name}: memory of '{case['name']}'")
        memory = _worker(args, interpreter, "bench.worker",
                         [name, "--mode", "memory", "--case", str(index), *_common(args)])
        case["memory"] = {k: v for k, v in memory.items()
                          if k in ("rss_peak_mib", "rss_kept_mib", "error")}
    return result


def _dispatch(args: argparse.Namespace, interpreter: str) -> dict[str, Any]:
    say("dispatch")
    quick = ["--layers", "20", "--forwards", "5", "--runs", "3", "--warmups", "1"]
    return _worker(args, interpreter, "bench.dispatch",
                   [*(quick if args.quick else []), "--threads", str(args.threads),
                    "--grad-mode", args.grad_mode])


def say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        memory_kib = 0
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_kib / 2**20,
            "platform": platform.platform()}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _write(results: dict[str, Any], out: Path) -> None:
    if results.get("dispatch") and "error" not in results["dispatch"]:
        from bench.dispatch import format_result

        results["dispatch"]["text"] = format_result(results["dispatch"])
    results["load"]["after"] = _load()
    results["goals"] = report.goals(results["runs"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "RESULTS.md").write_text(report.markdown(results))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.setup:
        say(f"environment ready: {env.setup()}")
        return 0
    interpreter = _interpreter(args)
    names = args.only or [*workloads.WORKLOADS, "dispatch"]
    if args.no_peers:
        names = [n for n in names if n not in TORCHLENS]
    names.sort(key=lambda n: n in TORCHLENS)  # torchlens wraps torch: last when in-process
    results: dict[str, Any] = {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": _machine(), "versions": env.versions(interpreter), "load": {"before": _load()},
        "settings": {"threads": args.threads, "grad_mode": args.grad_mode,
                     "runs": args.runs or (3 if args.quick else 9),
                     "warmups": args.warmups if args.warmups is not None else (1 if args.quick else 2),
                     "torchlens_runs": args.torchlens_runs or (1 if args.quick else 3),
                     "size": "tiny (--quick)" if args.quick else "full (see titles)",
                     "interpreter": interpreter, "in_process": args.in_process},
        "workloads": [], "runs": [], "notes": list(args.note)}
    for repeat in range(args.repeat):
        if args.repeat > 1:
            say(f"run {repeat + 1} of {args.repeat}")
        run: dict[str, Any] = {"workloads": []}
        results["runs"].append(run)
        results["workloads"] = run["workloads"]  # the tables show the last run
        for name in names:
            if name == "dispatch":
                results["dispatch"] = run["dispatch"] = _dispatch(args, interpreter)
            else:
                # memory once, in the last run: RSS does not need repeats to be trusted
                memory = not args.no_memory and repeat == args.repeat - 1
                run["workloads"].append(_run_workload(args, interpreter, name, memory))
            _write(results, Path(args.out))  # after each workload: a long run shows progress
    say(f"wrote {Path(args.out) / 'RESULTS.md'} and {Path(args.out) / 'results.json'}")
    for goal in results["goals"]:
        say(f"goal {'met' if goal['met'] else 'NOT met' if goal['met'] is False else 'n/a'}: "
            f"{goal['goal']}: {goal['value']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
