"""The benchmark's own virtual environment, ``.venv-bench``: peers live there, never in hookscope.

``setup()`` creates it with ``python3 -m venv``, installs the CPU torch wheel first (a bare
``pip install torch`` would pull a multi-GB CUDA build), then the pinned peers of
``bench/requirements-peers.txt`` under a constraints file that holds torch at that version, then
hookscope itself, editable, without extras. A stamp file records the requirements it was built
from, so a changed pin rebuilds it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-bench"
REQUIREMENTS = ROOT / "bench" / "requirements-peers.txt"
TORCH = "torch==2.13.0"
PEERS = ("torch", "nnsight", "transformer-lens", "torchlens", "transformers",
         "efficientnet-lite-pytorch", "scikit-image", "numpy")


def python(venv: Path = VENV) -> Path:
    """Return the interpreter of ``venv``."""
    return venv / "bin" / "python"


def _stamp(venv: Path) -> Path:
    return venv / ".bench-requirements.sha256"


def _digest() -> str:
    return hashlib.sha256((TORCH + "\n" + REQUIREMENTS.read_text()).encode()).hexdigest()


def is_current(venv: Path = VENV) -> bool:
    """Return whether ``venv`` exists and was built from the current requirements."""
    stamp = _stamp(venv)
    return python(venv).exists() and stamp.exists() and stamp.read_text().strip() == _digest()


def setup(venv: Path = VENV) -> Path:
    """Create or update ``venv`` with the pinned peers; return its interpreter.

    Raises:
        subprocess.CalledProcessError: ``venv`` or ``pip`` failed (its output is on stderr).
    """
    def run(*command: str) -> None:
        print("+", " ".join(command), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)

    if not python(venv).exists():
        run(sys.executable if sys.prefix == sys.base_prefix else "python3", "-m", "venv", str(venv))
    pip = (str(python(venv)), "-m", "pip", "install", "-q")
    run(*pip, TORCH)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
        pin.write(TORCH + "\n")
    try:
        run(*pip, "-c", pin.name, "-r", str(REQUIREMENTS))
        run(*pip, "-c", pin.name, "-e", str(ROOT))
    finally:
        Path(pin.name).unlink()
    _stamp(venv).write_text(_digest() + "\n")
    return python(venv)


def versions(interpreter: Path | str) -> dict[str, str]:
    """Return ``{distribution: version}`` of the benchmark's packages in ``interpreter``'s env
    (``"-"`` where one is missing), plus ``python``."""
    code = ("import importlib.metadata as m, json, platform\n"
            f"names = {list(PEERS)!r}\n"
            "found = {}\n"
            "for n in names:\n"
            "    try: found[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: found[n] = '-'\n"
            "found['python'] = platform.python_version()\n"
            "print(json.dumps(found))\n")
    out = subprocess.run([str(interpreter), "-c", code], check=True, capture_output=True, text=True)
    import json

    return dict(json.loads(out.stdout))
