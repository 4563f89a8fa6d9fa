"""Issue 46: standard names where the residual stream is computed outside any module, and the
logit lens on encoder-decoders, checked against the model's own ``hidden_states`` and logits
and against the same edit written with plain torch hooks.

- embeddings scaled and positions added inline (OPT, BioGPT, XGLM, Blenderbot, Marian, Pegasus):
  ``resid_pre.0`` is the function call of the model's own forward that computes
  ``hidden_states[0]``; capturing and steering it equal the model's values and a plain forward
  pre-hook on the first block;
- hidden states that are each block's output (Mamba, RWKV): ``resid_post.{i}`` is
  ``hidden_states[i]``, ``resid_pre.0`` the first block's input;
- a hidden state no module and no call before the blocks computes is refused by name;
- the logit lens of an encoder-decoder reads its decoder (``decoder_input_ids``), through
  whatever the model applies after it (T5's scale, BART's ``final_logits_bias``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import ArgumentValueError, CaptureError, SelectorError

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

from tests.zoo.build import tiny_config  # noqa: E402

IDS = torch.tensor([[5, 9, 14, 3, 7, 11]])
INLINE = ["opt", "biogpt", "xglm", "blenderbot", "marian", "pegasus", "blenderbot-small"]


def _causal(family: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family)
    config.is_decoder = True
    return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()


def _states(model: nn.Module, ids: torch.Tensor, name: str = "hidden_states") -> Any:
    with torch.no_grad():
        return getattr(model(ids, output_hidden_states=True), name)


def _first_block(model: nn.Module) -> nn.Module:
    return next(iter(hookscope.select(model, "resid_post.0").values()))


@settings(max_examples=8, deadline=None)
@given(family=st.sampled_from(INLINE), seed=st.integers(0, 3))
def test_inline_resid_pre_0_is_the_call_that_computes_hidden_states_0(family: str, seed: int) -> None:
    model = _causal(family, seed)
    (target,) = hookscope.engine.resolve(model, ["resid_pre.0"])
    assert target.op is not None  # no module's output holds it: a call of the model's forward
    states = _states(model, IDS)
    blocks = len(hookscope.select(model, "resid_post.*"))
    with hookscope.capture(model, "resid_pre.*", "resid_post.*") as acts, torch.no_grad():
        model(IDS)
    for i in range(blocks):
        assert torch.allclose(acts[f"resid_pre.{i}"], states[i], atol=1e-5)
    for i in range(blocks - 1):
        assert torch.allclose(acts[f"resid_post.{i}"][0], states[i + 1], atol=1e-5)


@settings(max_examples=5, deadline=None)
@given(family=st.sampled_from(INLINE), seed=st.integers(0, 3), scale=st.sampled_from([0.5, 4.0]))
def test_steering_inline_resid_pre_0_equals_a_plain_pre_hook_on_the_first_block(
        family: str, seed: int, scale: float) -> None:
    model = _causal(family, seed)
    vector = torch.randn(int(_states(model, IDS)[0].shape[-1]),
                         generator=torch.Generator().manual_seed(seed)) * scale

    def add(module: nn.Module, args: Any, kwargs: Any) -> Any:  # the oracle: plain torch
        if args:
            return (args[0] + vector, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + vector}
    handle = _first_block(model).register_forward_pre_hook(add, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(IDS).logits
    finally:
        handle.remove()
    with hookscope.steer(model, {"resid_pre.0": vector}), torch.no_grad():
        got = model(IDS).logits
    with torch.no_grad():
        plain = model(IDS).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # the edit did something


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "rwkv"])
def test_hidden_states_after_each_block_name_the_blocks_and_the_first_blocks_input(family: str) -> None:
    model = _causal(family, 0)
    states = _states(model, IDS)
    entered: list[torch.Tensor] = []
    handle = _first_block(model).register_forward_pre_hook(lambda m, a: entered.append(a[0].clone()))
    try:
        with torch.no_grad():
            model(IDS)
    finally:
        handle.remove()
    blocks = len(hookscope.select(model, "resid_post.*"))
    assert len(states) == blocks + 1  # each block's output, then the final norm's
    with hookscope.capture(model, "resid_pre.0", "resid_post.*") as acts, torch.no_grad():
        model(IDS)
    assert torch.allclose(acts["resid_pre.0"], entered[0], atol=1e-6)
    for i in range(blocks):
        post = acts[f"resid_post.{i}"]
        assert torch.allclose(post[0] if isinstance(post, tuple) else post, states[i], atol=1e-5)


class _LateStates(nn.Module):
    """Its ``hidden_states[0]`` is computed after the blocks ran: no module and no call before
    the first block gives it."""

    main_input_name = "input_ids"

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig(vocab_size=16)
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None,
                output_hidden_states: bool = False, return_dict: bool = True) -> Any:
        h = self.embed(input_ids)
        x, outs = h, []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return transformers.modeling_outputs.BaseModelOutput(
            last_hidden_state=x, hidden_states=(h * 3, *outs))


def test_a_hidden_state_nothing_before_the_blocks_computes_is_refused_by_name() -> None:
    torch.manual_seed(0)
    model = _LateStates().eval()
    with pytest.raises(SelectorError, match=r"resid_pre\.0.*hidden_states\[0\].*no module's output"
                                            r".*inputs=True"):
        hookscope.select(model, "resid_pre.0")
    assert list(hookscope.select(model, "resid_post.0")) == ["layers.0"]


# ----------------------------------------------------------------------------- the lens


def _seq2seq(family: str, seed: int, bias: float) -> nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family)
    if getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0
    model = transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[type(config)](config).eval()
    if hasattr(model, "final_logits_bias"):  # BART-likes: zeros unless trained
        with torch.no_grad():
            model.final_logits_bias.normal_(0.0, bias)
    return model


@settings(max_examples=6, deadline=None)
@given(family=st.sampled_from(["t5", "bart", "marian", "pegasus", "mbart", "switch_transformers"]),
       seed=st.integers(0, 3), bias=st.sampled_from([0.0, 2.0]))
def test_encoder_decoder_lens_last_layer_is_the_models_log_probs(family: str, seed: int,
                                                                bias: float) -> None:
    model = _seq2seq(family, seed, bias)
    decoder = IDS[:, :4]
    lens = hookscope.logit_lens(model, IDS, decoder_input_ids=decoder)
    with torch.no_grad():
        want = torch.log_softmax(model(IDS, decoder_input_ids=decoder).logits.float(), dim=-1)
    assert lens.log_probs.shape[2] == decoder.shape[1]
    assert float((lens.log_probs[-1] - want).abs().max()) <= 1e-4


def test_bart_lens_first_layer_is_lm_head_plus_its_bias_by_hand() -> None:
    model = _seq2seq("bart", 0, 2.0)
    decoder = IDS[:, :4]
    lens = hookscope.logit_lens(model, IDS, decoder_input_ids=decoder)
    with torch.no_grad():
        states = model(IDS, decoder_input_ids=decoder, output_hidden_states=True).decoder_hidden_states
        first = model.lm_head(states[1]) + model.final_logits_bias
    assert torch.allclose(lens.log_probs[0], torch.log_softmax(first, dim=-1), atol=1e-4)


def test_lens_asks_an_encoder_decoder_for_decoder_ids_and_refuses_them_elsewhere() -> None:
    with pytest.raises(CaptureError, match="decoder_input_ids="):
        hookscope.logit_lens(_seq2seq("t5", 0, 0.0), IDS)
    with pytest.raises(ArgumentValueError, match="not one"):
        hookscope.logit_lens(_causal("opt", 0), IDS, decoder_input_ids=IDS)


def test_inline_resid_pre_0_on_a_compiled_model_is_the_same_call_and_steers_as_eager() -> None:
    model = _causal("opt", 0)
    compiled = torch.compile(model, backend="eager")
    assert list(hookscope.select(compiled, "resid_pre.0")) == list(hookscope.select(model, "resid_pre.0"))
    vector = torch.randn(int(_states(model, IDS)[0].shape[-1]), generator=torch.Generator().manual_seed(1))
    handle = _first_block(model).register_forward_pre_hook(lambda m, a: (a[0] + vector, *a[1:]))
    try:
        with torch.no_grad():
            want = model(IDS).logits
    finally:
        handle.remove()
    with hookscope.steer(compiled, {"resid_pre.0": vector}), torch.no_grad():
        got = compiled(IDS).logits
    assert torch.allclose(got, want, atol=1e-5)


@settings(max_examples=4, deadline=None)
@given(family=st.sampled_from(INLINE), seed=st.integers(0, 3))
def test_patching_inline_resid_pre_0_equals_a_plain_pre_hook_giving_the_clean_input(
        family: str, seed: int) -> None:
    model = _causal(family, seed)
    corrupted = torch.randint(4, 100, IDS.shape, generator=torch.Generator().manual_seed(seed))
    block = _first_block(model)
    clean: list[torch.Tensor] = []
    handle = block.register_forward_pre_hook(
        lambda m, a, k: clean.append((a[0] if a else k["hidden_states"]).clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            model(IDS)
    finally:
        handle.remove()

    def give(module: nn.Module, args: Any, kwargs: Any) -> Any:  # the oracle: plain torch
        if args:
            return (clean[0], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": clean[0]}
    handle = block.register_forward_pre_hook(give, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(corrupted).logits
    finally:
        handle.remove()
    with hookscope.capture(model, "resid_pre.0") as source, torch.no_grad():
        model(IDS)
    with hookscope.patch(model, source=source, layers="resid_pre.0"), torch.no_grad():
        got = model(corrupted).logits
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family", ["layoutlm", "fnet"])
def test_lens_reads_past_a_pooler_that_reads_one_token(family: str) -> None:
    """The pooler runs after the last block on its first token; the MLM head reads every
    token: the readout keeps the modules that keep the token axis."""
    torch.manual_seed(0)
    config = tiny_config(family)
    model = transformers.MODEL_FOR_MASKED_LM_MAPPING[type(config)](config).eval()
    assert any(path.endswith("pooler") for path, _ in model.named_modules())  # the premise
    lens = hookscope.logit_lens(model, IDS)
    with torch.no_grad():
        want = torch.log_softmax(model(IDS).logits.float(), dim=-1)
    assert float((lens.log_probs[-1] - want).abs().max()) <= 1e-4


def test_attention_refuses_a_softmax_sliced_before_use_by_name() -> None:
    """GPT-OSS's eager attention softmaxes over the keys and a sink column, then drops the sink:
    the softmax's output is not the model's map (``output_attentions`` has one column fewer)."""
    torch.manual_seed(0)
    config = tiny_config("gpt_oss")
    model = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        own = model(IDS, output_attentions=True).attentions[0]
    assert own.shape[-1] == IDS.shape[1]  # the premise: the model's map is over the keys
    with pytest.raises(hookscope.errors.AttentionError, match="slices the softmax's output"):
        hookscope.attention(model, IDS, layers="resid_post.0")
