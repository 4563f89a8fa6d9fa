"""The architecture zoo in the suite: a fixed sample of transformers' auto-mapped classes and a
few drawn by hypothesis run through every verb; each cell equals the model's own value or is
refused by name, never silent (the full set: ``python -m tests.zoo``, docs/zoo.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from tests.zoo.build import MAPPINGS, build, classes  # noqa: E402
from tests.zoo.cells import VERBS, run_cells  # noqa: E402
from tests.zoo.table import counts, page  # noqa: E402

# (class, the verbs that must be equal, not only not silent)
EDITS = ("attention", "patch", "steer")
SAMPLE = {
    "GPT2LMHeadModel": ("names", "capture", "lens", "greedy", "sample", *EDITS, "eap"),
    "LlamaForCausalLM": ("names", "capture", "lens", "greedy", "sample", *EDITS, "eap"),
    "Gemma2ForCausalLM": ("names", "capture", "lens", "greedy"),   # case 62's soft-cap
    "Qwen2MoeForCausalLM": ("names", "lens", "greedy", "eap"),
    "OPTForCausalLM": ("names", "lens", "greedy", "patch", "steer"),  # resid_pre.0 inline
    "MambaForCausalLM": ("names", "lens", "greedy"),               # hidden states after blocks
    "T5ForConditionalGeneration": ("names", "lens", "greedy", "sample", *EDITS),  # case 63
    "BertForMaskedLM": ("names", "capture", "lens", *EDITS),
    "ViTForImageClassification": ("names", "capture", *EDITS),
}


def _by_name() -> dict[str, tuple[str, str, str]]:
    return {name: (kind, model_type, name) for kind, model_type, name in classes()}


@pytest.mark.parametrize("name", sorted(SAMPLE))
def test_sample_architecture_is_equal_or_refused(name: str) -> None:
    built = build(*_by_name()[name])
    assert built.model is not None, built.skipped
    cells = run_cells(built.model, built.kind)
    assert not [(v, c) for v, c in cells.items() if c.status in ("silent", "crash")], cells
    assert {v: cells[v].status for v in SAMPLE[name]} == dict.fromkeys(SAMPLE[name], "equal"), cells
    assert cells["beam"].status in ("refused", "n/a"), cells["beam"]


@settings(max_examples=3, deadline=None)
@given(pick=st.integers(0, 10_000))
def test_drawn_causal_architecture_is_never_silent(pick: int) -> None:
    causal = [c for c in classes() if c[0] == "causal"]
    built = build(*causal[pick % len(causal)])
    if built.model is None:
        assert built.skipped  # a class that does not build says why
        return
    cells = run_cells(built.model, built.kind, ("names", "lens", "greedy", "patch", "steer"))
    assert not [(v, c) for v, c in cells.items() if c.status in ("silent", "crash")], (built.name, cells)


def test_classes_come_from_the_auto_mappings() -> None:
    from transformers.models.auto import modeling_auto
    names = {name for _, _, name in classes()}
    for _, mapping in MAPPINGS:
        for value in getattr(modeling_auto, mapping).values():
            assert set((value,) if isinstance(value, str) else value) <= names


def test_page_shows_counts_and_rows() -> None:
    built = build(*_by_name()["GPT2LMHeadModel"])
    assert built.model is not None
    rows = [(built, run_cells(built.model, built.kind, VERBS))]
    text = page(rows)
    table = counts(rows)
    assert f"| names | {table['names']['equal']} |" in text
    assert "| GPT2LMHeadModel | causal | = | = | = | = | = | R | = | = | = | = |" in text
    assert "<!-- readme-test: skip" in text  # the docs test never re-runs the zoo
