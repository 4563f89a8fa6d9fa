"""capture_generation: steps and positions of each call, and aligned activations equal to one
forward over the generated sequence (tiny GPT-2 from a config, random weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from hookscope.errors import CaptureError
from tests.models import tiny_gpt2

transformers = pytest.importorskip("transformers")


def reference(model: nn.Module, module: nn.Module, sequences: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """A plain forward hook on one forward over the whole generated sequence."""
    kept: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda mod, args, output: kept.append(output.detach()))
    kwargs: dict[str, Any] = {}
    if mask is not None:  # as generate() builds them: positions count real tokens only
        kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    with torch.no_grad():
        model(sequences, **kwargs)
    handle.remove()
    return kept[0]


@pytest.mark.parametrize("use_cache", [True, False])
def test_aligned_activations_equal_one_forward_over_the_sequence(use_cache: bool) -> None:
    model = tiny_gpt2()
    prompt = torch.tensor([[5, 6, 7], [9, 3, 11]])
    with hookscope.capture_generation(model, "transformer.h.1", "transformer.ln_f") as gen:
        sequences = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                   do_sample=False, use_cache=use_cache)
    assert sequences.shape == (2, 7)
    starts = [0, 3, 4, 5] if use_cache else [0, 0, 0, 0]
    assert [(s.index, s.start, s.stop) for s in gen.steps] == \
        [(k, start, stop) for k, (start, stop) in enumerate(zip(starts, [3, 4, 5, 6]))]
    records = gen.records("transformer.h.1")
    assert [(r.step, r.start, r.stop) for r in records] == [(s.index, s.start, s.stop) for s in gen.steps]
    assert records[1].value.shape == ((2, 1, 32) if use_cache else (2, 4, 32))
    for path, module in (("transformer.h.1", model.transformer.h[1]),
                         ("transformer.ln_f", model.transformer.ln_f)):
        aligned = gen.aligned(path)
        assert aligned.shape == (2, 6, 32)  # 3 prompt rows + one per new token but the last
        full = reference(model, module, sequences)
        torch.testing.assert_close(aligned, full[:, :6], rtol=1e-5, atol=1e-5)
    assert torch.equal(gen.token_ids(), sequences[:, :6])


def test_left_padded_prompts_align_by_column() -> None:
    model = tiny_gpt2()
    prompt = torch.tensor([[5, 6, 7], [0, 9, 3]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    with hookscope.capture_generation(model, "transformer.h.0") as gen:
        sequences = model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False)
    aligned = gen.aligned("transformer.h.0")
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    full = reference(model, model.transformer.h[0], sequences, full_mask)
    real = full_mask[:, :5].bool()
    torch.testing.assert_close(aligned[real], full[:, :5][real], rtol=1e-5, atol=1e-5)


def test_tuple_output_needs_a_part_and_no_hook_is_left() -> None:
    model = tiny_gpt2()
    with hookscope.capture_generation(model, "transformer.h.0.attn") as gen:
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)
    with pytest.raises(CaptureError, match=r"with a part, e.g. 'transformer.h.0.attn\[0\]'"):
        gen.aligned("transformer.h.0.attn")
    with hookscope.capture_generation(model, "transformer.h.0.attn[0]") as gen:
        sequences = model.generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)
    assert gen.aligned("transformer.h.0.attn[0]").shape == (1, sequences.shape[1] - 1, 32)


@pytest.mark.parametrize("use_cache", [True, False])
def test_steer_last_token_while_generating(use_cache: bool) -> None:
    """positions=-1 during generate(): the newest token of each forward (the mask covers the
    past tokens too with a cache; its last columns are this forward's), as a plain hook does."""
    model, v = tiny_gpt2(), torch.full((32,), 0.5)
    prompt = torch.tensor([[5, 6, 7]])
    kwargs: dict[str, Any] = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 3,
                              "do_sample": False, "use_cache": use_cache,
                              "output_scores": True, "return_dict_in_generate": True}

    def add_last(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[:, -1] += v
        return output

    handle = model.transformer.h[0].register_forward_hook(add_last)
    expected = model.generate(prompt, **kwargs)
    handle.remove()
    with hookscope.steer(model, {"transformer.h.0": v}, positions=-1):
        got = model.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_save_writes_aligned_activations_and_token_ids(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = tiny_gpt2()
    prompt = torch.tensor([[5, 6, 7]])
    with hookscope.capture_generation(model, "transformer.h.0", "transformer.h.1") as gen:
        sequences = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                   do_sample=False)
    file = tmp_path / "gen.safetensors"
    gen.save(file)
    saved = load_file(file)
    assert sorted(saved) == ["token_ids", "transformer.h.0", "transformer.h.1"]
    assert torch.equal(saved["token_ids"], sequences[:, :5])
    assert torch.equal(saved["transformer.h.1"], gen.aligned("transformer.h.1"))
    with pytest.raises(hookscope.HookscopeError, match="pass overwrite=True"):
        gen.save(file)
    assert [p.name for p in tmp_path.iterdir()] == ["gen.safetensors"]  # no temporary left


@pytest.mark.parametrize("use_cache", [True, False])
def test_sdpa_value_aligned_on_its_query_axis(use_cache: bool) -> None:
    model = tiny_gpt2()  # 4 heads of 8
    path = "transformer.h.0.attn::scaled_dot_product_attention"
    prompt = torch.tensor([[5, 6, 7], [9, 3, 11]])
    with hookscope.capture_generation(model, path) as gen:
        sequences = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                   do_sample=False, use_cache=use_cache)
    assert gen.records(path)[0].value.shape == (2, 4, 3, 8)  # (batch, heads, query, head_dim)
    aligned = gen.aligned(path)
    assert aligned.shape == (2, 5, 4, 8)  # (batch, positions, heads, head_dim)
    # plain torch: c_proj's input is the heads merged, (batch, seq, heads * head_dim)
    kept: list[torch.Tensor] = []
    handle = model.transformer.h[0].attn.c_proj.register_forward_pre_hook(
        lambda mod, args: kept.append(args[0].detach()))
    with torch.no_grad():
        model(sequences)
    handle.remove()
    torch.testing.assert_close(aligned.flatten(2), kept[0][:, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gen.aligned(path, seq_dim=2), aligned)
