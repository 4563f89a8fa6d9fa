"""circuit-tracer's attribution graph of a tiny GPT-2 with random transcoders, for
``tests/test_circuits_peer.py`` (run in circuit-tracer's own environment, not hookscope's):

    /work/venv-ct/bin/python bench/circuit_tracer_peer.py bench/circuit_tracer_graph.safetensors

(``python3 -m venv /work/venv-ct; pip install torch==2.13.0; pip install circuit-tracer``: 0.5.0,
transformers 4.57.3, transformer-lens 3.2.1.) The model is built from a config with a seed, in
transformers, and converted to TransformerLens with its own converter; the transcoders are
random tensors. One file holds the model's state dict (``model.*``), the transcoders
(``tc{l}.*``, hookscope's layout: ``W_enc`` ``(d_model, d_features)``), the prompt, and
circuit-tracer's graph: ``adjacency``, ``active_features``, ``selected_features``,
``activation_values``, ``logit_ids``, ``logit_probabilities``, and ``prune_node_mask`` /
``prune_edge_mask`` / ``prune_scores`` of ``prune_graph(graph, 0.8, 0.98)``; the test rebuilds
the model and transcoders from it and compares hookscope's graph. Beside it, ``...graph.json`` is
the viewer's JSON (``create_graph_files``' steps) and ``...transcoder0.safetensors`` the layer-0
transcoder as circuit-tracer saves one (``to_safetensors``).

``--memory SEQ`` instead measures one graph of a SEQ-token prompt (peak RSS, seconds).
"""

from __future__ import annotations

import sys
import time

import torch

SEED, N_LAYER, D_MODEL, N_HEAD, VOCAB, D_FEATURES, SEQ = 0, 2, 16, 2, 50, 24, 8


def tiny_gpt2(n_positions: int = 64, n_layer: int = N_LAYER, d_model: int = D_MODEL,
              vocab: int = VOCAB) -> torch.nn.Module:
    import transformers

    torch.manual_seed(SEED)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=N_HEAD, vocab_size=vocab,
                                     n_positions=n_positions, bos_token_id=0, eos_token_id=0,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval()


def random_transcoders(n_layer: int = N_LAYER, d_model: int = D_MODEL, d_features: int = D_FEATURES,
                       bias: float = -0.1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED + 1)
    return [{"W_enc": torch.randn(d_model, d_features, generator=g) / d_model ** 0.5,
             "b_enc": torch.randn(d_features, generator=g) * 0.1 + bias,
             "W_dec": torch.randn(d_features, d_model, generator=g) / d_features ** 0.5,
             "b_dec": torch.randn(d_model, generator=g) * 0.1} for _ in range(n_layer)]


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t0", unk_token="t1")


def replacement_model(hf, tcs, n_ctx: int):
    from circuit_tracer.replacement_model import ReplacementModel
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    c = hf.config
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=n_ctx,
                                  d_head=c.n_embd // c.n_head, n_heads=c.n_head, d_mlp=4 * c.n_embd,
                                  d_vocab=c.vocab_size, act_fn="gelu_new", normalization_type="LN",
                                  eps=c.layer_norm_epsilon, original_architecture="GPT2LMHeadModel",
                                  model_name="tiny-gpt2", device="cpu", dtype=torch.float32)
    layers = {}
    for layer, w in enumerate(tcs):
        t = SingleLayerTranscoder(c.n_embd, w["W_enc"].shape[1], torch.nn.functional.relu, layer,
                                  device=torch.device("cpu"), dtype=torch.float32)
        t.load_state_dict({"W_enc": w["W_enc"].T.contiguous(), "W_dec": w["W_dec"],
                           "b_enc": w["b_enc"], "b_dec": w["b_dec"]})
        layers[layer] = t
    transcoders = TranscoderSet(layers, feature_input_hook="mlp.hook_in",
                                feature_output_hook="mlp.hook_out", scan="tiny")
    model = ReplacementModel.from_config(cfg, transcoders)
    state = {k.replace(".mlp.", ".mlp.old_mlp.").replace("unembed.", "unembed.old_unembed."): v
             for k, v in convert_gpt2_weights(hf, cfg).items()}  # circuit-tracer wraps both
    state["unembed.old_unembed.b_U"] = torch.zeros(c.vocab_size)  # GPT-2 has no unembedding bias
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(k.endswith(("mask", "IGNORE")) or k.startswith("transcoders.") for k in result.missing_keys), \
        result.missing_keys
    model.tokenizer = _tokenizer(c.vocab_size)
    return model


def peer_graph(out_path: str) -> None:
    from circuit_tracer import attribute
    from circuit_tracer.graph import prune_graph
    from safetensors.torch import save_file

    hf, tcs = tiny_gpt2(), random_transcoders()
    model = replacement_model(hf, tcs, 64)
    ids = torch.randint(1, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(SEED + 2))
    ids[0] = 0                                         # the BOS circuit-tracer would prepend
    with torch.no_grad():  # the converted model computes what the transformers model does
        torch.testing.assert_close(model(ids[None]), hf(ids[None]).logits, rtol=1e-4, atol=1e-5)
    graph = attribute(ids, model, max_n_logits=10, desired_logit_prob=0.95, batch_size=16)
    pruned = prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)
    tensors = {f"model.{k}": v.contiguous() for k, v in hf.state_dict().items()
               if not k.endswith(".attn.bias") and not k.endswith("masked_bias")}
    tensors.pop("model.lm_head.weight", None)         # tied to the embedding
    for layer, w in enumerate(tcs):
        tensors.update({f"tc{layer}.{k}": v.contiguous() for k, v in w.items()})
    tensors.update(input_ids=ids, adjacency=graph.adjacency_matrix.contiguous(),
                   active_features=graph.active_features.contiguous(),
                   selected_features=graph.selected_features.contiguous(),
                   activation_values=graph.activation_values.contiguous(),
                   logit_ids=graph.logit_token_ids, logit_probabilities=graph.logit_probabilities,
                   prune_node_mask=pruned.node_mask.to(torch.uint8),
                   prune_edge_mask=pruned.edge_mask.to(torch.uint8), prune_scores=pruned.cumulative_scores)
    save_file(tensors, out_path, metadata={"circuit_tracer": __import__("circuit_tracer").__version__})
    _viewer_json(graph, model.tokenizer, out_path.replace(".safetensors", ".json"))
    model.transcoders[0].to_safetensors(out_path.replace("graph.safetensors", "transcoder0.safetensors"))
    print(f"wrote {out_path}: {graph.adjacency_matrix.shape[0]} nodes, "
          f"{len(graph.active_features)} active features, {int(pruned.node_mask.sum())} kept")


def _viewer_json(graph, tokenizer, path: str) -> None:
    """circuit-tracer's graph JSON, by the steps of its ``create_graph_files`` (which would load
    the tokenizer by a hub name this offline model has not)."""
    from circuit_tracer.graph import prune_graph
    from circuit_tracer.utils.create_graph_files import build_model, create_nodes, create_used_nodes_and_edges

    node_mask, edge_mask, scores = prune_graph(graph, 0.8, 0.98)
    nodes = create_nodes(graph, node_mask, tokenizer, scores)
    used_nodes, used_edges = create_used_nodes_and_edges(graph, nodes, edge_mask)
    model = build_model(graph, used_nodes, used_edges, "tiny", "tiny", 0.8, tokenizer)
    with open(path, "w") as f:
        f.write(model.model_dump_json(indent=2))


#: the memory sweep's model: GPT-2-shaped, 2 layers, width 64, sparse random transcoders (a
#: negative encoder bias: one or two of 512 features active per token and layer)
MEMORY = {"n_layer": 2, "d_model": 64, "vocab": 512, "d_features": 512, "bias": -2.8}


def memory_setup(seq: int):
    """The sweep's model (transformers), transcoder weights and prompt for a ``seq``-token graph."""
    m = MEMORY
    hf = tiny_gpt2(n_positions=seq, n_layer=m["n_layer"], d_model=m["d_model"], vocab=m["vocab"])
    tcs = random_transcoders(m["n_layer"], m["d_model"], m["d_features"], m["bias"])
    ids = torch.randint(1, m["vocab"], (seq,), generator=torch.Generator().manual_seed(3))
    ids[0] = 0
    return hf, tcs, ids


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def peer_memory(seq: int) -> None:
    """One circuit-tracer graph of a ``seq``-token prompt: peak RSS above the RSS once the model
    is built (MiB), seconds. Prints one JSON line."""
    import json
    import resource

    from circuit_tracer import attribute

    hf, tcs, ids = memory_setup(seq)
    model = replacement_model(hf, tcs, seq)
    base = rss_mib()
    start = time.perf_counter()
    graph = attribute(ids, model, max_n_logits=10, batch_size=64)
    print(json.dumps({"tool": "circuit-tracer", "seq": seq, "nodes": graph.adjacency_matrix.shape[0],
                      "features": len(graph.active_features), "seconds": time.perf_counter() - start,
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base}))


if __name__ == "__main__":
    if sys.argv[1] == "--memory":
        peer_memory(int(sys.argv[2]))
    elif not sys.argv[1].endswith("graph.safetensors"):
        sys.exit("name the output ...graph.safetensors: its .json and transcoder0 files are named after it")
    else:
        peer_graph(sys.argv[1])
