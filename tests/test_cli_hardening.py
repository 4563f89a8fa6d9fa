"""The command line as an attacker and a careless user try it: bad numbers fail at parse time
on every verb, --version, options before MODEL, file-system errors named with the fix, file
permissions, Ctrl-C, model folders with code, pickled inputs, shapes that differ in diff."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.cli.main import main
from hookscope.util.files import advice, write_atomic

ROOT = Path(__file__).resolve().parents[1]
MODELS = textwrap.dedent('''
    from torch import nn

    import torch

    def small():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))

    def wide():  # the same first layer as small(), another output width
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 5))

    class Own(nn.Sequential):
        pass

    def own():
        return Own(nn.Linear(4, 3))
''')


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    file = tmp_path / "two.py"
    file.write_text(MODELS)
    return file


def _run(*args: str, stdin: str | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, "-m", "hookscope", *args], capture_output=True,
                          text=True, input=stdin, env=env, cwd=cwd, timeout=120)


# ----------------------------------------------------------------------- numbers at parse time
BAD_NUMBERS = [
    ("extract", "--batch-size", "0"), ("extract", "--batch-size", "-3"),
    ("extract", "--batch-size", "many"), ("extract", "--shard-bytes", "0"),
    ("extract", "--shard-bytes", "-1M"), ("extract", "--shard-bytes", "lots"),
    ("extract", "--shard-seconds", "0"), ("extract", "--shard-seconds", "nan"),
    ("extract", "--shard-seconds", "-5"), ("extract", "--ray-actors", "0"),
    ("tree", "--depth", "-1"), ("tree", "--depth", "1.5"),
    ("stats", "--batch-size", "0"), ("stats", "--batch-size", "-2"),
    ("stats", "--per-channel", "x"), ("diff", "--atol", "-1"), ("diff", "--atol", "nan"),
    ("diff", "--rtol", "inf"), ("diff", "--rtol", "-0.1"),
]
_REST = {"extract": ["m.py:f", "--data", "d", "--layers", "x", "--out"],
         "tree": ["m.py:f"], "stats": ["m.py:f", "--input", "randn:1,4"],
         "diff": ["a.py:f", "b.py:f", "--input", "randn:1,4"]}


@pytest.mark.parametrize(("verb", "flag", "value"), BAD_NUMBERS)
def test_every_bad_number_is_one_line_exit_2_before_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], verb: str, flag: str,
        value: str) -> None:
    out = tmp_path / "out"
    rest = [*_REST[verb], str(out)] if verb == "extract" else _REST[verb]
    with pytest.raises(SystemExit) as caught:
        main([verb, *rest, f"{flag}={value}"])
    err = capsys.readouterr().err
    assert caught.value.code == 2
    assert err.count("\n") == 1, err
    assert f"hookscope {verb}: error: argument {flag}" in err
    assert f"{value!r} is not" in err and "give e.g." in err
    assert not out.exists()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"hookscope {hookscope.__version__}\n"
    result = _run("--version")
    assert (result.returncode, result.stdout) == (0, f"hookscope {hookscope.__version__}\n")


# ------------------------------------------------------------ options with several values
def test_input_before_model_does_not_swallow_it(models: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tree", "--input", "randn:2,4", f"{models}:small"]) == 0
    assert "Linear" in capsys.readouterr().out
    assert main(["capture", "--layers", "0", "2", "--input", "randn:2,4", f"{models}:small",
                 "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["records"]
    assert [(r["path"], r["shape"]) for r in records] == [("0", [2, 3]), ("2", [2, 2])]
    assert main(["diff", "--input", "randn:1,4", f"{models}:small", f"{models}:small"]) == 0


def test_a_missing_model_is_still_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["tree", "--input", "randn:2,4"])
    assert caught.value.code == 2
    assert "the following arguments are required: MODEL" in capsys.readouterr().err


# -------------------------------------------------------------------------- file-system errors
@pytest.mark.parametrize(("number", "words"), [
    (errno.ENOSPC, "the disk is full"), (errno.EACCES, "permission denied: choose a folder"),
    (errno.EROFS, "read-only: choose a folder"), (errno.ENOTDIR, "a part of the path is a file")])
def test_file_system_errors_name_the_path_and_the_fix(tmp_path: Path, number: int,
                                                      words: str) -> None:
    target = tmp_path / "acts.safetensors"

    def fail(tmp: str) -> None:
        assert Path(tmp).name.startswith(".acts.safetensors.tmp-")  # named by its target
        Path(tmp).write_bytes(b"partial")
        raise OSError(number, os.strerror(number))

    with pytest.raises(OSError) as caught:
        write_atomic(target, fail)
    assert caught.value.filename == str(target)  # the target, not the temporary name
    assert advice(caught.value).startswith(f"cannot use {target}: ") and words in \
        advice(caught.value)
    assert os.listdir(tmp_path) == []  # no temporary file left


def test_save_under_a_file_is_one_line_naming_the_path(models: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plain").write_text("a file")
    target = tmp_path / "plain" / "acts.safetensors"
    assert main(["capture", f"{models}:small", "--layers", "0", "--input", "randn:2,4",
                 "--save", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot use {tmp_path / 'plain'}" in err or f"error: cannot use {target}" in err
    assert "a part of the path is a file" in err and "Traceback" not in err


def test_disk_full_during_extract_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        models: Path) -> None:
    from hookscope.store import writer as _store_writer

    class Full:
        """A file on a full disk: every write fails."""

        def write(self, data: memoryview) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    write_hashed = _store_writer._write_hashed  # the real one
    monkeypatch.setattr(_store_writer, "_write_hashed",
                        lambda f, pieces, digest, sums: write_hashed(Full(), pieces, digest, sums))
    torch.save(torch.randn(6, 4), tmp_path / "rows.pt")
    out = tmp_path / "store"
    assert main(["extract", f"{models}:small", "--data", str(tmp_path / "rows.pt"), "--layers", "0",
                 "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot use {out / 'shard-00000.safetensors'}: the disk is full" in err
    assert sorted(os.listdir(out)) == ["manifest.json"]  # the interrupted store, no temporaries


def test_extract_data_takes_file_key_as_input_does(models: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # finding 05: --input x.safetensors:ids worked, --data x.safetensors:ids "does not exist"
    from safetensors.torch import save_file
    rows = torch.randn(6, 4)
    save_file({"rows": rows, "other": torch.zeros(2, 4)}, str(tmp_path / "d.safetensors"))
    data = f"{tmp_path / 'd.safetensors'}:rows"
    assert main(["extract", f"{models}:small", "--data", data, "--layer", "0",
                 "--out", str(tmp_path / "s"), "--no-progress"]) == 0
    torch.manual_seed(0)
    expected = nn.Linear(4, 3)(rows)
    assert torch.allclose(hookscope.open_store(tmp_path / "s")["0"][0:6], expected)
    assert main(["extract", f"{models}:small", "--data", str(tmp_path / "d.safetensors"),
                 "--layer", "0", "--out", str(tmp_path / "s2"), "--no-progress"]) == 2
    assert "pick one with" in capsys.readouterr().err
    assert main(["extract", f"{models}:small", "--data", f"{tmp_path / 'd.safetensors'}:nokey",
                 "--layer", "0", "--out", str(tmp_path / "s3"), "--no-progress"]) == 2
    assert "has no tensor 'nokey'; it holds" in capsys.readouterr().err


def test_written_files_get_the_umask_permissions(models: Path, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        assert main(["capture", f"{models}:small", "--layers", "0", "--input", "randn:2,4",
                     "--save", str(tmp_path / "a.safetensors")]) == 0
        torch.save(torch.randn(6, 4), tmp_path / "rows.pt")
        assert main(["extract", f"{models}:small", "--data", str(tmp_path / "rows.pt"),
                     "--layers", "0", "--out", str(tmp_path / "s"), "--no-progress"]) == 0
    finally:
        os.umask(old)
    written = [tmp_path / "a.safetensors", *(tmp_path / "s").iterdir()]
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o644)}


# -------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.3, 1.5])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(models: Path, tmp_path: Path,
                                                       delay_s: float) -> None:
    """From the first line hookscope prints on (the progress bar of extract): running,
    writing shards (one every 10 ms), shutting down. Before it, Python imports torch for
    ``import hookscope`` (see the report: not covered)."""
    torch.save(torch.randn(100000, 4), tmp_path / "rows.pt")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "hookscope", "extract", f"{models}:small", "--data",
         str(tmp_path / "rows.pt"), "--layers", "0", "--out", str(tmp_path / "s"),
         "--batch-size", "1", "--shard-seconds", "0.01"], stderr=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env=env,
        # a background shell's "SIGINT ignored" would be inherited: the child takes the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.stderr is not None
    first = process.stderr.read(1)  # hookscope is running its own code now
    time.sleep(delay_s)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    err = first + err
    lines = err.strip().splitlines()
    assert process.returncode == 130, err
    assert [line for line in lines if line.startswith("interrupted")], err  # says so, once
    assert lines[-1].strip().startswith("hookscope extract ") and lines[-1].endswith(" --resume")
    assert "Traceback" not in err
    assert not [n for n in os.listdir(tmp_path / "s") if ".tmp-" in n]


# ------------------------------------------------------------- code the user did not name
@pytest.mark.slow
def test_model_folder_with_custom_code_is_refused_without_asking(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    marker = tmp_path / "ran.txt"
    (folder / "config.json").write_text(
        '{"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig", '
        '"AutoModel": "evil.EvilModel"}}')
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    result = _run("tree", f"hf:{folder}", stdin="y\n" * 1000, cwd=tmp_path)
    assert result.returncode == 2
    assert "config.json has \"auto_map\": evil.py" in result.stderr
    assert "'my_model.py:build'" in result.stderr and "never runs code from a model folder" in \
        result.stderr
    assert not marker.exists()


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_pickled_input_is_refused_in_hookscopes_words(models: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "ran.txt"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(_Payload(marker)))
    assert main(["capture", f"{models}:small", "--layers", "0", "--input", str(evil)]) == 2
    err = capsys.readouterr().err
    assert f"error: '{evil}' holds Python objects, not plain tensors" in err
    assert "weights_only=False" not in err and "Traceback" not in err
    assert not marker.exists()


@pytest.mark.slow
def test_manifest_model_class_is_the_same_in_every_process(models: Path, tmp_path: Path) -> None:
    code = ("from hookscope.zoo.models import load_model; "
            "from hookscope.store.extraction import _class_name; "
            f"print(_class_name(load_model({f'{models}:own'!r}).module))")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}"}
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**env, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert len(seen) == 1 and next(iter(seen)).strip().endswith(".Own")


# ------------------------------------------------------------------------------------- diff
def test_diff_of_outputs_of_other_shapes_says_so(models: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", f"{models}:small", f"{models}:wide", "--input", "randn:2,4"]) == 1
    captured = capsys.readouterr()
    assert "(2, 2) vs (2, 5)" in captured.out
    assert "inf" not in captured.out
    assert "the outputs differ in shape, (2, 2) in" in captured.err
