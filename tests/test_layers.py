"""The import layers: core never imports the application layer; ``import hookscope`` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hookscope"
CORE = ["select", "_session", "capture", "records", "edit", "grads", "hooks", "diagnose", "_nested",
        "_inplace", "_sources", "_files", "errors", "compare", "tree", "nonfinite", "stats"]
APPLICATION = {"models", "inputs", "predictions", "viz", "gradcam", "cli"}


def _imported(module: str) -> set[str]:
    """Every hookscope module that ``module`` imports, at top level or inside a function."""
    tree = ast.parse((SRC / f"{module}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hookscope"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hookscope"))
    return {name.split(".")[1] for name in found if name.count(".") >= 1}


@pytest.mark.parametrize("module", CORE)
def test_core_imports_nothing_of_the_application_layer(module: str) -> None:
    assert _imported(module) & APPLICATION == set()


def test_the_check_sees_an_application_import() -> None:
    assert _imported("inputs") & APPLICATION == {"models"}  # the check can fail


def test_import_hookscope_loads_no_model_spec_machinery() -> None:
    code = ("import sys, hookscope; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('hookscope', 'transformers', 'matplotlib', 'PIL')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(SRC.parent)}).stdout
    assert "hookscope'" in loaded and "hookscope.capture'" in loaded
    for heavy in ("hookscope.models", "hookscope.inputs", "hookscope.predictions", "transformers",
                  "matplotlib", "PIL"):
        assert f"'{heavy}'" not in loaded
