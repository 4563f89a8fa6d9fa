"""Attribution graphs beyond the peer's model (issue 50 item 4): a Llama (RMSNorm, rotary,
SwiGLU) and a GPT-2 whose last-layer edges into the logits are computed by hand in plain torch
(the final norm's scale frozen, the demeaned unembedding); SDPA models; refusals that leave no
hook behind."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import hookscope
from hookscope import CircuitError

D, F = 16, 32
IDS = torch.tensor([0, 7, 3, 11, 5, 9, 2, 14])


def llama(attn: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=20, hidden_size=D, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(attn: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=20, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config).eval()


def transcoders(paths: list[str]) -> dict[str, hookscope.Transcoder]:
    g = torch.Generator().manual_seed(5)
    return {p: hookscope.Transcoder(W_enc=torch.randn(D, F, generator=g) / D ** 0.5,
                                    b_enc=torch.randn(F, generator=g) * 0.1 - 0.2,
                                    W_dec=torch.randn(F, D, generator=g) / F ** 0.5,
                                    b_dec=torch.randn(D, generator=g) * 0.1) for p in paths}


CASES = {"llama": (llama, "model.layers.{}.mlp", "model.layers.{}.post_attention_layernorm", "model.norm"),
         "gpt2": (gpt2, "transformer.h.{}.mlp", "transformer.h.{}.ln_2", "transformer.ln_f")}


def _frozen_final(model: torch.nn.Module, final_norm: str, x: torch.Tensor) -> torch.Tensor:
    """d(normed x)/dx with the norm's scale frozen, applied to nothing: the per-position scale."""
    norm = model.get_submodule(final_norm)
    if isinstance(norm, torch.nn.LayerNorm):
        centered = x - x.mean(-1, keepdim=True)
        return (centered.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    return (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()


@pytest.mark.parametrize("family", sorted(CASES))
def test_last_layer_edges_into_the_logits_by_hand(family: str, tmp_path: Path) -> None:
    """An edge from a last-layer source into a logit crosses only the final norm (scale frozen)
    and the unembedding: ``source_vector . (w_norm / sigma) * (W_U[t] - mean W_U)`` (centred for
    LayerNorm), written here with plain hooks."""
    build, mlp, norm_in, final_norm = CASES[family]
    model = build()
    paths = [mlp.format(i) for i in range(2)]
    tcs = transcoders(paths)
    graph = hookscope.attribution_graph(model, IDS, transcoders=tcs, folder=tmp_path)
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(paths[1]).register_forward_hook(
                   lambda m, args, out: seen.update(x=args[0], out=out)),
               model.get_submodule(final_norm).register_forward_hook(
                   lambda m, args, out: seen.update(final=args[0]))]
    try:
        with torch.no_grad():
            logits = model(IDS[None]).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    tc = tcs[paths[1]]
    with torch.no_grad():
        acts = tc.encode(seen["x"][0])                                     # (seq, F)
        acts[0] = 0
        error = seen["out"][0] - (acts @ tc.W_dec + tc.b_dec)
        error[0] = 0
    x_final = seen["final"][0, -1]
    weight = model.get_submodule(final_norm).weight.detach()
    w_u = model.get_output_embeddings().weight.detach()
    probs = torch.softmax(logits, -1)
    assert torch.equal(graph.logit_ids, torch.argsort(probs, descending=True)[:len(graph.logit_ids)])
    scale = _frozen_final(model, final_norm, x_final)
    n_nodes, n_logits, n_pos = len(graph.nodes), len(graph.logit_ids), len(IDS)
    adjacency = np.array(graph.adjacency)
    for k, token in enumerate(graph.logit_ids.tolist()):
        direction = weight * (w_u[token] - w_u.mean(0)) / scale            # into the final residual
        if family == "gpt2":
            direction = direction - direction.mean()                       # LayerNorm centres first
        row = adjacency[n_nodes - n_logits + k]
        last = [i for i, (kind, layer, pos, _) in enumerate(graph.nodes)
                if kind == "feature" and layer == 1 and pos == n_pos - 1]
        feats = graph.features[last]
        expected = acts[-1, feats[:, 2]] * (tc.W_dec[feats[:, 2]].detach() @ direction)
        np.testing.assert_allclose(row[last], expected.numpy(), rtol=1e-4, atol=1e-5)
        error_node = graph.n_features + 1 * n_pos + n_pos - 1              # error (layer 1, last)
        assert row[error_node] == pytest.approx(float(error[-1] @ direction), rel=1e-4, abs=1e-5)
    assert len(last) > 0 and (adjacency[: graph.n_features] != 0).any()


@pytest.mark.parametrize("family", sorted(CASES))
def test_sdpa_models_give_the_eager_graph_and_keep_their_attention(family: str, tmp_path: Path) -> None:
    build, mlp, _, _ = CASES[family]
    eager, sdpa = build("eager"), build("sdpa")
    tcs = transcoders([mlp.format(i) for i in range(2)])
    a = hookscope.attribution_graph(eager, IDS, transcoders=tcs, folder=tmp_path / "a")
    b = hookscope.attribution_graph(sdpa, IDS[None], transcoders=tcs, folder=tmp_path / "b")
    assert torch.equal(a.features, b.features)
    np.testing.assert_allclose(np.array(a.adjacency), np.array(b.adjacency), rtol=1e-4, atol=1e-5)
    assert sdpa.config._attn_implementation == "sdpa"
    assert all(p.requires_grad for p in sdpa.parameters())                  # as it was found
    assert hookscope.hooks(sdpa) == []


def test_refusals_name_the_fix_and_leave_no_hook(tmp_path: Path) -> None:
    model = gpt2()
    tcs = transcoders(["transformer.h.0.mlp", "transformer.h.1.mlp"])
    one = tcs["transformer.h.1.mlp"]
    with pytest.raises(CircuitError, match="give the MLPs' exact paths"):
        hookscope.attribution_graph(model, IDS, transcoders={"transformer.h.9.mlp": one})
    with pytest.raises(CircuitError, match="tokenizer"):
        hookscope.attribution_graph(model, torch.stack([IDS, IDS]), transcoders=tcs)
    with pytest.raises(CircuitError, match=r"hookscope\.Transcoder"):
        hookscope.attribution_graph(model, IDS, transcoders={"transformer.h.0.mlp": torch.nn.Linear(D, D)})

    with pytest.raises(CircuitError, match="batch_size must be a positive int"):
        hookscope.attribution_graph(model, IDS, transcoders=tcs, batch_size=0)
    with pytest.raises(CircuitError, match="no output embedding module"):
        hookscope.attribution_graph(model.transformer, IDS, transcoders={})
    model.train()
    graph = hookscope.attribution_graph(model, IDS, transcoders=tcs, folder=tmp_path / "train")
    eval_graph = hookscope.attribution_graph(model.eval(), IDS, transcoders=tcs, folder=tmp_path / "eval")
    np.testing.assert_array_equal(np.array(graph.adjacency), np.array(eval_graph.adjacency))  # no dropout
    model.train()
    hookscope.attribution_graph(model, IDS, transcoders=tcs, folder=tmp_path / "again")
    assert model.training and all(m.training for m in model.modules())      # as it was found

    class GemmaLikeRMSNorm(torch.nn.Module):          # (1 + weight): not the form that is frozen
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.full((D,), 0.5)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt() * (1 + self.weight)

    model.eval()
    model.transformer.h[1].ln_2 = GemmaLikeRMSNorm()
    with pytest.raises(CircuitError, match="transformer.h.1.ln_2.*cannot be frozen"):
        hookscope.attribution_graph(model, IDS, transcoders=tcs, folder=tmp_path)
    assert hookscope.hooks(model) == [] and all(p.requires_grad for p in model.parameters())


def test_rows_do_not_depend_on_the_batch_of_targets(tmp_path: Path) -> None:
    """One target per backward pass (no batching) gives the rows that batches of 64 give."""
    model = llama()
    tcs = transcoders([f"model.layers.{i}.mlp" for i in range(2)])
    one = hookscope.attribution_graph(model, IDS, transcoders=tcs, batch_size=1, folder=tmp_path / "one")
    many = hookscope.attribution_graph(model, IDS, transcoders=tcs, batch_size=64, folder=tmp_path / "many")
    assert one.n_features > 10
    np.testing.assert_allclose(np.array(one.adjacency), np.array(many.adjacency), rtol=1e-5, atol=1e-6)


def test_the_model_is_never_changed_while_a_graph_is_built_seen_from_another_thread(tmp_path: Path) -> None:
    """The graph's forward runs on a frozen view of the model (``circuits.view``): a user's hook on
    the model runs in it, and from there another thread finds the model as it was (SDPA
    attention, training mode, weights requiring grad, the same hook tables) and computes what
    it computed before; so it is after. (main switched the model itself to eager attention, eval
    mode and weights without gradients for the call.)"""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=20, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()  # no dropout: train mode computes as eval
    with torch.no_grad():
        reference = model(IDS[None]).logits
    main, seen = threading.get_ident(), []

    def look() -> None:
        with torch.no_grad():
            logits = model(IDS[None]).logits
        configs = [m.config for m in model.modules() if hasattr(m, "config")]
        seen.append({"attention": {c._attn_implementation for c in configs},
                     "training": all(m.training for m in model.modules()),
                     "requires_grad": all(p.requires_grad for p in model.parameters()),
                     "hooks": hookscope.hooks(model), "same forward": torch.allclose(logits, reference)})

    def from_another_thread(module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == main and not seen:
            observer = threading.Thread(target=look)
            observer.start()
            observer.join()

    handle = model.transformer.h[0].register_forward_hook(from_another_thread)
    try:
        hooks_before = hookscope.hooks(model)
        tcs = transcoders([f"transformer.h.{i}.mlp" for i in range(2)])
        graph = hookscope.attribution_graph(model, IDS, transcoders=tcs, folder=tmp_path)
        look()
    finally:
        handle.remove()
    assert graph.n_features > 0
    as_found = {"attention": {"sdpa"}, "training": True, "requires_grad": True, "hooks": hooks_before,
                "same forward": True}
    assert seen == [as_found, as_found]  # during the graph's forward, and after
