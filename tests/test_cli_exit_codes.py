"""Every verb's bad invocations, one table: the exit code of the one rule (0 ok, 1 the run
failed, 2 usage, 130 interrupted; ``cli.main.EXIT_CODES``), a message naming the flag or value at
fault, no traceback, and no file left behind in the working folder."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hookscope.cli.main import EXIT_CODES, _verbs, build_parser, main
from hookscope.zoo.models import load_model

MODELS = textwrap.dedent('''
    import sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    class Two(nn.Module):  # F.relu twice in its own forward: '::relu#0', '::relu#1'
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 3)
            self.fc2 = nn.Linear(3, 2)

        def forward(self, x):
            return F.relu(self.fc2(F.relu(self.fc1(x))))

    def build():
        torch.manual_seed(0)
        return Two()

    def bye():
        sys.exit(3)
''')

M, IN, L = "m.py:build", ["--input", "randn:2,4"], ["--layers", "fc1"]
HUGE = "randn:99999999999,99999999999"

# (verb, argv, exit code, text the message must hold)
CASES: list[tuple[str, list[str], int, str]] = [
    # bad model spec: a missing file, a factory that calls sys.exit(3)
    *[(verb, [verb, "nosuch.py:build", *rest], 2, "nosuch.py") for verb, rest in [
        ("tree", []), ("capture", [*IN, *L]), ("attention", [*IN, *L]), ("nan", IN),
        ("stats", IN), ("extract", ["--data", "x.pt", *L, "--out", "s"])]],
    ("diff", ["diff", M, "nosuch.py:build", *IN], 2, "nosuch.py"),
    *[(verb, [verb, "m.py:bye", *rest], 1, "exited with code 3") for verb, rest in [
        ("tree", []), ("capture", [*IN, *L]), ("stats", IN), ("nan", IN)]],
    # bad input
    *[(verb, [verb, M, "--input", bad, *rest], 2, needle) for verb, rest in [
        ("tree", []), ("capture", L), ("attention", L), ("nan", []), ("stats", [])]
      for bad, needle in [("nofile.npy", "nofile.npy"), ("randn:0,4", "randn:0,4"),
                          (HUGE, "RANDN_MAX_ELEMENTS"), ("empty/", "no image file")]],
    ("diff", ["diff", M, M, "--input", HUGE], 2, "RANDN_MAX_ELEMENTS"),
    ("stats", ["stats", M, "--data", "nofile.pt"], 2, "--data"),
    ("capture", ["capture", M, "--input", "x.pt:nokey", *L], 2, "drop ':nokey'"),
    ("stats", ["stats", M, *IN, "--data", "x.pt"], 2, "--data"),
    ("stats", ["stats", M], 2, "--input"),
    ("extract", ["extract", M, "--data", "nofile.pt", *L, "--out", "s"], 2, "--data"),
    ("capture", ["capture", M, "--input", "randn:2,5", *L], 1, "failed on input randn:2,5"),
    # bad layer: an unknown path, a function address that matches nothing in the model
    *[(verb, [verb, M, *rest, "--layers", "nosuch"], 2, "nosuch") for verb, rest in [
        ("capture", IN), ("attention", IN), ("stats", IN), ("diff", [M, *IN]),
        ("extract", ["--data", "x.pt", "--out", "s"])]],
    *[("capture", ["capture", M, *IN, "--layers", address], 2, f"--layers {address}")
      for address in ("fc1::nosuchfn", "::nosuchfn", "::relu#99")],
    ("tree", ["tree", M, "--filter", "nosuch"], 2, "nosuch"),
    *[("extract", ["extract", M, "--data", "x.pt", "--out", "s", "--layers", address], code, text)
      for address, code, text in [("::nosuchfn", 2, "--ops"), ("fc1::nosuchfn", 2, "--ops"),
                                  ("::relu", 1, "'::relu#0' … '::relu#1'")]],
    # bad device
    *[("extract", ["extract", M, "--data", "x.pt", *L, "--out", "s", "--device", device], 2,
       "--device") for device in ("nonsense", "cuda:7", "meta")],
    # bad numbers, at parse time
    ("attention", ["attention", M, *IN, *L, "--sample", "-1"], 2, "--sample"),
    ("attention", ["attention", M, *IN, *L, "--sample", "2"], 2, "--sample 2"),
    ("stats", ["stats", M, *IN, "--batch-size", "0"], 2, "--batch-size"),
    ("tree", ["tree", M, "--depth", "-1"], 2, "--depth"),
    ("stats", ["stats", M, *IN, "--per-channel", "7"], 2, "dimension 7"),
    ("stats", ["stats", M, *IN, "--per-channel", "-9"], 2, "dimension -9"),
    ("extract", ["extract", M, "--data", "x.pt", *L, "--out", "s", "--resume", "--overwrite"], 2,
     "--overwrite: not allowed with argument --resume"),
    # a single-value flag given twice: refused, not "the last one wins"
    ("gradcam", ["gradcam", M, *IN, "--layers", "fc1", "--layers", "fc2"], 2, "--layers was given twice"),
    ("lens", ["lens", M, *IN, "--top-k", "2", "--top-k", "3"], 2, "--top-k was given twice"),
    ("diff", ["diff", M, M, *IN, "--atol", "nan"], 2, "--atol"),
    ("extract", ["extract", M, "--data", "x.pt", *L, "--out", "s", "--batch-size", "0"], 2,
     "--batch-size"),
    ("capture", ["capture", M, *IN, *L, "--image-size", "0"], 2, "--image-size"),
    ("capture", ["capture", M, *IN, *L, "--std", "0,1,1"], 2, "--std"),
    # missing, occupied or impossible output
    ("capture", ["capture", M, *IN, *L, "--save", "missing/dir/x.safetensors"], 2, "--parents"),
    ("capture", ["capture", M, *IN, *L, "--save", "x.pt/x.safetensors"], 2, "is a file"),
    ("capture", ["capture", M, *IN, *L, "--save", "x.pt.safetensors"], 2, "--overwrite"),
    ("capture", ["capture", M, *IN, *L, "--plot", "missing/dir"], 2, "--plot"),
    ("attention", ["attention", M, *IN, *L, "--out", "missing/dir"], 2, "--out"),
    ("diff", ["diff", M, M, *IN, "--pair", "auto", "--plot", "missing/dir"], 2, "--plot"),
    ("diff", ["diff", M, M, *IN, "--plot", "p"], 2, "--pair auto"),
    ("extract", ["extract", M, "--data", "x.pt", *L, "--out", "missing/s"], 2, "--parents"),
    ("extract", ["extract", M, "--data", "x.pt", *L, "--out", "full"], 2, "--overwrite"),
    ("monitor-report", ["monitor-report", "run", "--out", "missing/m.png"], 2, "--parents"),
    ("monitor-report", ["monitor-report", "full"], 2, "records.jsonl"),
    ("show", ["show", "nosuchstore"], 2, "nosuchstore"),
    ("show", ["show", "full"], 2, "full"),
    ("probe", ["probe", "nosuchstore"], 2, "nosuchstore"),
    ("probe", ["probe", "full"], 2, "full"),
    # gradcam and lens: a spec, layer, input or output they cannot use
    *[(verb, [verb, "nosuch.py:build", *rest], 2, "nosuch.py") for verb, rest in [
        ("gradcam", [*IN, *L]), ("lens", IN)]],
    ("gradcam", ["gradcam", "m.py:bye", *IN, *L], 1, "exited with code 3"),
    ("gradcam", ["gradcam", M, *IN, "--layers", "nosuch"], 2, "nosuch"),
    ("gradcam", ["gradcam", M, *IN, *L], 2, "not images"),
    ("gradcam", ["gradcam", M, *IN, *L, "--target", "-1"], 2, "--target"),
    ("lens", ["lens", M, *IN], 2, "token ids"),
    ("lens", ["lens", M, *IN, "--top-k", "0"], 2, "--top-k"),
    *[(verb, [verb, M, "--input", "nofile.npy", *rest], 2, "nofile.npy") for verb, rest in [
        ("gradcam", L), ("lens", [])]],
    *[(verb, [verb, M, *IN, *rest, "--out", "missing/dir"], 2, "--parents") for verb, rest in [
        ("gradcam", L), ("lens", [])]],
]


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the model file, a tensor file, an empty folder, a non-empty folder."""
    (tmp_path / "m.py").write_text(MODELS)
    torch.save(torch.randn(3, 4), tmp_path / "x.pt")
    (tmp_path / "x.pt.safetensors").write_text("not mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("the user's")
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _exit_code(argv: list[str]) -> int:
    """``main(argv)``, or the code of argparse's ``SystemExit`` (usage errors at parse time)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        assert isinstance(exit_.code, int)
        return exit_.code


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else b""
            for p in folder.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.parametrize(("verb", "argv", "code", "needle"), CASES,
                         ids=[" ".join(c[1]) for c in CASES])
def test_bad_invocation(workdir: Path, capsys: pytest.CaptureFixture[str], verb: str,
                        argv: list[str], code: int, needle: str) -> None:
    before = _listing(workdir)
    got = _exit_code(argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert needle in err
    assert "Traceback" not in err
    assert "error: " in err
    assert _listing(workdir) == before  # nothing written, nothing removed


def test_the_table_covers_every_verb() -> None:
    missing = set(v.replace("_", "-") for v in _verbs()) - {verb for verb, *_ in CASES}
    assert not missing, f"add bad invocations of {sorted(missing)} to CASES"


def test_help_and_the_docs_table_name_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    verbs = [v.replace("_", "-") for v in _verbs()]
    assert "attention" in verbs and "monitor-report" in verbs
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    first = capsys.readouterr().out.split("\n\n")[1]  # the description, after the usage line
    assert first == f"Look inside PyTorch models by module name: {', '.join(verbs)}."
    table = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    assert [v for v in verbs if f"| `hookscope {v} " not in table] == []


def test_help_states_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["capture", "--help"]):
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(argv)
        assert done.value.code == 0
        assert EXIT_CODES in capsys.readouterr().out
    for code in ("0 ", "1 ", "2 ", "130 "):
        assert f"\n  {code}" in EXIT_CODES


def test_parents_creates_the_folders(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", M, *IN, *L, "--save", "a/b/x.safetensors", "--parents"]) == 0
    saved = load_file(workdir / "a" / "b" / "x.safetensors")
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(saved["fc1"], fc1(x).detach())


def test_function_address_that_fires_is_still_fine(workdir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", M, *IN, "--layers", "::relu#1"]) == 0
    captured = capsys.readouterr()
    assert "holds no tensor" not in captured.err
    assert captured.out.splitlines()[1].split()[:3] == ["::relu#1", "0", "2x2"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_unwritable_output_folder(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = workdir / "locked"
    locked.mkdir(mode=0o500)
    assert main(["capture", M, *IN, *L, "--save", "locked/x.safetensors"]) == 2
    assert "not writable" in capsys.readouterr().err


def test_extract_names_calls_and_addresses_in_words_for_both(workdir: Path) -> None:
    """The same refusals in Python: '::relu' runs twice per forward (pick '::relu#k'), and an
    address that matches nothing is a SelectorError with a hint for the CLI and Python."""
    import hookscope
    from hookscope.errors import ExtractError, SelectorError
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    data = [torch.randn(3, 4)]  # one batch of three rows
    twice = load_model(M).module  # the table's model, F.relu twice in its own forward
    with pytest.raises(ExtractError, match=r"'::relu' ran 2 times in one forward pass.*"
                                           r"'::relu#0' … '::relu#1'"):
        hookscope.extract(twice, data, "::relu", workdir / "a", progress=False)
    with pytest.raises(SelectorError, match=r"never ran on the first batch(.|\n)*"
                                            r"tree_of_call") as caught:
        hookscope.extract(model, data, "0::nosuchfn", workdir / "b", progress=False)
    assert "err.capture" not in str(caught.value)
    assert not (workdir / "a").exists() and not (workdir / "b").exists()
    store = hookscope.extract(twice, data, "::relu#1", workdir / "c", progress=False)
    with torch.no_grad():
        expected = torch.relu(twice.fc2(torch.relu(twice.fc1(data[0]))))
    torch.testing.assert_close(store["::relu#1"][:], expected)



@pytest.mark.parametrize("bad", ["{not json", "5", "[1, 2]"])
def test_monitor_report_names_the_file_and_line_of_a_damaged_record(
        workdir: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    (workdir / "run" / "records.jsonl").write_text('{"event": "start", "rank": 0}\n' + bad + "\n")
    before = _listing(workdir)
    assert main(["monitor-report", "run"]) == 1  # a file that cannot be read: the run failed
    err = capsys.readouterr().err
    assert f"records.jsonl, line 2: not a monitor record (a JSON object): {bad!r}" in err
    assert "Traceback" not in err
    assert _listing(workdir) == before
