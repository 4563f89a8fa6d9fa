"""`hookscope tree` and `hookscope capture` on the real pretrained models, run as a user would.

Each real model is loaded once for this file (the commands' ``load_model`` is swapped for a
cached one); one test runs the real command end to end in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import hookscope
from hookscope.cli import _common as cli_common
from hookscope.cli.main import main
from hookscope.zoo.inputs import load_inputs
from hookscope.zoo.models import LoadedModel, load_model
from hookscope.zoo.viz import FIGURE_SIZE_PX

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply."]


@pytest.fixture(scope="module")
def cached_load() -> Callable[..., LoadedModel]:
    cache: dict[tuple[str, str], LoadedModel] = {}

    def load(spec: str, **options: object) -> LoadedModel:
        key = (spec, repr(sorted(options.items())))
        if key not in cache:
            cache[key] = load_model(spec, **options)  # type: ignore[arg-type]
        return cache[key]
    return load


@pytest.fixture(autouse=True)
def _load_each_model_once(monkeypatch: pytest.MonkeyPatch,
                          cached_load: Callable[..., LoadedModel]) -> None:
    monkeypatch.setattr(cli_common, "load_model", cached_load)  # every verb loads through it


def _table(stdout: str, header: str = "path") -> list[list[str]]:
    """The rows of the table whose header line starts with ``header``, split on 2+ spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header + " "))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append([cell for cell in line.split("  ") if cell.strip()])
    return [[cell.strip() for cell in row] for row in rows]


def test_readme_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                        cached_load: Callable[..., LoadedModel]) -> None:
    out, saved = tmp_path / "out", tmp_path / "acts.safetensors"
    code = main(["capture", "efficientnet-lite0", "--input", "sample:chelsea",
                 "--layers", "_blocks.*", "--plot", str(out), "--save", str(saved)])
    stdout, stderr = capsys.readouterr()
    assert code == 0
    assert stdout.startswith("sample:chelsea: top-5 ImageNet classes\n")
    top = _table(stdout, "class")
    assert top[0][:2] == ["285", "Egyptian cat"] and float(top[0][2]) == pytest.approx(0.76, abs=0.05)
    assert [row[0] for row in top[1:3]] == ["281", "282"]  # tabby, tiger cat
    rows = _table(stdout)
    assert [row[0] for row in rows] == [f"_blocks.{i}" for i in range(16)]
    assert rows[0][1:4] == ["0", "1x16x112x112", "float32"]
    assert rows[15][2] == "1x320x7x7"
    assert "loading efficientnet-lite0" in stderr and "wrote 16 PNGs" in stderr
    pngs = sorted(out.iterdir())
    assert len(pngs) == 16 and all(Image.open(p).size == FIGURE_SIZE_PX for p in pngs)

    # The saved tensors are exactly what a plain forward hook sees.
    model = cached_load("efficientnet-lite0")
    seen: list[torch.Tensor] = []
    handle = model.module._blocks[3].register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        load_inputs(["sample:chelsea"], model).call(model.module)
    finally:
        handle.remove()
    tensors = hookscope.load(saved)
    assert sorted(tensors) == sorted(f"_blocks.{i}" for i in range(16))
    assert torch.equal(tensors["_blocks.3"], seen[0])
    with safe_open(str(saved), "pt") as handle_file:
        metadata = handle_file.metadata()
    assert metadata["hookscope.model"] == "efficientnet-lite0"
    assert json.loads(metadata["hookscope.inputs"]) == ["sample:chelsea"]
    assert json.loads(metadata["hookscope.layers"]) == ["_blocks.*"]
    assert json.loads(metadata["hookscope.records"])["_blocks.3"] == {"path": "_blocks.3", "call": 0}


def test_container_fails_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["capture", "efficientnet-lite0", "--input", "sample:chelsea", "--layers", "_blocks"])
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == ""
    assert "error: '_blocks' is a torch.nn.modules.container.ModuleList" in stderr
    assert "select '_blocks.*' (matches 16 modules" in stderr
    assert "input sample:chelsea" not in stderr  # nothing was read or run
    assert "Traceback" not in stderr


def test_every_call_of_the_shared_swish_is_a_row(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "swish.safetensors"
    assert main(["capture", "efficientnet-lite0", "--input", "sample:chelsea",
                 "--layers", "_blocks.*._swish", "--save", str(saved)]) == 0
    rows = _table(capsys.readouterr().out)
    calls = {}
    for path, call, *_ in rows:
        calls.setdefault(path, []).append(int(call))
    assert calls["_blocks.0._swish"] == [0]  # expand ratio 1: depthwise only
    assert all(calls[f"_blocks.{i}._swish"] == [0, 1] for i in range(1, 16))
    assert rows[1][:3] == ["_blocks.1._swish", "0", "1x96x112x112"]
    assert rows[2][:3] == ["_blocks.1._swish", "1", "1x96x56x56"]
    assert float(rows[1][6]) == 0.0 and float(rows[1][7]) == 6.0  # ReLU6: min 0, max 6
    tensors = hookscope.load(saved)
    assert tensors["_blocks.1._swish:1"].shape == (1, 96, 56, 56)
    assert len(tensors) == 31


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "efficientnet-lite0", "--input", "sample:chelsea",
                 "--input", "sample:coffee", "--layers", "_conv_stem", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    classes = data["prediction"]["classes"]
    assert classes["sample:chelsea"][0]["class"] == 285
    assert classes["sample:coffee"][0]["name"] == "espresso"
    (record,) = data["records"]
    assert record["path"] == "_conv_stem" and record["shape"] == [2, 32, 112, 112]
    assert set(record) >= {"call", "dtype", "mean", "std", "min", "max", "zeros", "nonfinite"}


def test_bf16_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "efficientnet-lite0@bf16", "--input", "sample:chelsea",
                 "--layers", "_fc"]) == 0
    stdout = capsys.readouterr().out
    assert _table(stdout, "class")[0][:2] == ["285", "Egyptian cat"]
    assert _table(stdout)[0][:4] == ["_fc", "0", "1x1000", "bfloat16"]


def test_save_never_overwrites_without_the_flag(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "acts.safetensors"
    saved.write_bytes(b"keep me")
    argv = ["capture", "efficientnet-lite0", "--input", "sample:chelsea", "--layers", "_fc",
            "--save", str(saved)]
    assert main(argv) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert saved.read_bytes() == b"keep me"
    assert main(argv + ["--overwrite"]) == 0
    assert hookscope.load(saved)["_fc"].shape == (1, 1000)


def test_unfired_module_as_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capture", "tests.models:UnusedBranch", "--input", "randn:2,4", "--layers", "aux_head",
            "--layers", "head"]
    assert main(argv + ["--on-unfired", "error"]) == 1
    assert "aux_head" in capsys.readouterr().err
    assert main(argv + ["--on-unfired", "ignore"]) == 0
    assert [row[0] for row in _table(capsys.readouterr().out)] == ["head"]
    assert main(argv) == 0  # default: warn on stderr, in one readable paragraph
    stderr = capsys.readouterr().err
    assert "warning: " in stderr and "aux_head" in stderr and "capture.py:" not in stderr


def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capture", "efficientnet-lite0", "--input", "sample:doge", "--layers", "_fc"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("error: unknown sample 'doge': choose one of astronaut")


def test_missing_layer_is_usage_error() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["capture", "efficientnet-lite0", "--input", "sample:chelsea"])
    assert caught.value.code == 2


def test_minilm_layers_on_two_sentences(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        cached_load: Callable[..., LoadedModel]) -> None:
    out = tmp_path / "plots"
    assert main(["capture", "minilm", "--layers", "encoder.layer.*", "--input", SENTENCES[0],
                 "--input", SENTENCES[1], "--input", SENTENCES[2], "--plot", str(out)]) == 0
    stdout = capsys.readouterr().out
    similarity = _table(stdout, "#")
    assert [float(v) for v in similarity[0][2:]][0] == pytest.approx(1.0, abs=1e-4)
    paraphrase, unrelated = float(similarity[0][3]), float(similarity[0][4])
    assert paraphrase > 0.5 > unrelated  # cat/kitten sentences agree, stocks do not
    rows = _table(stdout)
    model = cached_load("minilm")
    tokens = model.tokenizer(SENTENCES, padding=True, return_tensors="pt")["input_ids"].shape[1]
    assert [row[0] for row in rows] == [f"encoder.layer.{i}" for i in range(6)]
    assert all(row[1:4] == ["0", f"3x{tokens}x384", "float32"] for row in rows)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"encoder.layer.{i}.png" for i in range(6))


def test_tree_with_input_filter_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tree", "efficientnet-lite0", "--input", "sample:chelsea",
                 "--filter", "_blocks.*._swish"]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows[1][:6] == ["_blocks.1._swish", "ReLU6", "0", "0", "2",
                           "1x96x112x112 float32 | 1x96x56x56 float32"]
    assert main(["tree", "efficientnet-lite0", "--depth", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    blocks = next(row for row in data if row["path"] == "_blocks")
    assert blocks["container"] and blocks["note"] == (
        "container, no forward: select '_blocks.*' (16 modules)")
    assert data[0]["params"] == 4_652_008 and max(row["depth"] for row in data) == 1


def test_python_m_hookscope_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "hookscope", "capture", "efficientnet-lite0", "--input",
         "sample:chelsea", "--layers", "_conv_stem", "--layers", "_swish"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "285    Egyptian cat" in result.stdout
    assert [row[:3] for row in _table(result.stdout)] == [
        ["_conv_stem", "0", "1x32x112x112"], ["_swish", "0", "1x32x112x112"],
        ["_swish", "1", "1x1280x7x7"]]
    assert result.stderr.startswith("loading efficientnet-lite0 ...")
    assert "Loaded pretrained weights" not in result.stdout + result.stderr


def test_capture_std_is_the_population_std(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(1)
    torch.save(torch.randn(2, 3, 32, 32), tmp_path / "x.pt")
    assert main(["capture", "tests.models:LeNet", "--input", str(tmp_path / "x.pt"),
                 "--layers", "conv1", "--json", "--save", str(tmp_path / "acts.safetensors")]) == 0
    (record,) = json.loads(capsys.readouterr().out)["records"]
    out = load_file(tmp_path / "acts.safetensors")["conv1"].double()  # the values the row is of
    assert record["std"] == pytest.approx(float(out.std(correction=0)), rel=1e-9)
    assert record["std"] != pytest.approx(float(out.std()), rel=1e-9)  # not the sample std (n-1)
