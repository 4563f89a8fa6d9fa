"""Turn the benchmark's results into ``RESULTS.md``: machine, versions, command, goals, tables."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def goals(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluate the goals of issues 7, 14 and 21 on one or more runs of the whole comparison.

    Each goal's figure is a ratio computed round by round (each case divided by its floor, both
    timed in the same round), pooled over ``runs`` (``python -m bench --repeat K``). A goal is
    met only when the upper quartile of those per-round ratios meets it, so one lucky median
    cannot meet it.

    Args:
        runs: results of each repetition, each ``{"workloads": [...], "dispatch": {...}}``.

    Returns:
        ``[{"goal": text, "value": text, "median", "q3": pooled figures (None when missing),
        "spread": [median of each run], "met": True | False | None}]``; ``met`` is None when a
        figure is missing (a case failed or a peer was skipped).
    """
    found: list[dict[str, Any]] = []
    for goal, figure, limit in _goal_figures():
        per_run = [figure(run) for run in runs]
        pooled = [r for rounds in per_run if rounds for r in rounds]
        medians = [statistics.median(rounds) for rounds in per_run if rounds]
        median = statistics.median(pooled) if pooled else None
        q3 = _upper_quartile(pooled) if pooled else None
        spread = f", runs {_x(min(medians))}-{_x(max(medians))}" if len(medians) > 1 else ""
        found.append({"goal": goal, "median": median, "q3": q3, "spread": medians,
                      "value": f"{_x(median)} (q3 {_x(q3)}{spread})",
                      "met": None if q3 is None else q3 < limit if limit == 1.0 else q3 <= limit})
    return found + _throughput_goals(runs)


def _throughput_goals(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 33's goals on ``python -m bench.throughput``'s rows: each read row >= 0.8x the raw
    read, extraction <= 1.0x the bare loop plus the raw write, on the pooled per-round ratios
    (each against the limit measured in its round); met when the quartile on the losing side
    (the lower one for "at least", the upper one for "at most") meets the goal, as the other
    goals use q3. Runs from before rounds count their one figure."""
    found = []
    for goal, prefix, limit, at_least in (
            ("store read rows, first pass >= 0.8x the raw disk read (issue 33)",
             "store read rows, first pass", 0.8, True),
            ("token view, flat reads >= 0.8x the raw disk read (issue 33)", "token view", 0.8, True),
            ("extract <= 1.0x the bare loop plus the raw write (issue 33)", "extract", 1.0, False)):
        figures = [ratio for run in runs for row in (run.get("throughput") or {}).get("rows", [])
                   if row["row"].startswith(prefix) for ratio in row.get("ratios", [row["ratio"]])]
        median = statistics.median(figures) if figures else None
        side = None if not figures else _upper_quartile(figures) if not at_least else \
            figures[0] if len(figures) == 1 else statistics.quantiles(figures, n=4, method="inclusive")[0]
        spread = f", rounds {_x(min(figures))}-{_x(max(figures))}" if len(figures) > 1 else ""
        found.append({"goal": goal, "median": median, "q3": side, "spread": figures,
                      "value": f"{_x(median)} ({'q1' if at_least else 'q3'} {_x(side)}{spread})",
                      "met": None if side is None else side >= limit if at_least else side <= limit})
    return found


Rounds = Callable[[dict[str, Any]], "list[float] | None"]


def _goal_figures() -> list[tuple[str, Rounds, float]]:
    """``(goal, per-round ratios of one run, limit)``; a limit of 1.0 means "faster than"."""
    ours = _against("gpt2", "hookscope, every module", None)
    figures: list[tuple[str, Rounds, float]] = [
        ("GPT-2 all-module hookscope capture <= 1.10x bare forward", ours, 1.10)]
    for label, workload, prefix in (
            ("nnsight, every module", "gpt2", "nnsight, every module"),
            ("TransformerLens, all hook points (vs its own forward)", "gpt2",
             "TransformerLens run_with_cache, all"),
            ("torchlens, every module", "gpt2-torchlens", "torchlens, every module")):
        figures.append((f"hookscope < {label}", _quotient(ours, _against(workload, prefix, None)), 1.0))
    for goal, workload, ours_prefix, base_prefix, limit in (
            ("CNN every module <= 1.05x plain detach hooks", "resnet",
             "hookscope, every module (", "plain hooks detach(), every module", 1.05),
            ("CNN first capture within 1.05x of later captures", "resnet",
             "hookscope, every module, first", "hookscope, every module (", 1.05),
            ("CNN 16 blocks <= 1.05x plain detach hooks", "resnet",
             "hookscope 'layer*.*' (16 blocks)", "plain hooks detach(), 16 blocks", 1.05),
            ("efficientnet every module <= 1.05x plain detach hooks", "efficientnet",
             "hookscope, every module (", "plain hooks detach(), every module", 1.05),
            ("efficientnet first capture within 1.05x of later captures", "efficientnet",
             "hookscope, every module, first", "hookscope, every module (", 1.05)):
        figures.append((goal, _against(workload, ours_prefix, base_prefix), limit))
    figures.append(("patching_sweep <= 1.10x the hand-written loop of plain hooks (same batching)",
                    _against("sweep", "hookscope.patching_sweep", "hand-written"), 1.10))
    generation = _against("generation", "hookscope.capture_generation", "hand-written")
    figures += [
        ("capture_generation per generated token <= 1.10x the hand-written loop of plain hooks "
         "(same generate call)", generation, 1.10),
        ("capture_generation < nnsight generate (each vs the hand-written loop)",
         _quotient(generation, _against("generation", "nnsight generate", "hand-written")), 1.0),
        ("capture_generation < TransformerLens generate with hooks (each vs its own bare generate)",
         _quotient(_against("generation", "hookscope.capture_generation", None),
                   _against("generation", "TransformerLens generate,", None)), 1.0),
        ("extract of one mean-pooled efficientnet-lite0 layer <= 1.03x the bare loop (same "
         "batches)", _against("extraction", "hookscope extract efficientnet", None), 1.03),
        ("LeNet extraction throughput >= 0.95x the bare loop (time <= 1/0.95 = x1.05)",
         _against("extraction", "hookscope extract LeNet", None), 1 / 0.95)]
    figures += [
        ("per-call dispatch <= 1.15x a bare hook (steady state)", _dispatch("ratios_steady"), 1.15),
        ("set-up, call and take-down on 200 modules <= 1.3x bare hooks registered and removed "
         "per forward", _dispatch("ratios_per_capture"), 1.3)]
    figures += [(f"{title}: every-module capture inside torch.compile(fullgraph=True) <= 1.05x "
                 "the compiled forward (issue 32)", _compiled(model), 1.05)
                for model, title in (("gpt2", "GPT-2-sized"), ("resnet", "ResNet-50-sized CNN"))]
    return figures


def _against(workload: str, prefix: str, base_prefix: str | None) -> Rounds:
    """Per-round ratios of the first case of ``workload`` named ``prefix...`` to the case named
    ``base_prefix...`` (None: the case's own floor, the bare forward it is compared with)."""
    def rounds(run: dict[str, Any]) -> list[float] | None:
        cases = {c["name"]: c for w in run.get("workloads", []) if w.get("workload") == workload
                 for c in w.get("cases", []) if c.get("times_s")}
        case = next((c for name, c in cases.items() if name.startswith(prefix)), None)
        if case is None:
            return None
        base = (cases.get(case.get("floor") or next(iter(cases))) if base_prefix is None else
                next((c for name, c in cases.items() if name.startswith(base_prefix)), None))
        if base is None:
            return None
        return [a / b for a, b in zip(case["times_s"], base["times_s"])]
    return rounds


def _quotient(ours: Rounds, theirs: Rounds) -> Rounds:
    """Per-round ratios of ``ours`` to ``theirs`` (each against its own floor)."""
    def rounds(run: dict[str, Any]) -> list[float] | None:
        a, b = ours(run), theirs(run)
        return None if a is None or b is None else [x / y for x, y in zip(a, b)]
    return rounds


def _dispatch(key: str) -> Rounds:
    def rounds(run: dict[str, Any]) -> list[float] | None:
        values = (run.get("dispatch") or {}).get(key)
        return list(values) if values else None
    return rounds


def _compiled(model: str) -> Rounds:
    def rounds(run: dict[str, Any]) -> list[float] | None:
        rows = [r for r in (run.get("compiled") or {}).get("rows", []) if r["workload"] == model]
        return list(rows[0]["ratios"]) if rows and rows[0].get("ratios") else None
    return rounds


def _upper_quartile(values: list[float]) -> float:
    """The upper quartile (``statistics.quantiles``, inclusive method); the value itself for one."""
    return values[0] if len(values) == 1 else statistics.quantiles(values, n=4, method="inclusive")[2]


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"x{value:.2f}"


def _mib(value: Any) -> str:
    return "" if value is None else f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def _values(case: dict[str, Any]) -> str:
    check = case.get("values")
    if not check:
        return "n/c"
    text = f"**{check['wrong']}/{check['checked']} wrong**" if check["wrong"] else "ok"
    if check.get("refused"):
        text += f", {check['refused']}/{check['checked']} refused (overwritten)"
    return text if check["wrong"] or check.get("refused") else f"ok ({check['checked']})"


def _table(workload: dict[str, Any]) -> list[str]:
    lines = ["| case | ms | x bare | per-round x (q1-q3) | values | kept tensors MiB | "
             "RSS peak +MiB | RSS kept +MiB | note |",
             "|---|---:|---:|---|---|---:|---:|---:|---|"]
    for case in workload["cases"]:
        if "error" in case:
            lines.append(f"| {case['name']} | | | | | | | | error: `{case['error']}` |")
            continue
        memory = case.get("memory", {})
        note = case.get("note", "")
        if case.get("floor") and case["floor"] != workload["cases"][0]["name"]:
            note = f"{note}; x vs '{case['floor']}'".lstrip("; ")
        if "error" in memory:
            note = f"{note}; memory: {memory['error']}".lstrip("; ")
        spread = (f"{case['ratio_q1']:.2f}-{case['ratio_q3']:.2f}" if "ratio_q1" in case else "")
        median = f"{case['median_s'] * 1e3:,.0f}" if "median_s" in case else ""
        ratio = f"x{case['ratio']:.2f}" if "ratio" in case else ""
        lines.append(
            f"| {case['name']} | {median} | {ratio} | {spread} | {_values(case)} | "
            f"{_mib(case.get('tensor_mib'))} | {_mib(memory.get('rss_peak_mib'))} | "
            f"{_mib(memory.get('rss_kept_mib'))} | {note} |")
    for name, why in workload.get("skipped", {}).items():
        lines.append(f"| {name} | | | | | | | | skipped: {why} |")
    return lines


def _repeats(results: dict[str, Any]) -> str:
    runs = len(results.get("runs", [])) or 1
    return f": {runs} runs of the whole comparison (spread: median of each run)" if runs > 1 else ""


def markdown(results: dict[str, Any]) -> str:
    """Return the whole ``RESULTS.md`` text."""
    settings, machine = results["settings"], results["machine"]
    out = ["# hookscope benchmarks", "",
           "Generated by `python -m bench` (bench/__main__.py); do not edit by hand. Figures and",
           "raw times per run are in `results.json` beside this file.", "",
           "## Machine and versions", "",
           f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']:.0f} GiB; "
           f"{machine['platform']}",
           f"- load average before / after: {results['load']['before']} / {results['load']['after']}"
           " (other jobs on this 2-core machine add noise; ratios from one run are comparable, "
           "differences of ~5% are noise)",
           "- versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
           f"- command: `{results['command']}`",
           f"- settings: torch.set_num_threads({settings['threads']}), "
           f"{'torch.inference_mode()' if settings['grad_mode'] == 'inference' else 'torch.no_grad()'}"
           f", {settings['warmups']} warm-up rounds, median of {settings['runs']} timed rounds "
           f"(torchlens: {settings['torchlens_runs']}), cases interleaved in one process per "
           f"workload, sizes: {settings['size']}", "",
           f"## Goals (issues 7, 14, 21){_repeats(results)}", "",
           "A figure is the median of the per-round ratios (each case over its floor, timed in "
           "the same round); a goal is met only when their upper quartile (q3) meets it.", "",
           "| goal | measured | met |", "|---|---|---|"]
    for goal in results["goals"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[goal["met"]]
        out.append(f"| {goal['goal']} | {goal['value']} | {met} |")
    out += ["", "## How to read the tables", "",
            "- **x bare**: median time of the case / median time of the bare forward in the same "
            "process run; **per-round x**: quartiles of (case / bare) paired round by round.",
            "- A case's time covers setting the capture up, the forward pass and taking it down; "
            "the garbage collector is off while it runs (as in timeit). hookscope keeps each "
            "captured tensor copy-on-write (no per-model state, no learning pass): only a tensor "
            "written in place after capture is copied, when the write happens; the *first "
            "capture of the model* row is therefore the same code as the later ones.",
            "- **values**: each kept tensor compared exactly with a reference forward whose hooks "
            "clone every output; *wrong* means the kept tensor was overwritten in place later "
            "(in-place ReLU, `+=`). n/c: not checked (other model, or records not keyed by "
            "module).",
            "- **kept tensors**: bytes of the distinct storages the tool kept (exact). **RSS "
            "peak**: peak resident set during one captured forward minus the resident set before "
            "it, one process per case, after a warm-up run and malloc_trim; it includes the "
            "forward's transient memory (see the bare row). **RSS kept**: resident set after the "
            "forward, records alive, minus before.",
            "- *every module* = each module that is a leaf or owns parameters and runs on this "
            "input (GPT-2's `attn_dropout` does not run under sdpa), the same list for every tool.",
            "- nnsight: `NNsight(model)` replaces every module's `forward` with its own wrapper for "
            "good (it slowed later bare forwards), so it runs on a deep copy of the model. It "
            "records the first call only of a module called several times in one pass.",
            "- TransformerLens 3.9.0 (pinned): the last release with `HookedTransformer`, built "
            "here from a config of the same size (its own implementation: compare its cases with "
            "its own bare forward). 4.x keeps only `TransformerBridge`, which boots from a hub "
            "checkpoint and tokenizer, impossible without downloads.",
            "- generation: every case runs the same greedy `generate()` (KV cache, exactly the "
            "same number of new tokens), so a ratio of times is a ratio per generated token. "
            "extraction: wall time of `extract` into a fresh folder per round, its writer "
            "thread's last shard included, against the bare loop over the same DataLoader.",
            "- On a machine where another process holds a core, torch's OpenMP threads at "
            "`--threads 2` wait on each other (libgomp spins) and a bare forward can take 3-6x "
            "its quiet time from one round to the next: ratios of such runs mean little; "
            "`--threads 1` keeps them comparable.",
            "- torchlens wraps torch functions on its first call and leaves them wrapped: its "
            "workloads run in processes of their own; the bare forward is timed alone first, "
            "then again interleaved with torchlens once torch is wrapped, and torchlens's ratios "
            "use that second floor (lower bounds). Selecting modules saves every op inside them.",
            ""]
    for workload in results["workloads"]:
        out += [f"## {workload['title']}", "",
                f"Input: {workload.get('shape', '?')}. " + ", ".join(
                    f"{k}: {v}" for k, v in workload.get("info", {}).items()), ""]
        if "error" in workload:
            out += [f"Workload failed: `{workload['error']}`", ""]
            continue
        out += _table(workload) + [""]
    dispatch = results.get("dispatch")
    if dispatch:
        out += ["## Per-call dispatch (`python -m bench.dispatch`)", "", "```",
                dispatch.get("text", ""), "```", ""]
    out += _compiled_section(results.get("compiled")) + _throughput_section(results.get("throughput"))
    if results.get("merged"):
        out += ["## Sections measured later (`--only`, merged into this file)", ""]
        out += [f"- {m['generated']}: `{m['command']}` (load {m['load']})" for m in results["merged"]]
        out += [""]
    if results.get("notes"):
        out += ["## Notes", ""] + [f"- {note}" for note in results["notes"]] + [""]
    return "\n".join(out)


def _compiled_section(compiled: dict[str, Any] | None) -> list[str]:
    if not compiled:
        return []
    out = ["## torch.compile(fullgraph=True): every-module capture (`python -m bench.compiled`)", "",
           compiled.get("settings", ""), ""]
    if "error" in compiled:
        return out + [f"Failed: `{compiled['error']}`", ""]
    out += ["| model | modules | graphs compiled | compile s | compiled forward ms | "
            "with every-module capture ms | x compiled forward | plain traced hooks | "
            "bytes floor (MiB captured) | function calls captured |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    out += [f"| {r['workload']} | {r['modules']} | {r['graphs']} | {r['compile_s']:.0f} | "
            f"{r['bare_ms']:.1f} | {r['capture_ms']:.1f} | x{r['ratio']:.3f} | "
            + (f"x{r['plain_ratio']:.3f} | x{r['floor_ratio']:.3f} ({r['captured_mib']:.0f}) |"
               if "plain_ratio" in r else "n/a | n/a |")
            + (f" x{r['calls_ratio']:.3f} (`{r['calls']}`, {r['calls_count']} addresses) |"
               if "calls_ratio" in r else " n/a |") for r in compiled["rows"]]
    return out + ["", "Plain traced hooks: the same modules hooked by plain forward hooks that dynamo "
                  "traces, each appending a clone of its output to a list (graph outputs), what a "
                  "user writes without hookscope. Bytes floor: the compiled forward plus allocating "
                  "and filling tensors of the captured values' shapes, in the same round: what any "
                  "capture handing out every module's output pays at least. Function calls "
                  "captured: a capture of those calls inside the same graph, against the same "
                  "compiled forward (bench/compiled.py).", ""]


def _throughput_section(throughput: dict[str, Any] | None) -> list[str]:
    if not throughput:
        return []
    out = ["## Store throughput against the same disk (`python -m bench.throughput`)", "",
           throughput.get("settings", ""), ""]
    if "error" in throughput:
        return out + [f"Failed: `{throughput['error']}`", ""]
    out += ["| row | MB/s | x limit | rounds | note |", "|---|---:|---:|---|---|"]
    out += [f"| {r['row']} | {r['mb_s']:.0f} | x{r['ratio']:.2f} | "
            f"{_x(min(r.get('ratios', [r['ratio']])))}-{_x(max(r.get('ratios', [r['ratio']])))} | "
            f"{r['note']} |" for r in throughput["rows"]]
    return out + [""]
