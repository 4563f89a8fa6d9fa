"""direct_logit_attribution against TransformerLens itself (issue 50 item 1): the peer script
``tests/tl_direct_logit.py`` runs in an environment that has transformer_lens (``HOOKSCOPE_TL_PYTHON``,
default ``/work/venv-tl/bin/python``; skipped where there is none) with this checkout's hookscope
on its path, and compares each component with TL's ``get_full_resid_decomposition(apply_ln=True)``
on a real ``HookedTransformer``. TL's ``apply_ln_to_stack`` leaves the final norm's gain and bias
to ``fold_ln``: the script puts the gain in the direction and the bias (with ``b_U``) beside TL's
``bias`` component, which is the output projections' biases only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(os.environ.get("HOOKSCOPE_TL_PYTHON", "/work/venv-tl/bin/python"))


@pytest.mark.skipif(not PEER.exists(), reason=f"no transformer_lens environment at {PEER}")
def test_components_equal_transformer_lens() -> None:
    done = subprocess.run([str(PEER), str(ROOT / "tests" / "tl_direct_logit.py")], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found["labels"]) == len(found["components"]) == 13  # 8 heads, 2 MLPs, 2 embeddings, bias
    assert found["scale"] > 0.1  # the premise: components that are not nothing
    assert found["max_diff"] < 1e-5, found
    assert found["sum_vs_logits"] < 1e-5, found
