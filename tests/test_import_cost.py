"""Issue 32: ``import hookscope`` loads no compiler. One decorator (``torch.compiler.disable`` at
import) pulled ``torch._dynamo``, ``torch._inductor``, sympy and mpmath: 902 modules and
1.5-3.5 s for every process (CLI call, DDP rank, test subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

# fsspec (and s3fs, botocore) load only when a store at a URL is opened (issue 33)
FORBIDDEN = ("torch._dynamo", "torch._inductor", "sympy", "mpmath", "torch.fx.experimental",
             "fsspec", "s3fs", "botocore")
# Today 84: hookscope's own ~78 modules plus safetensors (4) and hmac/secrets. A bound with
# headroom for a few new hookscope modules; the compiler alone is 800+, so it cannot slip in.
MAX_NEW_MODULES = 130

PROBE = """
import json, sys
import torch
before = set(sys.modules)
import hookscope
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _new_modules(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=300)
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def test_import_hookscope_loads_no_compiler_and_few_modules() -> None:
    new = _new_modules(PROBE)
    assert "hookscope.record.captures" in new  # the probe really imported the package
    assert [m for m in new if m.startswith(FORBIDDEN)] == []
    assert len(new) <= MAX_NEW_MODULES, sorted(new)


def test_the_cli_entry_loads_no_compiler() -> None:
    new = _new_modules(PROBE.replace("import hookscope\n", "import hookscope.cli.main\n"))
    assert [m for m in new if m.startswith(FORBIDDEN)] == []
