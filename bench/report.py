"""Turn the benchmark's results into ``RESULTS.md``: machine, versions, command, goals, tables."""

from __future__ import annotations

from typing import Any


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Evaluate the goals of issues 7 and 14 on ``results``.

    Returns:
        ``[{"goal": text, "value": text, "met": True | False | None}]``; ``None`` when a figure
        is missing (a case failed or a peer was skipped).
    """
    cases = {(w["workload"], c["name"]): c for w in results["workloads"] for c in w.get("cases", [])}

    def ratio(workload: str, prefix: str) -> float | None:
        for (name, case_name), case in cases.items():
            if name == workload and case_name.startswith(prefix) and "ratio" in case:
                return float(case["ratio"])
        return None

    found: list[dict[str, Any]] = []
    ours = ratio("gpt2", "hookscope, every module")
    found.append({"goal": "GPT-2 all-module hookscope capture <= 1.10x bare forward",
                  "value": _x(ours), "met": None if ours is None else ours <= 1.10})
    for label, workload, prefix in (
            ("nnsight, every module", "gpt2", "nnsight, every module"),
            ("TransformerLens, all hook points (vs its own forward)", "gpt2",
             "TransformerLens run_with_cache, all"),
            ("torchlens, every module", "gpt2-torchlens", "torchlens, every module")):
        theirs = ratio(workload, prefix)
        met = None if ours is None or theirs is None else ours < theirs
        found.append({"goal": f"hookscope < {label}", "value": f"{_x(ours)} vs {_x(theirs)}",
                      "met": met})
    found += _issue14(ratio)
    dispatch = results.get("dispatch") or {}
    steady, per_capture = dispatch.get("ratio_steady"), dispatch.get("ratio_per_capture")
    found.append({"goal": "per-call dispatch <= 1.15x a bare hook (steady state)",
                  "value": _x(steady), "met": None if steady is None else steady <= 1.15})
    found.append({"goal": "set-up, call and take-down on 200 modules <= 1.3x bare hooks "
                          "registered and removed per forward",
                  "value": _x(per_capture), "met": None if per_capture is None else per_capture <= 1.3})
    return found


def _issue14(ratio: Any) -> list[dict[str, Any]]:
    """Issue 14's goals: hookscope against plain ``detach()`` hooks in the same run."""
    found = []
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
        ours, base = ratio(workload, ours_prefix), ratio(workload, base_prefix)
        value = None if ours is None or base is None else ours / base
        found.append({"goal": goal, "value": f"{_x(value)} ({_x(ours)} vs {_x(base)} bare)",
                      "met": None if value is None else value <= limit})
    return found


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
           "## Goals (issue 7)", "",
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
    if results.get("notes"):
        out += ["## Notes", ""] + [f"- {note}" for note in results["notes"]] + [""]
    return "\n".join(out)
