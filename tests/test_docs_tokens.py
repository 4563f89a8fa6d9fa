"""docs/tokens.md's worked example runs as written (extract residual-stream tokens, train a tiny
SAE from the shuffled stream, splice it back with ``edit``) and prints the figures it shows."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "tokens.md"


def test_the_worked_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert code is not None
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code[1], str(DOC), "exec"), {"__name__": "__docs__"})  # noqa: S102
    lines = out.getvalue().splitlines()
    assert lines[0] == "270 (32,) True"  # 302 real tokens, less 32 BOS
    assert lines[1] == "{'seed': 0, 'epoch': 2, 'position': 270}"
    clean, spliced = map(float, re.findall(r"[\d.]+", lines[2]))
    assert spliced != clean and abs(spliced - clean) < 0.5
    assert sorted(os.listdir(tmp_path / "resid"))[0] == "manifest.json"
