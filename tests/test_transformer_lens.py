"""TransformerLens's HookedTransformer as a known family (issue 36 item 2), on the stand-in of
tests/hooked_transformer.py (TL's module tree, names and hook points): the standard names resolve
to TL's hook points, attn.q/k/v/z.{i} equal the einsums by hand, the logit lens reads out through
ln_final and unembed, and the one steering script of test_standard_names runs unchanged."""

from __future__ import annotations

import pytest
import torch

import hookscope
from tests.hooked_transformer import build
from tests.test_standard_names import steering_script

TL_PATHS = {
    "embed": "embed", "resid_pre.0": "blocks.0.hook_resid_pre", "resid_pre.1": "blocks.1.hook_resid_pre",
    "resid_post.1": "blocks.1.hook_resid_post", "attn_out.0": "blocks.0.hook_attn_out",
    "mlp_out.1": "blocks.1.hook_mlp_out", "attn.q.1": "blocks.1.attn.hook_q",
    "attn.k.0": "blocks.0.attn.hook_k", "attn.v.0": "blocks.0.attn.hook_v",
    "attn.z.1": "blocks.1.attn.hook_z", "final_norm": "ln_final", "unembed": "unembed",
}
IDS = torch.tensor([[3, 14, 15, 9, 26, 5], [35, 8, 9, 7, 9, 3]])


@pytest.mark.parametrize(("name", "path"), list(TL_PATHS.items()))
def test_standard_names_are_tl_hook_points(name: str, path: str) -> None:
    model = build()
    assert list(hookscope.select(model, name)) == [path]


def test_values_equal_tl_computation_by_hand() -> None:
    model = build()
    names = ["resid_pre.0", "resid_pre.1", "resid_post.1", "attn_out.1", "mlp_out.1",
             "attn.q.1", "attn.k.1", "attn.v.1", "attn.z.1"]
    with torch.no_grad(), hookscope.capture(model, *names) as acts:
        logits = model(IDS)
    block, attn = model.blocks[1], model.blocks[1].attn
    with torch.no_grad():
        expected_pre0 = model.embed.W_E[IDS] + model.pos_embed.W_pos[:IDS.shape[1]]
        x = block.ln1(acts["resid_pre.1"])
        q = torch.einsum("bpm,hmd->bphd", x, attn.W_Q) + attn.b_Q
        k = torch.einsum("bpm,hmd->bphd", x, attn.W_K) + attn.b_K
        v = torch.einsum("bpm,hmd->bphd", x, attn.W_V) + attn.b_V
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        z = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~causal, -torch.inf).softmax(-1), v)
        attn_out = torch.einsum("bqhd,hdm->bqm", z, attn.W_O) + attn.b_O
        final = model.unembed(model.ln_final(acts["resid_post.1"]))
    torch.testing.assert_close(acts["resid_pre.0"], expected_pre0)
    for name, expected in (("attn.q.1", q), ("attn.k.1", k), ("attn.v.1", v), ("attn.z.1", z),
                           ("attn_out.1", attn_out)):
        torch.testing.assert_close(acts[name], expected, rtol=1e-5, atol=1e-6)
    assert acts.layout("attn.z.1").heads == 2 and acts.layout("attn.q.1").seq == 1
    torch.testing.assert_close(acts["resid_post.1"],
                               acts["resid_pre.1"] + acts["attn_out.1"] + acts["mlp_out.1"])
    assert torch.equal(final, logits)


def test_logit_lens_reads_out_through_ln_final_and_unembed() -> None:
    model = build()
    lens = hookscope.logit_lens(model, IDS)
    assert lens.layers == ["resid_post.0", "resid_post.1"]
    assert lens.paths == {"resid_post.0": "blocks.0.hook_resid_post",
                          "resid_post.1": "blocks.1.hook_resid_post"}
    with torch.no_grad():
        logits = model(IDS)
        hidden = [model.blocks[0](model.hook_embed(model.embed(IDS)) + model.pos_embed(IDS))]
        by_hand = torch.log_softmax(model.ln_final(hidden[0]) @ model.unembed.W_U + model.unembed.b_U, -1)
    torch.testing.assert_close(lens.log_probs[-1], torch.log_softmax(logits, -1))
    torch.testing.assert_close(lens.log_probs[0], by_hand)


def test_one_steering_script_runs_on_the_hooked_transformer() -> None:
    model = build(n_layers=3)
    clean, steered = steering_script(model, {"input": IDS})
    with torch.no_grad():
        block1 = model.blocks[1](model.blocks[0](model.embed(IDS) + model.pos_embed(IDS)))
        expected = model.blocks[2](block1 + 1)
    torch.testing.assert_close(steered, expected)
    torch.testing.assert_close(clean, model.blocks[2](block1).detach())


def test_heads_edit_on_tl_z() -> None:
    """ablate(heads=[2]) on attn.z.0 == zeroing head 2 of hook_z by a plain hook."""
    model = build()

    def zero(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        new = output.clone()
        new[:, :, 2] = 0
        return new

    handle = model.blocks[0].attn.hook_z.register_forward_hook(zero)
    with torch.no_grad():
        expected = model(IDS)
    handle.remove()
    with torch.no_grad(), hookscope.ablate(model, "attn.z.0", heads=[2]):
        assert torch.equal(model(IDS), expected)
