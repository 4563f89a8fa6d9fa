"""``python -m bench``: run every benchmark case and write bench/RESULTS.md and results.json.

Each workload is timed in a process of its own (torchlens's cases too, since it leaves torch
functions wrapped), and each case's memory in yet another process. The processes run in the
benchmark's environment ``.venv-bench`` (peers pinned in bench/requirements-peers.txt), which is
created on first use or with ``--setup``. ``--quick`` runs the same code on tiny models in
seconds (the smoke test uses it with ``--in-process --no-peers``).

Besides the workloads, three sections of their own: ``dispatch`` (``bench.dispatch``),
``compiled`` (``bench.compiled``: capture inside ``torch.compile``) and ``throughput``
(``bench.throughput``: the store against the same disk). ``--only NAME...`` measures some of
them and, when the output folder already holds a ``results.json``, merges them into it (each
measured section replaces the one of the same name in every run it was measured in; the merge
is listed in RESULTS.md), so one section can be regenerated without the rest. ``--render``
rewrites RESULTS.md from results.json (after a change of ``bench/report.py``).
"""

from __future__ import annotations

import argparse
import copy
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
#: sections measured by a module of their own (not bench.worker): name -> module
SECTIONS = {"dispatch": "bench.dispatch", "compiled": "bench.compiled", "throughput": "bench.throughput"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="store_true",
                        help="create or update .venv-bench with the pinned peers, then stop")
    parser.add_argument("--no-setup", action="store_true",
                        help="never install; without a current .venv-bench use this interpreter")
    parser.add_argument("--python", help="interpreter for the measuring processes")
    parser.add_argument("--only", nargs="+", choices=[*workloads.WORKLOADS, *SECTIONS],
                        help="run only these workloads or sections; merged into an existing "
                             "results.json in --out")
    parser.add_argument("--render", action="store_true",
                        help="rewrite RESULTS.md from the results.json in --out, then stop")
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
        full = [*argv, "--out" if module == "bench.worker" else "--json", out]
        if args.in_process:
            import importlib

            importlib.import_module(module).main(full)
        else:
            done = subprocess.run([interpreter, "-m", module, *full], cwd=env.ROOT,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
                return {"error": f"{module} exited {done.returncode}: {tail[0]}"}
            if module != "bench.worker":
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


def _section(args: argparse.Namespace, interpreter: str, name: str) -> dict[str, Any]:
    """Run the section ``name`` of ``SECTIONS`` (in a process of its own); return its JSON."""
    say(name)
    threads = ["--threads", str(args.threads)]
    argv = {"dispatch": [*(["--layers", "20", "--forwards", "5", "--runs", "3", "--warmups", "1"]
                           if args.quick else []), *threads, "--grad-mode", args.grad_mode],
            "compiled": [*(["--quick", "--runs", "2", "--backend", "eager"] if args.quick else
                           ["--runs", str(args.runs or 9)]), *threads],
            "throughput": ["--mib", "2" if args.quick else "256", "--rounds", "2" if args.quick else "5",
                           "--places", "local", "memory",
                           "s3"]}[name]
    return _worker(args, interpreter, SECTIONS[name], argv)


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
    for key in SECTIONS:  # the tables show the last run that measured each section
        measured = [run[key] for run in results["runs"] if key in run]
        if measured:
            results[key] = measured[-1]
    if results.get("dispatch") and "error" not in results["dispatch"]:
        from bench.dispatch import format_result

        results["dispatch"]["text"] = format_result(results["dispatch"])
    results["goals"] = report.goals(results["runs"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "RESULTS.md").write_text(report.markdown(results))


def _merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` (an ``--only`` run) merged into ``old`` (a results.json): each section measured in
    ``new``'s run i replaces the one of the same name in ``old``'s run i (a workload by its name)."""
    for index, run in enumerate(new["runs"]):
        if index == len(old["runs"]):
            old["runs"].append({"workloads": []})
        kept = old["runs"][index]
        for key in SECTIONS:
            if key in run:
                kept[key] = run[key]
        measured = {w["workload"] for w in run["workloads"]}
        kept["workloads"] = [w for w in kept["workloads"] if w["workload"] not in measured]
        kept["workloads"] += run["workloads"]
    old["workloads"] = old["runs"][-1]["workloads"]
    old.setdefault("merged", []).append(
        {"generated": new["generated"], "command": new["command"], "load": new["load"]})
    old["notes"] = [*old.get("notes", []), *new["notes"]]
    return old


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.setup:
        say(f"environment ready: {env.setup()}")
        return 0
    if args.render:
        results = json.loads((Path(args.out) / "results.json").read_text())
        _write(results, Path(args.out))
        return 0
    interpreter = _interpreter(args)
    names = args.only or [*workloads.WORKLOADS, *SECTIONS]
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
    existing = Path(args.out) / "results.json"
    previous = json.loads(existing.read_text()) if args.only and existing.exists() else None
    for repeat in range(args.repeat):
        if args.repeat > 1:
            say(f"run {repeat + 1} of {args.repeat}")
        run: dict[str, Any] = {"workloads": []}
        results["runs"].append(run)
        results["workloads"] = run["workloads"]  # the tables show the last run
        for name in names:
            if name in SECTIONS:
                results[name] = run[name] = _section(args, interpreter, name)
            else:
                # memory once, in the last run: RSS does not need repeats to be trusted
                memory = not args.no_memory and repeat == args.repeat - 1
                run["workloads"].append(_run_workload(args, interpreter, name, memory))
            results["load"]["after"] = _load()
            # after each workload, merged into the earlier results.json: a long run shows
            # progress, and an interrupted one loses nothing measured before
            _write(results if previous is None else _merge(copy.deepcopy(previous), results),
                   Path(args.out))
    if previous is not None:
        results = _merge(previous, results)
        _write(results, Path(args.out))
    say(f"wrote {Path(args.out) / 'RESULTS.md'} and {Path(args.out) / 'results.json'}")
    for goal in results["goals"]:
        say(f"goal {'met' if goal['met'] else 'NOT met' if goal['met'] is False else 'n/a'}: "
            f"{goal['goal']}: {goal['value']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
