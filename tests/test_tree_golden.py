"""`hookscope tree` output on small zoo models, compared with tests/golden/*.txt.

To regenerate after an intended change: HOOKSCOPE_UPDATE_GOLDEN=1 pytest tests/test_tree_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hookscope.cli.main import main

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "tree_modulelistblocks.txt": ["tree", "tests.models:ModuleListBlocks", "--input", "randn:2,8,6,6"],
    "tree_unusedbranch.txt": ["tree", "tests.models:UnusedBranch", "--input", "randn:2,4"],
    "tree_lenet_no_input.txt": ["tree", "tests.models:LeNet"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tree_matches_golden(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(CASES[name]) == 0
    output = capsys.readouterr().out
    file = GOLDEN / name
    if os.environ.get("HOOKSCOPE_UPDATE_GOLDEN") == "1":
        file.parent.mkdir(exist_ok=True)
        file.write_text(output)
    assert output == file.read_text(), "regenerate with HOOKSCOPE_UPDATE_GOLDEN=1 if intended"
