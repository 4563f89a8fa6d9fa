"""Store paths that are URLs (issue 33): ``file://`` names a local folder; any other scheme
(``s3://``, ``gs://``, ``memory://``) is refused by ``extract`` and ``open_store`` before anything
is written, instead of making a local folder named ``s3:`` in the working directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hookscope.errors import ExtractError, StoreError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store

ROWS = torch.arange(12, dtype=torch.float32).reshape(6, 2)


def _extract(out: str) -> None:
    extract(nn.Sequential(nn.Identity()), TensorDataset(ROWS), "0", out, batch_size=4,
            progress=False)


@pytest.mark.parametrize("url", ["s3://bucket/s", "gs://b/s", "memory://s", "S3://bucket/s",
                                 "hf+s3://x/y"])
def test_a_url_is_refused_and_no_local_folder_is_made(tmp_path: Path, url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scheme = re.escape(url.split("://")[0])
    with pytest.raises(ExtractError, match=rf"is a URL \({scheme}://\), and stores are local "
                                           rf"folders for now \(as a path it would make a local "
                                           rf"folder named '{scheme}:'\)"):
        _extract(url)
    with pytest.raises(StoreError, match=rf"is a URL \({scheme}://\)"):
        open_store(url)
    assert os.listdir(tmp_path) == []


def test_a_file_url_is_the_local_folder(tmp_path: Path) -> None:
    _extract(f"file://{tmp_path / 'store'}")
    assert torch.equal(open_store(tmp_path / "store")["0"][:], ROWS)
    assert torch.equal(open_store(f"file://{tmp_path / 'store'}")["0"][:], ROWS)


def test_the_cli_refuses_a_url_in_one_line(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, "-m", "hookscope", "show", "s3://bucket/s"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "is a URL (s3://)" in done.stderr
    assert os.listdir(tmp_path) == []
