"""The zoo's run and its page (docs/zoo.md): counts per verb, then one row per architecture."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

from tests.zoo.build import Built, build, classes
from tests.zoo.cells import VERBS, Cell, run_cells

STATUSES = ("equal", "refused", "silent", "crash", "n/a")
MARK = {"equal": "=", "refused": "R", "silent": "**SILENT**", "crash": "**CRASH**", "n/a": "-"}
Row = tuple[Built, dict[str, Cell]]


def run_zoo(*, only: str = "", limit: int = 0, progress: bool = False,
            names: tuple[str, ...] = (), jobs: int = 1, reverse: bool = False) -> list[Row]:
    """Build every class (or those in ``names``, or whose name contains ``only``) and run its
    cells, in ``jobs`` processes (``reverse``: last class first, rows still returned in
    ``classes()`` order); a class that does not build has no cells. Each row's ``Built``
    holds no model (``skipped`` empty: it built)."""
    chosen = [c for c in classes() if only in c[2] and (not names or c[2] in names)][:limit or None]
    order = chosen[::-1] if reverse else chosen
    rows: list[Row] = []
    if jobs > 1:
        import multiprocessing
        pool = multiprocessing.get_context("spawn").Pool(
            jobs, maxtasksperchild=20, initializer=_RESUMED.update, initargs=(dict(_RESUMED),))
        results = pool.imap(_one, order)
    else:
        pool, results = None, map(_one, order)
    for number, (built, cells) in enumerate(results):
        rows.append((built, cells))
        if progress:
            shown = " ".join(f"{v}={c.status}" for v, c in cells.items()) or f"skipped: {built.skipped}"
            print(f"[{number + 1}/{len(chosen)}] {built.name}: {shown}", file=sys.stderr, flush=True)
            why = {v: c.reason for v, c in cells.items() if c.status in _REASONED}
            if why:
                print(f"[{number + 1}/{len(chosen)}] {built.name} why: {json.dumps(why)}",
                      file=sys.stderr, flush=True)
    if pool is not None:
        pool.close()
        pool.join()
    return rows[::-1] if reverse else rows


def _one(chosen: tuple[str, str, str]) -> Row:
    kind, model_type, name = chosen
    done = _RESUMED.get(name)
    kept = {} if done is None else {v: Cell(*cell) for v, cell in done.items() if v in VERBS}
    again = tuple(v for v in VERBS if v not in kept or kept[v].status in ("silent", "crash")
                  or kept[v].status == "refused" and not kept[v].reason)
    if done is not None and not again:
        return Built(name, kind, model_type, None), kept  # nothing to run again
    built = build(kind, model_type, name)
    if built.model is None:
        cells: dict[str, Cell] = {}
    else:  # a previous run's cells, and those it lacks or holds without a reason run again
        cells = {**kept, **run_cells(built.model, kind, again)}
        cells = {v: cells[v] for v in VERBS if v in cells}
    return Built(built.name, built.kind, built.model_type, None, built.skipped), cells


# name -> {verb: (status, reason)} of previous runs (resume_from)
_RESUMED: dict[str, dict[str, tuple[str, str]]] = {}
_REASONED = ("refused", "silent", "crash")
# the beam cells' refusal, the same on every model (a log's beam refusal without a reason)
BEAM = "CaptureError: 'token_ids': generate() runs _beam_search (num_beams > 1), whose rows are beams"
_LINE = re.compile(r"\[\d+/\d+\] (\w+): (.*)")
_WHY = re.compile(r"\[\d+/\d+\] (\w+) why: (.*)")


def resume_from(log: str) -> None:
    """Take the cells of a previous run's progress lines (``[n/N] Class: verb=status ...`` and
    ``[n/N] Class why: {json}``, the reasons) for the classes it reached: a later run runs
    again only the verbs a class lacks, its silent and crashed cells, and refusals whose reason
    the log does not hold (a beam refusal's is ``BEAM``)."""
    with open(log, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if (why := _WHY.match(line)) is not None:
                cells = _RESUMED.get(why.group(1), {})
                for verb, reason in json.loads(why.group(2)).items():
                    if verb in cells:
                        cells[verb] = (cells[verb][0], reason)
                continue
            match = _LINE.match(line)
            if match and not match.group(2).startswith("skipped"):
                _RESUMED[match.group(1)] = {
                    verb: (status, BEAM if (verb, status) == ("beam", "refused") else "")
                    for verb, status in (item.split("=", 1) for item in match.group(2).split()
                                         if "=" in item)}


def counts(rows: list[Row]) -> dict[str, Counter[str]]:
    """``{verb: Counter(status)}`` over the rows that built."""
    return {verb: Counter(cells[verb].status for _, cells in rows if verb in cells) for verb in VERBS}


def page(rows: list[Row], *, seconds: float = 0.0) -> str:  # noqa: ARG001 - kept for callers
    """The Markdown page: how to regenerate it, the counts, the table, the skipped classes."""
    built = [(b, c) for b, c in rows if not b.skipped]
    skipped = [b for b, _ in rows if b.skipped]
    table = counts(built)
    lines = [
        "# Architecture zoo",
        "",
        "Every model class that transformers' own auto mappings name (causal LMs, "
        "sequence-to-sequence, masked LMs, text encoders, image classifiers: "
        "`MODEL_FOR_*_MAPPING_NAMES`, not a hand list), built from its default config shrunk to "
        "a tiny size with random weights, and run through hookscope's verbs. Each cell is "
        "checked against what the model itself computed: its `hidden_states`, its "
        "log-probabilities, the sequences `generate()` returned and a teacher-forced forward "
        "over them, a plain `register_forward_hook`. Read it before you trust a number on an "
        "architecture the rest of these pages never name.",
        "",
        "Regenerate it (about an hour on two busy CPU cores; `make zoo` "
        "runs it with 2 processes; `--resume-log LOG` reuses a previous run's progress output "
        "and runs again only the cells that were not equal, and the verbs it lacks):",
        "",
        "<!-- readme-test: skip runs every architecture for minutes; tests/test_zoo.py runs a "
        "fixed sample -->",
        "```console",
        "$ python -m tests.zoo",
        "```",
        "",
        "Cells: `=` equal to the model's own value (within 1e-4), `R` refused with a "
        "`HookscopeError` naming why, `-` the model itself cannot (no hidden states, no logits, "
        "not generative, `generate()` fails without hookscope), **SILENT** a value that differs "
        "from the model's, **CRASH** an error that is not a `HookscopeError`.",
        "",
        "- **names**: `embed`, `resid_pre.0` and `resid_post.*` captured, equal to "
        "`output_hidden_states` (the last hidden state may be the final norm's output, whose "
        "input `resid_post.{L-1}` then is; where the hidden states are each block's output, as "
        "Mamba's, `resid_pre.0` equals the first block's input);",
        "- **capture**: `capture(model, \"**\")`, every module's every call equal to a plain "
        "forward hook's;",
        "- **lens**: `logit_lens`'s last layer equal to the model's own log-probabilities (an "
        "encoder-decoder's: its decoder's, with `decoder_input_ids`);",
        "- **greedy**, **sample**, **beam**: `capture_generation` around `generate()` (greedy; "
        "top-k sampling; 2 beams): `token_ids()` equal to the returned sequences but their last "
        "token, the first decoder block's `aligned` rows equal to a teacher-forced forward over "
        "them (an encoder-decoder: over the decoder's inputs; where a plain forward computes other "
        "position ids than the `0, 1, ...` that `generate()` passes, as RoBERTa-like models do, "
        "with those);",
        "- **attention**: `attention(model, layers=\"resid_post.0\")` (the first block's "
        "attention probabilities, recomputed from the SDPA call where the model uses it) equal to "
        "the model's own `output_attentions` of the same weights with eager attention;",
        "- **patch**: `patch(model, source=clean, layers=\"resid_post.0\")` on a corrupted input: "
        "the output equal to a plain forward hook returning the clean run's output of that module;",
        "- **steer**: `steer(model, {\"resid_post.0\": v})`: the output equal to a plain forward "
        "hook adding `v`;",
        "- **eap**: `edge_attribution_patching` on a causal LM (a logit difference at the last "
        "position): the edges input -> logits, m0 -> logits and input -> m0 equal to (clean - "
        "corrupted) x the gradient at the downstream norm's input, computed with plain hooks and "
        "`torch.autograd.grad` (the residual stream's `hidden_states[0]`, the MLP's output, a copy "
        "of the norm's input that only the norm reads).",
        "",
        "## Counts",
        "",
        f"{len(rows)} classes enumerated, {len(built)} built, {len(skipped)} skipped (listed at "
        "the end with the reason).",
        "",
        "| verb | " + " | ".join(STATUSES) + " |",
        "|---|" + "---|" * len(STATUSES),
    ]
    for verb in VERBS:
        lines.append(f"| {verb} | " + " | ".join(str(table[verb][s]) for s in STATUSES) + " |")
    applicable = {verb: sum(table[verb][s] for s in STATUSES if s != "n/a") for verb in VERBS}
    lines += ["", "Equal among the architectures where the verb applies: " + ", ".join(
        f"{verb} {table[verb]['equal']}/{applicable[verb]}" for verb in VERBS) + ".", "",
        "## Table", "", "| architecture | kind | " + " | ".join(VERBS) + " |",
        "|---|---|" + "---|" * len(VERBS)]
    for b, cells in built:
        lines.append(f"| {b.name} | {b.kind} | " + " | ".join(MARK[cells[v].status] for v in VERBS) + " |")
    reasons = [(b.name, v, c) for b, cells in built for v, c in cells.items()
               if c.status in ("refused", "silent", "crash")]
    lines += ["", "## Refusals", "", "The first line of each refusal's message.", "",
              "| architecture | verb | reason |", "|---|---|---|"]
    lines += [f"| {name} | {verb} | {_cell_text(c.reason)} |" for name, verb, c in reasons]
    lines += ["", "## Skipped", "", "| class | reason |", "|---|---|"]
    lines += [f"| {b.name} | {_cell_text(b.skipped)} |" for b in skipped]
    return "\n".join(lines) + "\n"


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
