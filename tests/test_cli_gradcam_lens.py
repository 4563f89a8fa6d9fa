"""`hookscope gradcam` (the bundled efficientnet-lite0) and `hookscope lens` (a GPT-2 built from a
config, saved as hf:DIR): PNGs on disk, no overwrite without --overwrite, exit codes, and printed
values equal to the Python API's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import hookscope
from hookscope.cli.main import main
from tests.models import tiny_gpt2

transformers = pytest.importorskip("transformers")
IDS = torch.tensor([[3, 9, 14, 2, 8], [4, 1, 22, 7, 30]])


@pytest.mark.slow
def test_gradcam_verb_writes_overlays_and_prints_the_api_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    from hookscope.zoo.inputs import load_inputs
    from hookscope.zoo.models import load_model

    out = tmp_path / "cams"
    argv = ["gradcam", "efficientnet-lite0", "--input", "sample:cat", "sample:astronaut",
            "--layers", "_conv_head", "--method", "layercam", "--target", "285", "--out", str(out),
            "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["gradcam_0.png", "gradcam_1.png"]
    assert Image.open(out / "gradcam_0.png").size == (1000, 460)  # figsize 10 x 4.6 at DPI 100
    loaded = load_model("efficientnet-lite0")
    x = load_inputs(["sample:cat", "sample:astronaut"], loaded).args[0]
    cams = hookscope.gradcam(loaded.module, x, "_conv_head", target=285, method="layercam")
    with torch.no_grad():
        logits = loaded.module(x)
    for i, row in enumerate(rows):
        assert (row["class"], row["name"]) == (285, "Egyptian cat")
        assert row["logit"] == pytest.approx(float(logits[i, 285]), rel=1e-5)
        assert row["peak_yx"] == _first_near_max(cams[i])
    before = (out / "gradcam_0.png").read_bytes()
    assert main(argv) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (out / "gradcam_0.png").read_bytes() == before
    assert main([*argv, "--overwrite"]) == 0


def test_gradcam_verb_usage_and_run_failures(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["gradcam", "tests.functional_models:two_blocks", "--input", "randn:1,5,16",
              "--layers", "0", "--method", "cam"])
    assert usage.value.code == 2
    assert "invalid choice: 'cam'" in capsys.readouterr().err
    assert main(["gradcam", "tests.functional_models:two_blocks", "--input", "randn:1,5,16",
                 "--layers", "0", "--out", str(tmp_path / "o")]) == 2
    assert "are not images" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("gpt2")
    tiny_gpt2(pad=False).save_pretrained(folder / "model")
    torch.save(IDS, folder / "ids.pt")
    return folder / "model", folder / "ids.pt"


def test_lens_verb_prints_the_api_table_and_writes_the_png(
        saved_gpt2: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    model, ids = saved_gpt2
    out = tmp_path / "lens"
    argv = ["lens", f"hf:{model}", "--input", str(ids), "--top-k", "4", "--sample", "1",
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    lens = hookscope.logit_lens(loaded, IDS)
    assert printed[0] == "top 4 next tokens at position 4 of input 1"
    assert printed[1:] == lens.table(4, row=1, position=4).splitlines()
    assert [line.split()[0] for line in printed[1:]] == ["resid_post.0", "resid_post.1"]
    top = lens.top(4)[1][-1, 1, 4].tolist()  # the last block's top 4 = the model's own logits
    assert top == loaded(IDS).logits[1, 4].topk(4).indices.tolist()
    assert Image.open(out / "logit_lens.png").size == (1600, 800)
    assert main(argv) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--layers", "transformer.h.1"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [
        "transformer.h.1"]


def test_lens_verb_refusals(saved_gpt2: tuple[Path, Path], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    model, ids = saved_gpt2
    assert main(["lens", f"hf:{model}", "--input", "randn:1,5", "--out", str(tmp_path)]) == 2
    assert "give a text (a model with a tokenizer) or a (batch, seq) integer" in (
        capsys.readouterr().err)
    assert main(["lens", f"hf:{model}", "--input", str(ids), "--sample", "2"]) == 2
    assert "--sample 2 is not a row of this batch of 2: give 0 … 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["lens", f"hf:{model}", "--input", str(ids), "--top-k", "0"])
    assert usage.value.code == 2
    assert list(tmp_path.iterdir()) == []


def test_gradcam_verb_on_a_vit_saved_as_hf_dir(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Token outputs laid on the 4 x 4 patch grid, through `hf:DIR` with its image processor."""
    from hookscope.zoo.inputs import load_inputs
    from hookscope.zoo.models import load_model

    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2,
                                    hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                    num_labels=5)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "vit")
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(
        tmp_path / "vit")
    layer = "vit.layers.1.layernorm_before"
    assert main(["gradcam", f"hf:{tmp_path / 'vit'}", "--input", "sample:chelsea", "--layers",
                 layer, "--method", "gradcam++", "--target", "4", "--out",
                 str(tmp_path / "cams"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    loaded = load_model(f"hf:{tmp_path / 'vit'}")
    x = load_inputs(["sample:chelsea"], loaded).args[0]
    cam = hookscope.gradcam(loaded.module, x, layer, target=4, method="gradcam++")[0]
    assert (row["class"], row["name"]) == (4, "LABEL_4")
    with torch.no_grad():
        logit = float(loaded.module(x).logits[0, 4])
    assert row["logit"] == pytest.approx(logit, rel=1e-5)
    assert row["peak_yx"] == _first_near_max(cam)
    assert Image.open(tmp_path / "cams" / "gradcam_0.png").size == (1000, 460)


@pytest.mark.parametrize(("ids", "extra", "needle"), [
    ([[1, 500]], [], "ids from 1 to 500, but the model's vocabulary has 60 tokens"),
    ([[-1, 2]], [], "ids from -1 to 2"),
    ([[1, 2]], ["--top-k", "100000"], "--top-k 100000 is more tokens than the vocabulary has (60)"),
])
def test_lens_refuses_what_the_vocabulary_cannot_give_writing_nothing(
        saved_gpt2: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        ids: list[list[int]], extra: list[str], needle: str) -> None:
    """Issue 26: out-of-vocabulary or negative ids were a raw IndexError (exit 1), and a huge
    --top-k a torch RuntimeError after the PNG was written; both are usage (exit 2), and
    neither leaves the --out folder behind."""
    model, _ = saved_gpt2
    torch.save(torch.tensor(ids), tmp_path / "ids.pt")
    out = tmp_path / "lens"
    assert main(["lens", f"hf:{model}", "--input", str(tmp_path / "ids.pt"), "--out", str(out),
                 *extra]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_lens_run_leaves_no_empty_folder(saved_gpt2: tuple[Path, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model, ids = saved_gpt2
    out = tmp_path / "lens"
    assert main(["lens", f"hf:{model}", "--input", str(ids), "--layers", "lm_head",
                 "--out", str(out)]) == 1
    assert "residual stream" in capsys.readouterr().err
    assert not out.exists()


CNN = '''
from torch import nn

def cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 5))
'''


@pytest.mark.parametrize(("extra", "code", "needle"), [
    (["--layers", "0", "--target", "999"], 2, "--target 999 is not a class of this model, which has 5"),
    (["--layers", "4"], 1, "not a feature map"),
    (["--layers", "::relu"], 1, "never ran"),
])
def test_a_gradcam_run_refused_or_failed_leaves_no_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], code: int,
        needle: str) -> None:
    """Issue 26: these left an empty gradcam/ folder behind (and --target 999 exited 1)."""
    (tmp_path / "cnn.py").write_text(CNN)
    Image.new("RGB", (32, 32), (200, 30, 90)).save(tmp_path / "img.png")
    out = tmp_path / "cams"
    assert main(["gradcam", f"{tmp_path / 'cnn.py'}:cnn", "--input", str(tmp_path / "img.png"),
                 "--image-size", "32", "--out", str(out), *extra]) == code
    assert needle in capsys.readouterr().err
    assert not out.exists()


def _first_near_max(cam: torch.Tensor) -> list[int]:
    """The first pixel, row-major, within 1e-5 of the map's maximum (plain loops over rows)."""
    top = float(cam.max())
    for y, row in enumerate(cam.tolist()):
        for x, value in enumerate(row):
            if value >= top - 1e-5:
                return [y, x]
    raise AssertionError("no pixel near the maximum")


def test_a_plateau_peaks_at_its_first_pixel_whatever_the_rounding() -> None:
    """Bilinear upsampling of a 4x4 map to 32x32 holds plateaus of equal values (past the last
    cell centre, between two centres); noise at float32's rounding level moved ``argmax`` across
    them (the ViT docs block showed 11x28 on one CPU, 11x29 on another). The first pixel does not move."""
    from hookscope.cli.gradcam import peak_yx

    grid = torch.zeros(1, 1, 4, 4)
    grid[0, 0, 1, 3] = 1.0                        # the peak cell: row 1, last column
    cam = torch.nn.functional.interpolate(grid, size=(32, 32), mode="bilinear", align_corners=False)[0, 0]
    assert peak_yx(cam) == [11, 28]               # centre 11.5 (rows 11, 12 tie), past 27.5 (28-31)
    seen = set()
    for seed in range(8):
        noise = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)) * 1e-7
        assert peak_yx(cam + noise) == [11, 28]
        seen.add(divmod(int((cam + noise).argmax()), 32))
    assert len(seen) > 1                          # argmax alone differs between the roundings
