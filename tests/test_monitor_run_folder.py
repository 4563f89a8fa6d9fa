"""A monitor's run folder read as hostile input (issue 35): a torn last line is skipped with a
warning that says so; links out of the folder, FIFOs and mistyped fields are one named
HookscopeError (CLI: one line, exit 1), never a raw error or a hang."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from hookscope.cli.main import main
from hookscope.errors import HookscopeError
from hookscope.train.report import read_run
from tests.test_monitor_faults import _model, _train


@pytest.fixture(scope="module")
def run_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    run = tmp_path_factory.mktemp("run")
    _train(_model(), 3, mon_args={"run_dir": run})
    return (run / "records.jsonl").read_text()


def test_torn_last_line_is_skipped_and_said(run_text: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    whole = run_text.splitlines()
    (tmp_path / "records.jsonl").write_text(run_text + whole[1][:17])  # the process died mid-line
    with pytest.warns(UserWarning, match=r"skipped 1 torn line at its end \(line 8"):
        records, events = read_run(tmp_path)
    assert len(records) == 6 and [e["event"] for e in events] == ["start"]
    assert [r["step"] for r in records] == [0, 0, 1, 1, 2, 2]
    assert main(["monitor-report", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped 1 torn line") == 1
    assert "Traceback" not in err


def _link_out(folder: Path, text: str) -> None:
    (folder / "elsewhere.jsonl").write_text(text)
    (folder / "run").mkdir()
    (folder / "run" / "records.jsonl").symlink_to(folder / "elsewhere.jsonl")


def _edit(text: str, line: int, field: str, value: Any) -> str:
    lines = text.splitlines()
    record = json.loads(lines[line])
    record[field] = value
    lines[line] = json.dumps(record)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("make", "message"), [
    (lambda f, t: _link_out(f, t), "link leading outside the run folder"),
    (lambda f, t: os.mkfifo(f / "run" / "records.jsonl"), "not a regular file"),
    (lambda f, t: (f / "run" / "records.jsonl").mkdir(), "the path is a folder"),
    (lambda f, t: (f / "run" / "records.jsonl").write_text(_edit(t, 1, "step", "0")),
     "line 2: field step must be"),
    (lambda f, t: (f / "run" / "records.jsonl").write_text(_edit(t, 1, "module", None)),
     "line 2: field module must be"),
    (lambda f, t: (f / "run" / "records.jsonl").write_text(_edit(t, 2, "activation", [1])),
     "line 3: field activation must be"),
    (lambda f, t: (f / "run" / "records.jsonl").write_text(_edit(t, 2, "grad_norm", "big")),
     "line 3: field grad_norm must be"),
    (lambda f, t: (f / "run" / "records.jsonl").write_text(_edit(t, 0, "event", 5)),
     "line 1: field event must be"),
], ids=["link-out", "fifo", "folder", "step str", "module null", "activation list",
        "grad_norm str", "event int"])
def test_damaged_run_folders_are_one_named_error(run_text: str, tmp_path: Path, make: Any,
                                                 message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    if not (tmp_path / "run").exists() and "link" not in message:
        (tmp_path / "run").mkdir()
    make(tmp_path, run_text)
    result: list[Any] = []

    def read() -> None:
        try:
            read_run(tmp_path / "run")
        except HookscopeError as err:
            result.append(str(err))

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(20)  # a FIFO opened for reading would block forever
    assert len(result) == 1 and message in result[0]
    assert main(["monitor-report", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path / "run")) == ["records.jsonl"]  # no PNG, nothing written


@pytest.mark.parametrize(("name", "message"), [
    ("notes.txt", "the picture is a PNG; give a file name ending in .png"),
    ("keep.png", "exists; pass --overwrite to replace it"),
    ("fifo.png", "exists and is not a regular file")])
def test_report_out_never_replaces_a_users_file(run_text: str, tmp_path: Path, name: str,
                                                message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The attack of the merged main: ``--out notes.txt`` and ``--out keep.png`` replaced the
    user's files with the picture, and a FIFO with a regular file."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "records.jsonl").write_text(run_text)
    out = tmp_path / name
    if name.startswith("fifo"):
        os.mkfifo(out)
    else:
        out.write_text("the user's own")
    assert main(["monitor-report", str(tmp_path / "run"), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert out.is_fifo() if name.startswith("fifo") else out.read_text() == "the user's own"
    if name == "keep.png":  # replaced on purpose
        assert main(["monitor-report", str(tmp_path / "run"), "--out", str(out),
                     "--overwrite"]) == 0
        assert out.read_bytes().startswith(b"\x89PNG")
