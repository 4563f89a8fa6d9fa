"""One layout (token axis, heads axis, the run's mask, the KV cache) read by every verb: each
verb's result against hand-written plain PyTorch (forward hooks, a TorchFunctionMode on SDPA,
eager attention), never against hookscope itself."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import hookscope
from hookscope.errors import PositionError
from tests.models import tiny_gpt2

SDPA_KEY = "transformer.h.{}.attn::scaled_dot_product_attention"


class PlainSDPA(TorchFunctionMode):
    """Plain PyTorch: every F.scaled_dot_product_attention output of a forward, in call order,
    optionally with a zero requiring grad added (its gradient is d metric / d output)."""

    def __init__(self, add_zero: bool = False):
        super().__init__()
        self.add_zero = add_zero
        self.outputs: list[torch.Tensor] = []
        self.zeros: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            self.outputs.append(out.detach())
            if self.add_zero:
                zero = torch.zeros_like(out, requires_grad=True)
                self.zeros.append(zero)
                out = out + zero
        return out


def _metric(out: Any) -> torch.Tensor:
    return (out.logits[:, -1, 3] - out.logits[:, -1, 7]).sum()


# ------------------------------------------------------------------ attribution patching on SDPA
@pytest.mark.parametrize("heads", [False, True])
def test_attribution_patching_on_sdpa_uses_the_query_axis(heads: bool) -> None:
    """6-token prompts: a (2 layers, 6 positions) table (was 2 x 4, the heads taken as
    positions), each cell the first-order estimate computed by hand from SDPA's outputs."""
    model = tiny_gpt2()
    torch.manual_seed(1)
    clean, corrupted = torch.randint(1, 60, (2, 6)), torch.randint(1, 60, (2, 6))
    keys = [SDPA_KEY.format(i) for i in range(2)]
    atp = hookscope.attribution_patching(model, clean, corrupted, _metric, layers=keys, heads=heads)
    with torch.no_grad(), PlainSDPA() as plain_clean:
        model(clean)
    with PlainSDPA(add_zero=True) as plain:
        value = _metric(model(corrupted))
    grads = torch.autograd.grad(value, plain.zeros)
    expected = torch.empty(2, 6, 4, dtype=torch.float64)
    for i in range(2):  # (batch, heads, query, head_dim)
        product = (plain_clean.outputs[i].double() - plain.outputs[i].double()) * grads[i].double()
        expected[i] = product.sum(dim=(0, 3)).T  # (query, heads)
    expected += float(value.detach())
    assert atp.positions == list(range(6))
    if heads:
        assert atp.values.shape == (2, 6, 4) and atp.heads == [0, 1, 2, 3]
        torch.testing.assert_close(atp.values, expected, rtol=1e-5, atol=1e-6)
    else:
        assert atp.values.shape == (2, 6)
        torch.testing.assert_close(atp.values, expected.sum(-1) - 3 * float(value.detach()),
                                   rtol=1e-5, atol=1e-6)


def test_patching_sweep_and_attribution_agree_on_the_sdpa_table_shape() -> None:
    model = tiny_gpt2()
    torch.manual_seed(2)
    clean, corrupted = torch.randint(1, 60, (1, 6)), torch.randint(1, 60, (1, 6))
    keys = [SDPA_KEY.format(i) for i in range(2)]
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers=keys, metric=_metric,
                                     heads=True, progress=False)
    atp = hookscope.attribution_patching(model, clean, corrupted, _metric, layers=keys, heads=True)
    assert sweep.values.shape == atp.values.shape == (2, 6, 4)
    assert sweep.positions == atp.positions and sweep.heads == atp.heads


class PatchHeadSDPA(TorchFunctionMode):
    """Plain PyTorch: call ``layer`` of F.scaled_dot_product_attention returns head ``head``
    of ``clean[layer]`` at every position (its other heads are its own)."""

    def __init__(self, layer: int, head: int, clean: list[torch.Tensor]):
        super().__init__()
        self.layer, self.head, self.clean, self.calls = layer, head, clean, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            if self.calls == self.layer:  # (batch, heads, query, head_dim)
                out = out.clone()
                out[:, self.head] = self.clean[self.layer][:, self.head]
            self.calls += 1
        return out


def test_a_head_patched_at_every_position_against_plain_sdpa() -> None:
    """all_positions=True (issue 34): each head patched at every position at once, one value
    per (layer, head) as TransformerLens's *_all_pos; attribution patching sums its
    per-position estimates (first order is additive)."""
    model = tiny_gpt2()
    torch.manual_seed(3)
    clean, corrupted = torch.randint(1, 60, (2, 6)), torch.randint(1, 60, (2, 6))
    keys = [SDPA_KEY.format(i) for i in range(2)]
    sweep = hookscope.patching_sweep(model, clean, corrupted, layers=keys, metric=_metric,
                                     heads=True, all_positions=True, batch_size=3, progress=False)
    with torch.no_grad(), PlainSDPA() as plain_clean:
        model(clean)
    expected = torch.empty(2, 1, 4, dtype=torch.float64)
    for layer in range(2):
        for head in range(4):
            with torch.no_grad(), PatchHeadSDPA(layer, head, plain_clean.outputs):
                expected[layer, 0, head] = float(_metric(model(corrupted)))
    assert sweep.values.shape == (2, 1, 4) and sweep.heads == [0, 1, 2, 3]
    assert sweep.positions == list(range(6)) and sweep.all_positions
    torch.testing.assert_close(sweep.values, expected, rtol=1e-5, atol=1e-5)
    assert sweep.table().splitlines()[0].split() == ["0…5"]
    assert sweep.figure().axes[0].get_xticklabels()[0].get_text() == "0…5"
    each = hookscope.attribution_patching(model, clean, corrupted, _metric, layers=keys, heads=True)
    atp = hookscope.attribution_patching(model, clean, corrupted, _metric, layers=keys, heads=True,
                                         all_positions=True)
    assert atp.values.shape == (2, 1, 4) and atp.all_positions
    torch.testing.assert_close(atp.values - atp.corrupted,
                               (each.values - each.corrupted).sum(dim=1, keepdim=True))


# ------------------------------------------------------------------ patch from a padded capture
def test_patch_source_capture_brings_its_own_mask() -> None:
    """positions=[-1] reads the source's last real token (row 0 is right-padded), with no
    source_attention_mask: the capture kept the mask its run was called with."""
    model = tiny_gpt2()
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with hookscope.capture(model, "transformer.h.0") as clean:
        model(ids, attention_mask=mask)
    assert torch.equal(clean.tokens("transformer.h.0").mask, mask)
    assert clean.layout("transformer.h.0").seq == 1
    corrupted = torch.tensor([[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]])
    with torch.no_grad(), hookscope.patch(model, source=clean, layers="transformer.h.0",
                                          positions=[-1]):
        got = model(corrupted).logits
    kept: dict[str, torch.Tensor] = {}
    handle = model.transformer.h[0].register_forward_hook(
        lambda m, a, out: kept.setdefault("h", out.detach().clone()))
    with torch.no_grad():
        model(ids, attention_mask=mask)
    handle.remove()

    def plain(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[0, -1], out[1, -1] = kept["h"][0, 2], kept["h"][1, 4]
        return out
    handle = model.transformer.h[0].register_forward_hook(plain)
    with torch.no_grad():
        expected = model(corrupted).logits
    handle.remove()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ------------------------------------------------------------------ logit lens default position
def test_logit_lens_default_is_the_last_real_token() -> None:
    model = tiny_gpt2()
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    lens = hookscope.logit_lens(model, ids, attention_mask=mask)
    assert lens.position(0) == 2 and lens.position(1) == 4 and lens.position(0, 0) == 0
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    top = int(logits[0, 2].argmax())  # the last block's reading is the model's own output
    last_line = lens.table(k=1, row=0).splitlines()[-1]
    assert last_line.split()[1] == str(top)
    assert lens.table(k=1, row=0) == lens.table(k=1, row=0, position=2)


# ------------------------------------------------------------------ attention, left padding
def test_attention_on_a_left_padded_batch_is_defined() -> None:
    model = tiny_gpt2()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    probs = hookscope.attention(model, input_ids=ids, attention_mask=mask,
                                layers="transformer.h.*.attn")
    with torch.no_grad():
        reference = eager(ids, attention_mask=mask, output_attentions=True).attentions
        with PlainSDPA() as plain:
            model(ids, attention_mask=mask)
    for i in range(2):
        got = probs[f"transformer.h.{i}.attn"]
        assert not got.isnan().any()
        torch.testing.assert_close(got[0, :, 2:], reference[i][0, :, 2:], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], reference[i][1], rtol=1e-5, atol=1e-6)
        assert torch.equal(got[0, :, :2], torch.zeros(4, 2, 5))  # no key to attend to
        assert torch.equal(plain.outputs[i][0, :, :2], torch.zeros(4, 2, 8))  # SDPA gives 0 there


# ------------------------------------------------------------------ compare SDPA vs eager
def test_compare_sdpa_with_eager_reports_structure_not_inf() -> None:
    model = tiny_gpt2()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    result = hookscope.compare(model, eager, ids, layers="transformer.h.*.attn")
    with torch.no_grad():
        plain = model(ids).logits
        other = eager(ids).logits
    assert float((plain - other).abs().max()) < 1e-5
    for i in range(2):
        diff = result[f"transformer.h.{i}.attn"]
        assert diff.max_abs < 1e-5 and diff.close and diff.shape_b is None
        assert diff.structure == "[1]: a tensor (1, 4, 6, 6) in B, absent in A"
    assert result.first_divergent is None


# ------------------------------------------------------------------ positions under a KV cache
def _generate(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                             do_sample=False, return_dict_in_generate=True, output_logits=True,
                             pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize(("positions", "over"), [(0, "forward"), (0, "sequence"),
                                                 (4, "sequence"), (-1, "sequence")])
def test_positions_under_a_kv_cache(positions: int, over: str) -> None:
    """steer(positions=...) inside generate(): 'forward' counts each forward's tokens (0 is
    every new token); 'sequence' the whole sequence (0 is the prompt's first token only, 4 the
    5th token, fed two steps after the 3-token prompt). Against a hook tracking the cache."""
    model = tiny_gpt2()
    vector = torch.linspace(-2, 2, 32)
    ids = torch.tensor([[5, 6, 7]])
    with hookscope.steer(model, {"transformer.h.0": vector}, positions=positions, over=over):
        got = _generate(model, ids)
    seen = [0]

    def plain(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        start, length = seen[0], out.shape[1]  # tokens cached before this forward, fed now
        seen[0] += length
        if over == "forward":
            index = positions % length
        else:
            total = start + length
            if not -total <= positions < total or positions % total < start:
                return out  # not reached yet, or cached already
            index = positions % total - start
        out = out.clone()
        out[:, index] += vector
        return out
    handle = model.transformer.h[0].register_forward_hook(plain)
    try:
        expected = _generate(model, ids)
    finally:
        handle.remove()
    assert seen[0] == 3 + 3  # the prompt, then one token per step (the 4th is never fed)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


def test_over_is_checked_at_the_call() -> None:
    with pytest.raises(hookscope.HookscopeError, match="over='sequence'"):
        hookscope.steer(tiny_gpt2(), {"transformer.h.0": torch.zeros(32)}, positions=0,
                        over="cache")  # type: ignore[arg-type]


# ------------------------------------------------------------------ padding without a mask
def test_a_padded_batch_without_a_mask_is_refused_where_it_matters() -> None:
    model = tiny_gpt2()  # pad_token_id 0, also its bos/eos id
    padded = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    vector = torch.ones(32)
    with pytest.raises(PositionError, match="right-padded batch"):
        with torch.no_grad(), hookscope.steer(model, {"transformer.h.0": vector}, positions=-1):
            model(padded)
    with pytest.raises(PositionError, match="right-padded batch"):
        with hookscope.capture(model, "transformer.h.0", reduce="last"):
            model(padded)
    with pytest.raises(PositionError, match="attention_mask"):
        hookscope.logit_lens(model, padded).table()
    # not refused: the mask given; absolute=True; every position; one eos at a row's end
    mask = (torch.arange(5) < torch.tensor([[3], [5]])).long()
    with torch.no_grad():
        for kwargs in ({"attention_mask": mask},):
            with hookscope.steer(model, {"transformer.h.0": vector}, positions=-1):
                model(padded, **kwargs)
        with hookscope.steer(model, {"transformer.h.0": vector}, positions=-1, absolute=True):
            model(padded)
        with hookscope.steer(model, {"transformer.h.0": vector}):
            model(padded)
        with hookscope.steer(model, {"transformer.h.0": vector}, positions=-1):
            model(torch.tensor([[5, 6, 7, 8, 0], [8, 9, 10, 11, 12]]))
            model(torch.tensor([[5, 6, 7, 0, 0]]))


# ------------------------------------------------------------------ every verb, generated layouts
@functools.cache
def _model(heads: int) -> Any:
    return tiny_gpt2(n_head=heads)


@functools.cache
def _eager(heads: int) -> Any:
    eager = copy.deepcopy(_model(heads))
    eager.set_attn_implementation("eager")
    return eager


@st.composite
def layouts(draw: Any) -> dict[str, Any]:
    batch = draw(st.integers(1, 3))
    seq = draw(st.integers(2, 6))
    side = draw(st.sampled_from(["left", "right", "none"]))
    lengths = [draw(st.integers(1, seq)) if side != "none" else seq for _ in range(batch)]
    masked = side != "none" or draw(st.booleans())
    shortest = min(lengths)
    return {"heads": draw(st.sampled_from([1, 2, 4])), "batch": batch, "seq": seq, "side": side,
            "lengths": lengths, "masked": masked,
            "position": draw(st.integers(-shortest, shortest - 1)), "seed": draw(st.integers(0, 99))}


def _inputs(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(case["seed"])
    batch, seq = case["batch"], case["seq"]
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, n in enumerate(case["lengths"]):
        if case["side"] == "left":
            mask[row, seq - n:] = 1
        else:
            mask[row, :n] = 1
    ids = torch.randint(1, 60, (batch, seq)) * mask  # padding holds the pad id 0
    return ids, (mask if case["masked"] else None)


def _reference_cells(case: dict[str, Any], mask: torch.Tensor | None) -> set[tuple[int, int]]:
    """Plain Python: the (row, token) of ``position`` among each row's real tokens."""
    cells = set()
    for row in range(case["batch"]):
        real = list(range(case["seq"])) if mask is None else mask[row].nonzero().flatten().tolist()
        cells.add((row, real[case["position"]]))
    return cells


def _changed(a: torch.Tensor, b: torch.Tensor) -> set[tuple[int, int]]:
    """The (row, token) cells where two (batch, seq, ...) tensors differ."""
    differ = (a != b).flatten(2).any(dim=2)
    return {tuple(cell) for cell in differ.nonzero().tolist()}  # type: ignore[misc]


def _hidden(model: Any, ids: torch.Tensor, mask: torch.Tensor | None, module: Any) -> torch.Tensor:
    """Plain PyTorch: ``module``'s output (or its input, for a Linear) in one forward."""
    kept: dict[str, torch.Tensor] = {}
    linear = isinstance(module, torch.nn.Module) and type(module).__name__ == "Conv1D"
    handle = (module.register_forward_pre_hook(lambda m, a: kept.setdefault("v", a[0].clone()))
              if linear else module.register_forward_hook(
                  lambda m, a, out: kept.setdefault("v", out.clone())))
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask)
    finally:
        handle.remove()
    return kept["v"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_every_position_verb_picks_the_same_cells(case: dict[str, Any]) -> None:
    model = _model(case["heads"])
    ids, mask = _inputs(case)
    p = case["position"]
    want = _reference_cells(case, mask)
    block, out_layer = model.transformer.h[0], model.transformer.h[1]
    base = _hidden(model, ids, mask, block)
    vector = torch.full((32,), 3.0)

    def under(edit: Any, module: Any = block) -> torch.Tensor:
        with edit:
            return _hidden(model, ids, mask, module)

    assert _changed(under(hookscope.steer(model, {"transformer.h.0": vector}, positions=p)),
                    base) == want
    assert _changed(under(hookscope.ablate(model, "transformer.h.0", positions=p)), base) == want
    with torch.no_grad(), hookscope.capture(model, "transformer.h.0") as source:
        model(ids.flip(0), attention_mask=None if mask is None else mask.flip(0))
    patched = under(hookscope.patch(model, source=source, layers="transformer.h.0", positions=p))
    flipped = _hidden(model, ids.flip(0), None if mask is None else mask.flip(0), block)
    source_cells = _reference_cells(case, None if mask is None else mask.flip(0))
    # row b of this run gets the source's row b at its own position p: compare the values
    for (row, token), (src_row, src_token) in zip(sorted(want), sorted(source_cells)):
        torch.testing.assert_close(patched[row, token], flipped[src_row, src_token])
    # one head of the attention's SDPA value: its columns of c_proj's input
    proj = model.transformer.h[0].attn.c_proj
    base_proj = _hidden(model, ids, mask, proj)
    head = case["heads"] - 1
    ablated = under(hookscope.ablate(model, SDPA_KEY.format(0), positions=p, heads=[head]), proj)
    width = 32 // case["heads"]
    assert _changed(ablated, base_proj) == want
    assert not ablated[..., head * width:(head + 1) * width][tuple(zip(*want))].any()
    # the sweep and attribution patching on the last block: logits move at the patched cells
    inputs = {"input_ids": ids, **({} if mask is None else {"attention_mask": mask})}
    corrupted = {**inputs, "input_ids": (ids + 7) % 60 * (1 if mask is None else mask)}
    seen: list[torch.Tensor] = []

    def metric(out: Any) -> float:
        seen.append(out.logits)
        return 0.0
    with torch.no_grad():
        plain_corrupted = model(**corrupted).logits
    hookscope.patching_sweep(model, inputs, corrupted, layers="transformer.h.1", metric=metric,
                             positions=[p], progress=False)
    assert _changed(seen[-1], plain_corrupted) == want
    weights = torch.randn(plain_corrupted.shape[:2])
    atp = hookscope.attribution_patching(
        model, inputs, corrupted, lambda out: (out.logits[..., 5] * weights).sum(),
        layers="transformer.h.1", positions=[p])
    clean_h = _hidden(model, ids, mask, out_layer)
    corrupted_h = _hidden(model, corrupted["input_ids"], mask, out_layer)
    zero = torch.zeros_like(corrupted_h, requires_grad=True)
    handle = out_layer.register_forward_hook(lambda m, a, out: out + zero)
    try:
        value = (model(**corrupted).logits[..., 5] * weights).sum()
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(value, zero)
    contribution = ((clean_h - corrupted_h).double() * grad.double()).sum(-1)
    expected = float(value.detach()) + sum(float(contribution[cell]) for cell in want)
    assert atp.values.shape == (1, 1)
    assert abs(float(atp.values[0, 0]) - expected) <= 1e-6 * max(1.0, abs(expected))
    # the logit lens and extract's first/last reductions
    lens = hookscope.logit_lens(model, ids, attention_mask=mask)
    assert {(row, lens.position(row, p)) for row in range(case["batch"])} == want
    for reduce, at in (("first", 0), ("last", -1)):
        with torch.no_grad(), hookscope.capture(model, "transformer.h.0", reduce=reduce) as acts:
            model(ids, attention_mask=mask)
        rows = [mask_row.nonzero().flatten().tolist() if mask is not None else
                list(range(case["seq"])) for mask_row in (mask if mask is not None else ids)]
        expected_rows = torch.stack([base[row, real[at]] for row, real in enumerate(rows)])
        torch.testing.assert_close(acts["transformer.h.0"], expected_rows, rtol=0, atol=0)
    # attention: every query with a real key equals eager attention, the rest is zero
    probs = hookscope.attention(model, input_ids=ids, attention_mask=mask,
                                layers="transformer.h.0.attn")["transformer.h.0.attn"]
    with torch.no_grad():
        reference = _eager(case["heads"])(ids, attention_mask=mask,
                                          output_attentions=True).attentions[0]
    causal = torch.ones(case["seq"], case["seq"]).tril().bool()
    real_keys = causal[None] & (torch.ones_like(ids) if mask is None else mask).bool()[:, None, :]
    has_key = real_keys.any(-1)  # (batch, query)
    assert not probs.isnan().any()
    torch.testing.assert_close(probs.permute(0, 2, 1, 3)[has_key],
                               reference.permute(0, 2, 1, 3)[has_key], rtol=1e-5, atol=1e-6)
    assert not probs.permute(0, 2, 1, 3)[~has_key].any()
