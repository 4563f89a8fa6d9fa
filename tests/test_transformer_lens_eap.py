"""EAP and EAP-IG on TransformerLens's ``HookedTransformer`` equal the same weights run as a
Hugging Face GPT-2 (issue 46 item 3). TL's ``TransformerBlock.forward`` calls ``ln1`` once for
each of the q, k and v inputs, three calls per block where GPT-2 makes one; edge attribution used
to refuse it (``'blocks.0.ln1' ran 3 times``). Here: the stand-in of ``tests/hooked_transformer.py``
with TL's three ``ln1`` calls (always runs), and TL 3.9's own ``HookedTransformer`` (skipped where
transformer_lens is not installed: it lives in the benchmark's peer environment; there,
``python -m bench.tl_eap`` records the same comparison in ``bench/tl_eap.json``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope
from bench.tl_eap import (
    CTX,
    D_MODEL,
    HEADS,
    LAYERS,
    VOCAB,
    hf_gpt2,
    inputs,
    logit_difference,
    logits_of,
    tl_hooked_transformer,
)
from hookscope.errors import EditError
from tests.hooked_transformer import Config, HookedTransformer, TransformerBlock

Tensor = torch.Tensor


class SplitBlock(TransformerBlock):
    """TL's block: ``ln1`` applied to the query, key and value inputs one after the other."""

    def forward(self, resid_pre: Tensor) -> Tensor:
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(query_input=self.ln1(resid_pre),
                                                key_input=self.ln1(resid_pre),
                                                value_input=self.ln1(resid_pre)))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid_mid)))
        return self.hook_resid_post(resid_mid + mlp_out)


def stand_in_of(gpt2: nn.Module) -> HookedTransformer:
    """The stand-in with TL's blocks and ``gpt2``'s weights (what TL's ``convert_gpt2_weights``
    does: q, k, v split out of ``c_attn`` per head, ``c_proj`` per head, the tied unembedding)."""
    d_head = D_MODEL // HEADS
    model = HookedTransformer(Config(n_layers=LAYERS, d_model=D_MODEL, n_heads=HEADS, d_head=d_head,
                                     d_mlp=4 * D_MODEL, d_vocab=VOCAB, n_ctx=CTX))
    t = gpt2.transformer  # type: ignore[union-attr]
    state: dict[str, Tensor] = {"embed.W_E": t.wte.weight, "pos_embed.W_pos": t.wpe.weight,
                                "ln_final.w": t.ln_f.weight, "ln_final.b": t.ln_f.bias,
                                "unembed.W_U": t.wte.weight.T, "unembed.b_U": torch.zeros(VOCAB)}
    for layer, h in enumerate(t.h):
        block = f"blocks.{layer}."
        for x, w, b in zip("QKV", h.attn.c_attn.weight.split(D_MODEL, dim=1),
                           h.attn.c_attn.bias.split(D_MODEL), strict=True):
            state[block + f"attn.W_{x}"] = w.reshape(D_MODEL, HEADS, d_head).permute(1, 0, 2)
            state[block + f"attn.b_{x}"] = b.reshape(HEADS, d_head)
        state[block + "attn.W_O"] = h.attn.c_proj.weight.reshape(HEADS, d_head, D_MODEL)
        state[block + "attn.b_O"] = h.attn.c_proj.bias
        for ours, theirs in (("ln1", h.ln_1), ("ln2", h.ln_2)):
            state[block + f"{ours}.w"], state[block + f"{ours}.b"] = theirs.weight, theirs.bias
        state[block + "mlp.W_in"], state[block + "mlp.b_in"] = h.mlp.c_fc.weight, h.mlp.c_fc.bias
        state[block + "mlp.W_out"], state[block + "mlp.b_out"] = h.mlp.c_proj.weight, h.mlp.c_proj.bias
    state = {k: v.detach().clone() for k, v in state.items()}
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert set(missing) == {f"blocks.{i}.attn.{b}" for i in range(LAYERS) for b in ("mask", "IGNORE")}
    for block in model.blocks:
        block.__class__ = SplitBlock
    return model.eval()


def _check_equal(tl: nn.Module, gpt2: nn.Module, steps: int | None) -> None:
    clean, corrupted = inputs()
    with torch.no_grad():
        torch.testing.assert_close(logits_of(tl(clean)), logits_of(gpt2(clean)), rtol=1e-5, atol=1e-5)
    ours = hookscope.edge_attribution_patching(tl, clean, corrupted, logit_difference, steps=steps)
    theirs = hookscope.edge_attribution_patching(gpt2, clean, corrupted, logit_difference, steps=steps)
    assert ours.upstream == theirs.upstream and ours.downstream == theirs.downstream
    assert len(ours.downstream) == LAYERS * (3 * HEADS + 1) + 1
    assert torch.equal(ours.scores.isnan(), theirs.scores.isnan())
    torch.testing.assert_close(ours.scores, theirs.scores, rtol=1e-4, atol=1e-6, equal_nan=True)
    assert ours.clean == pytest.approx(theirs.clean, abs=1e-5)
    assert ours.corrupted == pytest.approx(theirs.corrupted, abs=1e-5)
    assert float(ours.scores.nan_to_num().abs().max()) > 1e-3  # not all zero


@pytest.mark.parametrize("steps", [None, 3])
def test_eap_on_tl_blocks_equals_hugging_face_gpt2(steps: int | None) -> None:
    gpt2 = hf_gpt2()
    tl = stand_in_of(gpt2)
    with hookscope.capture(tl, "blocks.0.ln1") as acts:
        tl(inputs()[0])
    assert acts.counts == {"blocks.0.ln1": 3}  # what the refusal was about
    _check_equal(tl, gpt2, steps)


@pytest.mark.parametrize("steps", [None, 3])
def test_eap_on_transformer_lens_hooked_transformer_equals_hugging_face_gpt2(steps: int | None) -> None:
    pytest.importorskip("transformer_lens", reason="TransformerLens 3.9 lives in the benchmark's "
                        "peer environment (bench/requirements-peers.txt); bench/tl_eap.py records "
                        "this comparison there")
    _check_equal(tl_hooked_transformer(hf := hf_gpt2()), hf, steps)


def test_a_projection_that_reads_two_calls_of_the_norm_is_refused() -> None:
    class Mixed(SplitBlock):  # q reads the average of two ln1 calls: no one call is q's input
        def forward(self, resid_pre: Tensor) -> Tensor:
            resid_pre = self.hook_resid_pre(resid_pre)
            query = (self.ln1(resid_pre) + self.ln1(resid_pre)) / 2
            attn_out = self.hook_attn_out(self.attn(query, self.ln1(resid_pre), self.ln1(resid_pre)))
            resid_mid = self.hook_resid_mid(resid_pre + attn_out)
            return self.hook_resid_post(resid_mid + self.hook_mlp_out(self.mlp(self.ln2(resid_mid))))

    model = stand_in_of(hf_gpt2())
    model.blocks[0].__class__ = Mixed
    clean, corrupted = inputs()
    with pytest.raises(EditError, match=r"'blocks\.0\.ln1' ran 4 times .* 'attn\.q\.0' reads 2 of its calls"):
        hookscope.edge_attribution_patching(model, clean, corrupted, logit_difference)
    assert not hookscope.hooks(model)  # nothing left behind
