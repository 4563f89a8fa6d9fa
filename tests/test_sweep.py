"""patching_sweep equals hand-written patching loops (plain forward hooks), on a GPT-2-shaped model
from a config (random weights) and on MiniLM; batching copies does not change the values."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from hookscope.errors import EditError, PositionError
from hookscope.zoo.models import LoadedModel
from tests.models import tiny_gpt2
from tests.reference import clean_values, hand_patched, logit_diff

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("batch_size", [1, 3, None])
def test_gpt2_sweep_equals_hand_written_loop(tmp_path: Path, batch_size: int | None) -> None:
    model = tiny_gpt2(n_layer=3, pad=False)
    clean = {"input_ids": torch.tensor([[3, 9, 14, 2, 8], [4, 1, 22, 7, 30]])}
    corrupted = {"input_ids": torch.tensor([[3, 9, 40, 2, 8], [4, 1, 41, 7, 30]])}
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.*",
                                     metric=logit_diff, batch_size=batch_size,
                                     plot=tmp_path / "sweep.png", progress=False)
    blocks = list(model.transformer.h)
    sources = clean_values(model, blocks, clean)
    expected = torch.tensor([[hand_patched(model, block, source, p, corrupted) for p in range(5)]
                             for block, source in zip(blocks, sources)], dtype=torch.float64)
    assert sweep.layers == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert sweep.positions == [0, 1, 2, 3, 4]
    assert sweep.values.shape == (3, 5)
    torch.testing.assert_close(sweep.values, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert sweep.clean == pytest.approx(float(logit_diff(model(**clean))), abs=1e-6)
        assert sweep.corrupted == pytest.approx(float(logit_diff(model(**corrupted))), abs=1e-6)
    # patching the last block at every position restores the clean metric
    assert sweep.values[2, :].tolist() != [sweep.corrupted] * 5
    assert sweep.values[2, 4] == pytest.approx(sweep.clean, abs=1e-5)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "transformer.h.2" in sweep.table()


def test_positions_count_real_tokens_of_padded_batches() -> None:
    model = tiny_gpt2(n_layer=3, pad=False)
    # row 1 is left-padded by one token; position -1 is the last real token of each row
    clean = {"input_ids": torch.tensor([[3, 9, 14, 2], [0, 4, 1, 22]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])}
    corrupted = {"input_ids": torch.tensor([[3, 9, 40, 2], [0, 4, 1, 41]]),
                 "attention_mask": clean["attention_mask"]}
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.0",
                                     metric=logit_diff, positions=[-1, 0], progress=False)
    block = model.transformer.h[0]
    (source,) = clean_values(model, [block], clean)

    def hook_rows(row_positions: list[int]) -> float:
        def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            output = output.clone()
            for row, p in enumerate(row_positions):
                output[row, p] = source[row, p]
            return output
        handle = block.register_forward_hook(hook)
        with torch.no_grad():
            value = float(logit_diff(model(**corrupted)))
        handle.remove()
        return value

    expected = torch.tensor([[hook_rows([3, 3]), hook_rows([0, 1])]], dtype=torch.float64)
    torch.testing.assert_close(sweep.values, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(PositionError, match=r"give positions=\[...\]"):
        hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.0",
                                 metric=logit_diff, progress=False)


def test_metric_must_be_one_number() -> None:
    model = tiny_gpt2(n_layer=3, pad=False)
    ids = {"input_ids": torch.tensor([[3, 9, 14]])}
    with pytest.raises(EditError, match=r"metric returned a tensor of shape \(1, 3, 60\)"):
        hookscope.patching_sweep(model, ids, ids, layers="transformer.h.0",
                                 metric=lambda out: out.logits, progress=False)


def test_minilm_sweep_equals_hand_written_loop(minilm: LoadedModel) -> None:
    model, tokenizer = minilm.module, minilm.tokenizer
    clean = dict(tokenizer(["the cat sat on the mat"], return_tensors="pt"))
    corrupted = dict(tokenizer(["the dog sat on the mat"], return_tensors="pt"))
    direction = torch.randn(384)

    def metric(output: Any) -> torch.Tensor:
        return (output.last_hidden_state[:, 0] @ direction).mean()

    sweep = hookscope.patching_sweep(model, clean, corrupted, layers=["encoder.layer.1", "encoder.layer.4"],
                                     metric=metric, positions=[1, 2, -1], progress=False)
    seq = corrupted["input_ids"].shape[1]
    expected = []
    for index in (1, 4):
        layer = model.encoder.layer[index]
        (source,) = clean_values(model, [layer], clean)
        expected.append([hand_patched(model, layer, source, p, corrupted, metric)
                         for p in (1, 2, seq - 1)])
    torch.testing.assert_close(sweep.values, torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)


def test_progress_bar_counts_forwards(capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_gpt2(n_layer=3, pad=False)
    ids = {"input_ids": torch.tensor([[3, 9, 14]])}
    sweep = hookscope.patching_sweep(model, ids, ids, layers="transformer.h.*", metric=logit_diff,
                                     batch_size=2)
    err = capsys.readouterr().err
    assert "patching sweep" in err and "6/6" in err  # 3 layers x ceil(3 positions / 2) forwards
    assert sweep.values.shape == (3, 3)  # the values themselves: test_sweep_matches_*


def _head_sweep(layers: int) -> hookscope.Sweep:
    """A sweep over SDPA heads (the longest row labels), values made up."""
    names = [f"transformer.h.{i}.attn::scaled_dot_product_attention" for i in range(layers)]
    torch.manual_seed(0)
    return hookscope.Sweep(torch.randn(layers, 5, 4, dtype=torch.float64), names, list(range(5)),
                           1.0, 0.0, heads=[0, 1, 2, 3])


@pytest.mark.parametrize("layers", [1, 3])
def test_heat_map_row_labels_lie_inside_the_figure(tmp_path: Path, layers: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    sweep = _head_sweep(layers)
    figure = sweep.figure(tokens=["The", " cat", " sat", " on", " mat"])
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    width, height = figure.bbox.width, figure.bbox.height
    axes = figure.axes[0]
    labels = axes.get_yticklabels()
    assert [t.get_text() for t in labels][:2] == [
        "transformer.h.0.attn::scaled_dot_product_attention head 0",
        "transformer.h.0.attn::scaled_dot_product_attention head 1"]
    assert len(labels) == 4 * layers
    for text in [*labels, *axes.get_xticklabels(), axes.title]:
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height, text
    png = sweep.plot(tmp_path / "sweep.png")
    assert Image.open(png).size == (1600, 800)


def test_plot_tokens_of_the_wrong_length_is_an_argument_error(tmp_path: Path) -> None:
    with pytest.raises(hookscope.errors.ArgumentValueError,
                       match=r"tokens has 2 labels for 5 positions \[0, 1, 2, 3, 4\]"):
        _head_sweep(1).plot(tmp_path / "sweep.png", tokens=["a", "b"])
    assert not (tmp_path / "sweep.png").exists()


@pytest.mark.parametrize("verb", ["patching_sweep", "attribution_patching", "edge_attribution_patching"])
def test_many_forward_verbs_warn_once_about_dropout_in_training_mode(verb: str) -> None:
    # finding 10: a sweep of a model left in train() ran every forward with dropout on, silently
    model = tiny_gpt2(pad=False).train()
    clean, corrupted = torch.tensor([[3, 9, 14, 2]]), torch.tensor([[3, 9, 40, 2]])
    run = getattr(hookscope, verb)
    kwargs: dict[str, Any] = {"progress": False} if verb == "patching_sweep" else {}
    if verb != "edge_attribution_patching":  # it scores every head and MLP: no layers argument
        kwargs["layers"] = "transformer.h.*"
    with pytest.warns(hookscope.TrainingModeWarning, match=r"call model\.eval\(\) first") as seen:
        run(model, clean, corrupted, metric=logit_diff, **kwargs)
    assert len([w for w in seen if issubclass(w.category, hookscope.TrainingModeWarning)]) == 1
    assert issubclass(hookscope.TrainingModeWarning, hookscope.HookscopeWarning)
    assert model.training  # the mode is the user's: warned, not changed
    for quiet in (model.eval(), _no_dropout_in_training()):
        with warnings.catch_warnings():
            warnings.simplefilter("error", hookscope.TrainingModeWarning)
            run(quiet, clean, corrupted, metric=logit_diff, **kwargs)


def _no_dropout_in_training() -> nn.Module:
    """A model in training mode whose dropout rates are all 0: nothing to warn about."""
    import transformers
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=60, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()
