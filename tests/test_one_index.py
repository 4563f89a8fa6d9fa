"""One names index per session: resolving, the checks, the witnesses, the unfired report and
the error note all read the ``ModuleIndex`` the session built once (issue 19)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.engine.naming import names
from tests.models import MlpStack, UnusedBranch


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The models ``names.index`` walked, one entry per index built (each builds one
    ``ModuleIndex`` of the unwrapped root)."""
    walked: list[nn.Module] = []
    real = names.ModuleIndex

    def counting(root: nn.Module) -> names.ModuleIndex:
        walked.append(root)
        return real(root)

    monkeypatch.setattr(names, "ModuleIndex", counting)
    return walked


def test_capture_builds_one_index(builds: list[nn.Module]) -> None:
    model, x = MlpStack(), torch.randn(2, 10)
    with hookscope.capture(model, "fc1", "fc2") as acts:
        model(x)
    assert builds == [model]
    torch.testing.assert_close(acts["fc1"], model.fc1(x))


def test_capture_of_a_silent_module_explains_it_on_the_same_index(builds: list[nn.Module]) -> None:
    model = UnusedBranch()
    with pytest.warns(hookscope.HookNeverFiredWarning, match="aux_head"):
        with hookscope.capture(model, "aux_head", "head") as acts:
            model(torch.randn(2, 4))
    assert builds == [model] and set(acts.unfired) == {"aux_head"}


def test_the_error_note_reads_the_same_index(builds: list[nn.Module]) -> None:
    model = MlpStack()
    with pytest.raises(RuntimeError) as caught:
        with hookscope.capture(model, "fc1"):
            model(torch.randn(2, 7))  # fc1 takes 10 features
    assert builds == [model]
    assert "raised inside 'fc1' (Linear)" in "".join(caught.value.__notes__)


def test_edit_with_several_patterns_builds_one_index(builds: list[nn.Module]) -> None:
    model, x = MlpStack(), torch.randn(2, 10)
    with hookscope.edit(model, {"fc1": lambda o: o * 0, "relu": lambda o: o, "fc2": lambda o: o + 1}):
        out = model(x)
    assert builds == [model]
    torch.testing.assert_close(out, model.fc2.bias.detach().expand(2, 5) + 1)


def test_patch_with_source_pairs_builds_one_index(builds: list[nn.Module]) -> None:
    model, x = MlpStack(), torch.randn(2, 10)
    with hookscope.capture(model, "fc1", "fc2") as clean:
        model(x)
    builds.clear()
    with hookscope.patch(model, source=clean, layers={"fc1": "fc1", "fc2": "fc2"}):
        out = model(torch.randn(2, 10))
    assert builds == [model]
    torch.testing.assert_close(out, clean["fc2"])


def test_stats_builds_one_index(builds: list[nn.Module]) -> None:
    model, x = MlpStack(), torch.randn(4, 10)
    found = hookscope.stats(model, [x], layers=["fc1", "fc2"])
    assert builds == [model]
    torch.testing.assert_close(found["fc1"].mean, model.fc1(x).mean().detach().double())


def test_compare_builds_one_index_per_model(builds: list[nn.Module]) -> None:
    model_a, x = MlpStack(), torch.randn(2, 10)
    model_b = MlpStack()
    model_b.load_state_dict(model_a.state_dict())
    with torch.no_grad():
        model_b.fc2.bias += 1
    result = hookscope.compare(model_a, model_b, x, layers=["fc1", "fc2"])
    assert builds == [model_a, model_b]
    assert result.first_divergent is not None and result.first_divergent.path == "fc2"


# ------------------------------------------------------------- one index per verb call (issue 34)
def _logit_diff(out: object) -> torch.Tensor:
    return out.logits[:, -1, 3].mean() - out.logits[:, -1, 5].mean()  # type: ignore[attr-defined]


def test_a_sweep_over_layers_and_chunks_walks_the_model_once(builds: list[nn.Module]) -> None:
    """3 layers x 5 positions in chunks of 1: 3 + layers x chunks = 18 walks before (issue 34),
    one now; the values still equal a sweep with an index per session (test_sweep.py)."""
    from tests.models import tiny_gpt2

    model = tiny_gpt2(n_layer=3, pad=False)
    clean = {"input_ids": torch.tensor([[3, 9, 14, 2, 8]])}
    corrupted = {"input_ids": torch.tensor([[3, 9, 40, 2, 8]])}
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.*",
                                     metric=_logit_diff, batch_size=1, progress=False)
    assert sweep.values.shape == (3, 5) and builds == [model]
    builds.clear()
    hookscope.attribution_patching(model, clean, corrupted, _logit_diff, layers="transformer.h.*")
    assert builds == [model]


def test_gradcam_and_extract_walk_the_model_once(builds: list[nn.Module], tmp_path: Path) -> None:
    from tests.models import LeNet

    model = LeNet().eval()
    hookscope.gradcam(model, torch.randn(2, 3, 32, 32), "conv2")
    assert builds == [model]
    builds.clear()
    hookscope.extract(model, [torch.randn(2, 3, 32, 32) for _ in range(3)], ["conv2", "fc1"],
                      tmp_path / "s", progress=False)
    assert builds == [model]


def test_another_models_index_is_never_the_held_one(builds: list[nn.Module]) -> None:
    first, second = MlpStack(), MlpStack()
    with names.one_index(first):
        assert names.index(first) is names.index(first)
        assert names.index(second).root is second
    assert builds == [first, second]
