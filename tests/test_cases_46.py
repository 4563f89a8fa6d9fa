"""Issue 46: verbs that check themselves against what the model computed (cases 62 and 63,
standard names against ``output_hidden_states``, the logit lens against the model's own
log-probabilities, generation against the returned sequences, gradients against
``register_full_backward_hook``), with generated tiny configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import CaptureError

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def _gemma2(softcap: float | None = 30.0, layers: int = 2, scale: float = 150.0) -> Any:
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=softcap,
        attn_logit_softcapping=50.0, pad_token_id=0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():  # trained Gemma-2 logits reach ~100 before the cap of 30
        model.lm_head.weight.mul_(scale)
    return model


IDS = torch.tensor([[2, 5, 9, 14, 3, 7]])


def _log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


# ----------------------------------------------------------------------------- case 62


def test_case_62_gemma2_lens_last_layer_is_the_models_log_probs() -> None:
    model = _gemma2()
    lens = hookscope.logit_lens(model, IDS)
    want = _log_probs(model, IDS)
    # the plain norm + lm_head reading is ~89 nats away (the case); the lens applies the cap
    assert float((lens.log_probs[-1] - want).abs().max()) <= 1e-4
    with torch.no_grad():
        hidden = model(IDS, output_hidden_states=True).hidden_states
        uncapped = torch.log_softmax(model.lm_head(hidden[-1]), dim=-1)
    assert float((uncapped - want).abs().max()) > 10.0  # the case's premise holds here
    # every earlier layer goes through the same cap: block 0's reading by hand
    with torch.no_grad():
        first = 30.0 * torch.tanh(model.lm_head(model.model.norm(hidden[1])) / 30.0)
    assert torch.allclose(lens.log_probs[0], torch.log_softmax(first, dim=-1), atol=1e-4)


def test_lens_refuses_a_head_it_cannot_reproduce() -> None:
    model = _gemma2(softcap=None)
    inner = model.lm_head

    class Squashed(nn.Module):  # an output head whose logits pass a function no config names
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model.lm_head = Squashed()
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        out.logits = out.logits.sin() * 40.0
        return out

    model.forward = forward  # type: ignore[method-assign]
    with pytest.raises(CaptureError, match=r"differ from .* own log-probabilities by [\d.]+ nats"):
        hookscope.logit_lens(model, IDS)


@settings(max_examples=6, deadline=None)
@given(layers=st.integers(1, 3), softcap=st.sampled_from([None, 5.0, 30.0]),
       scale=st.sampled_from([1.0, 50.0]))
def test_generated_gemma2_lens_and_names_equal_the_model(layers: int, softcap: float | None,
                                                        scale: float) -> None:
    model = _gemma2(softcap, layers, scale)
    lens = hookscope.logit_lens(model, IDS)
    assert float((lens.log_probs[-1] - _log_probs(model, IDS)).abs().max()) <= 1e-4
    _assert_names_equal_hidden_states(model, IDS)


@settings(max_examples=6, deadline=None)
@given(family=st.sampled_from(["gpt2", "llama", "cohere", "granite", "opt"]),
       layers=st.integers(1, 3), seed=st.integers(0, 3))
def test_generated_configs_lens_equals_or_refuses(family: str, layers: int, seed: int) -> None:
    """Families whose heads differ (Cohere's logit_scale, Granite's logits_scaling, OPT's
    final norm then projection): the lens's last layer equals the model, never differs."""
    from tests.zoo.build import tiny_config
    torch.manual_seed(seed)
    extra: dict[str, Any] = {"num_hidden_layers": layers} if family != "gpt2" else {"n_layer": layers}
    if family == "cohere":
        extra["logit_scale"] = 0.25 + seed
    if family == "granite":
        extra["logits_scaling"] = 2.0 + seed
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(tiny_config(family))]
    model = cls(tiny_config(family, **extra)).eval()
    ids = torch.randint(4, 100, (2, 5), generator=torch.Generator().manual_seed(seed))
    lens = hookscope.logit_lens(model, ids)
    assert float((lens.log_probs[-1] - _log_probs(model, ids)).abs().max()) <= 1e-4


# ----------------------------------------------------------------------------- standard names


def _assert_names_equal_hidden_states(model: nn.Module, ids: torch.Tensor) -> None:
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    count = len(hookscope.select(model, "resid_post.*"))
    assert count == len(states) - 1  # one block per hidden state after the embeddings
    with hookscope.capture(model, "resid_pre.*", "resid_post.*") as acts, torch.no_grad():
        model(ids)
    for i in range(count):
        pre = acts[f"resid_pre.{i}"]
        assert torch.allclose(pre[0] if isinstance(pre, tuple) else pre, states[i], atol=1e-5)
    for i in range(count - 1):
        post = acts[f"resid_post.{i}"]
        assert torch.allclose(post[0] if isinstance(post, tuple) else post, states[i + 1], atol=1e-5)


def test_resid_pre_0_computed_outside_any_module_is_the_inline_call_that_computes_it() -> None:
    """OPT adds its learned positions to the token embeddings inline: no module's output is
    ``hidden_states[0]``; the name is the function call of the decoder's own forward whose
    value it is (never the token embedding, whose output differs)."""
    from tests.zoo.build import tiny_config
    model = transformers.OPTForCausalLM(tiny_config("opt")).eval()
    (target,) = hookscope.engine.resolve(model, ["resid_pre.0"])
    assert (target.path, target.op) == ("model.decoder", "add#0")
    with torch.no_grad():
        states = model(IDS, output_hidden_states=True).hidden_states
    with hookscope.capture(model, "resid_pre.0", "resid_post.0") as acts, torch.no_grad():
        model(IDS)
    assert torch.allclose(acts["resid_pre.0"], states[0], atol=1e-6)
    assert torch.allclose(acts["resid_post.0"], states[1], atol=1e-6)


def test_embed_is_the_models_input_embedding() -> None:
    model = _gemma2()
    assert list(hookscope.select(model, "embed")) == ["model.embed_tokens"]


def test_check_runs_one_probe_forward_per_model() -> None:
    model = _gemma2()
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    hookscope.select(model, "resid_post.*")
    hookscope.select(model, "resid_pre.0")
    hookscope.logit_lens(model, IDS)
    handle.remove()
    assert len(calls) == 2  # the probe, then the lens's own forward


def test_probe_is_not_recorded_by_an_open_capture() -> None:
    model = _gemma2()
    with hookscope.capture(model, "model.layers.0") as acts, torch.no_grad():
        hookscope.select(model, "resid_post.1")  # the first use: the probe runs now
        model(IDS)
    assert acts.counts["model.layers.0"] == 1


# ----------------------------------------------------------------------------- case 63 + generation


def _t5() -> Any:
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg).eval()


SRC = torch.tensor([[5, 9, 14, 3, 7, 21, 8]])


@pytest.mark.parametrize("options", [{"do_sample": False}, {"do_sample": True, "top_k": 8},
                                     {"do_sample": False, "use_cache": False}])
def test_case_63_t5_decoder_rows_equal_a_teacher_forced_forward(options: dict[str, Any]) -> None:
    model = _t5()
    xattn = "decoder.block.0.layer.1.EncDecAttention.k"
    torch.manual_seed(3)
    with hookscope.capture_generation(model, "decoder.block.0[0]", "encoder.block.0[0]", xattn) as gen, \
            torch.no_grad():
        seq = model.generate(SRC, attention_mask=torch.ones_like(SRC), max_new_tokens=5,
                             min_new_tokens=5, bad_words_ids=[[0], [1]], **options)
    assert torch.equal(gen.token_ids(), seq[:, :-1])  # the decoder's ids
    with hookscope.capture(model, "decoder.block.0[0]", "encoder.block.0[0]", xattn) as acts, \
            torch.no_grad():
        model(SRC, attention_mask=torch.ones_like(SRC), decoder_input_ids=seq[:, :-1])
    assert torch.allclose(gen.aligned("decoder.block.0[0]"), acts["decoder.block.0[0]"], atol=1e-5)
    assert torch.allclose(gen.encoder("encoder.block.0[0]"), acts["encoder.block.0[0]"], atol=1e-5)
    with pytest.raises(CaptureError, match=r"encoder.*read encoder\('encoder.block.0\[0\]'\)"):
        gen.aligned("encoder.block.0[0]")
    if options.get("use_cache", True):
        with pytest.raises(CaptureError, match=r"encoder's 7 source positions.*records"):
            gen.aligned(xattn)


def _gpt2() -> Any:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, pad_token_id=0)).eval()


@pytest.mark.parametrize("options", [
    {"do_sample": False}, {"do_sample": True, "top_k": 5}, {"do_sample": True, "top_p": 0.9},
    {"prompt_lookup_num_tokens": 2}, {"do_sample": False, "use_cache": False},
    {"do_sample": True, "num_return_sequences": 3}])
def test_generation_strategies_align_with_the_returned_sequences(options: dict[str, Any]) -> None:
    model = _gpt2()
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    torch.manual_seed(1)
    with hookscope.capture_generation(model, "transformer.h.0") as gen, torch.no_grad():
        seq = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, **options)
    assert torch.equal(gen.token_ids(), seq[:, :-1])
    with torch.no_grad():  # block 0's output: the model's own hidden_states[1]
        forced = model(seq[:, :-1], output_hidden_states=True).hidden_states[1]
    assert torch.allclose(gen.aligned("transformer.h.0"), forced, atol=1e-5)


@pytest.mark.parametrize("options", [{"num_beams": 3}, {"num_beams": 2, "do_sample": True},
                                     {"num_beams": 3, "use_cache": False},
                                     {"num_beams": 2, "num_return_sequences": 2}])
def test_beam_search_is_refused_by_name(options: dict[str, Any]) -> None:
    model = _gpt2()
    with hookscope.capture_generation(model, "transformer.h.1") as gen, torch.no_grad():
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=5, min_new_tokens=5, **options)
    for read in (gen.token_ids, lambda: gen.aligned("transformer.h.1")):
        with pytest.raises(CaptureError, match=r"_beam_search.*beams.*num_beams=1"):
            read()


# ----------------------------------------------------------------------------- gradients


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x).tanh()


class _Output(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.a(x)
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=h, hidden_states=(h * 2,))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair, self.out = _Pair(), _Output()

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a, b = self.pair(x)
        o = self.out(a * b)
        return ((o.last_hidden_state ** 2) * w).sum() + o.hidden_states[0].sum() * 3 + b.sum()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), batch=st.integers(1, 4))
def test_output_gradients_are_what_a_full_backward_hook_defines(seed: int, batch: int) -> None:
    torch.manual_seed(seed)
    net, x, w = _Net(), torch.randn(batch, 4, requires_grad=True), torch.randn(batch, 4)
    hooked: dict[str, Any] = {}
    handle = net.pair.register_full_backward_hook(lambda m, gi, go: hooked.__setitem__("pair", go))
    outputs: dict[str, Any] = {}
    handle2 = net.out.register_forward_hook(lambda m, a, out: outputs.__setitem__("out", out))
    loss = net(x, w)
    # a ModelOutput is not a tuple of tensors: torch's full backward hook skips it, so its
    # definition is read as the gradient of the loss with respect to each returned tensor
    want_out = torch.autograd.grad(loss, [outputs["out"].last_hidden_state,
                                          outputs["out"].hidden_states[0]], retain_graph=True)
    loss.backward()
    handle.remove()
    handle2.remove()
    with hookscope.capture(net, "pair", "out", grads=True) as acts:
        net(x, w).backward()
    got_pair, got_out = acts.grad("pair"), acts.grad("out")
    assert all(torch.allclose(g, h) for g, h in zip(got_pair, hooked["pair"]))
    assert torch.allclose(got_out.last_hidden_state, want_out[0])
    assert torch.allclose(got_out.hidden_states[0], want_out[1])
