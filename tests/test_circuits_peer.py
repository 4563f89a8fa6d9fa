"""Attribution graphs against circuit-tracer 0.5.0 (issue 50 items 4 and 5).

``bench/circuit_tracer_graph.safetensors`` and ``.json`` were written by circuit-tracer itself, in
its own environment (``bench/circuit_tracer_peer.py``): a tiny GPT-2 from a config, converted to
TransformerLens by its converter, with random ReLU transcoders on both MLPs; the file holds the
model's and the transcoders' weights, so hookscope rebuilds the same model in transformers and
computes its graph here. The last test runs the peer live when its environment exists.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import hookscope
from hookscope.circuits import prune
from hookscope.circuits.graph_json import graph_payload

BENCH = Path(__file__).resolve().parents[1] / "bench"
PEER = BENCH / "circuit_tracer_graph.safetensors"
PEER_PYTHON = Path("/work/venv-ct/bin/python")


def rebuild(path: Path) -> tuple[torch.nn.Module, dict[str, hookscope.Transcoder], dict[str, torch.Tensor]]:
    peer = load_file(str(path))
    state = {k[len("model."):]: v for k, v in peer.items() if k.startswith("model.")}
    d_model, n_layer = state["transformer.wte.weight"].shape[1], 1 + max(
        int(k.split(".")[2]) for k in state if k.startswith("transformer.h."))
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=d_model, n_head=2,
                                     vocab_size=state["transformer.wte.weight"].shape[0],
                                     n_positions=state["transformer.wpe.weight"].shape[0],
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    names = ("W_enc", "b_enc", "W_dec", "b_dec")
    transcoders = {f"transformer.h.{layer}.mlp": hookscope.Transcoder(
        **{k: peer[f"tc{layer}.{k}"] for k in names}) for layer in range(n_layer)}
    return model, transcoders, peer


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[hookscope.Graph, dict[str, torch.Tensor]]:
    model, transcoders, peer = rebuild(PEER)
    graph = hookscope.attribution_graph(model, peer["input_ids"], transcoders=transcoders, batch_size=7,
                                        folder=tmp_path_factory.mktemp("graph"))
    return graph, peer


def test_same_active_features_and_logits(built: tuple[hookscope.Graph, dict[str, torch.Tensor]]) -> None:
    graph, peer = built
    assert torch.equal(graph.features, peer["active_features"])          # (layer, pos, feature), same order
    assert torch.equal(peer["selected_features"], torch.arange(len(graph.features)))
    torch.testing.assert_close(graph.activations, peer["activation_values"], rtol=1e-5, atol=1e-5)
    assert torch.equal(graph.logit_ids, peer["logit_ids"])
    torch.testing.assert_close(graph.logit_probabilities, peer["logit_probabilities"], rtol=1e-5, atol=1e-6)
    assert (graph.features[:, 1] > 0).all()                               # position 0 zeroed


def test_edges_equal_circuit_tracers(built: tuple[hookscope.Graph, dict[str, torch.Tensor]]) -> None:
    graph, peer = built
    ours = torch.from_numpy(np.array(graph.adjacency))
    assert ours.shape == peer["adjacency"].shape == (len(graph.nodes),) * 2
    scale = float(peer["adjacency"].abs().max())
    assert scale > 1 and int((peer["adjacency"] != 0).sum()) > 1000      # a graph with edges to compare
    torch.testing.assert_close(ours, peer["adjacency"], rtol=0, atol=1e-5 * scale)
    assert graph.folder.joinpath("adjacency.npy").is_file()               # the rows went to disk


def test_same_pruned_graph(built: tuple[hookscope.Graph, dict[str, torch.Tensor]]) -> None:
    graph, peer = built
    pruned = prune(graph, 0.8, 0.98, chunk_rows=5)                        # chunked reads: same result
    assert torch.equal(pruned.node_mask, peer["prune_node_mask"].bool())
    assert torch.equal(pruned.edge_mask, peer["prune_edge_mask"].bool())
    torch.testing.assert_close(pruned.cumulative_scores, peer["prune_scores"], rtol=1e-5, atol=1e-6)
    assert 0 < int(pruned.node_mask.sum()) < len(graph.nodes)


def test_viewer_json_equals_circuit_tracers(built: tuple[hookscope.Graph, dict[str, torch.Tensor]],
                                            tmp_path: Path) -> None:
    graph, _ = built
    theirs = json.loads(BENCH.joinpath("circuit_tracer_graph.json").read_text())
    path = graph.to_json(tmp_path / "graph.json", slug="tiny", scan="tiny", decode=lambda t: f"t{t}",
                         prompt=theirs["metadata"]["prompt"])
    ours = json.loads(path.read_text())
    assert ours["metadata"] == theirs["metadata"] and ours["qParams"] == theirs["qParams"]
    by_id = {n["node_id"]: n for n in theirs["nodes"]}
    assert [n["node_id"] for n in ours["nodes"]] == list(by_id)
    for node in ours["nodes"]:
        other = by_id[node["node_id"]]
        floats = ("influence", "activation", "token_prob")
        assert {k: v for k, v in node.items() if k not in floats} == \
            {k: v for k, v in other.items() if k not in floats}
        for key in floats:
            assert (node[key] is None) == (other[key] is None)
            if node[key] is not None:
                assert node[key] == pytest.approx(other[key], rel=1e-4, abs=1e-6)
    assert [(e["source"], e["target"]) for e in ours["links"]] == \
        [(e["source"], e["target"]) for e in theirs["links"]]
    assert [e["weight"] for e in ours["links"]] == pytest.approx([e["weight"] for e in theirs["links"]],
                                                                  rel=1e-4, abs=1e-5)
    assert graph_payload(graph)["metadata"]["prompt_tokens"][0] == "0"   # ids as text without decode


@pytest.mark.skipif(not PEER_PYTHON.exists() or os.environ.get("HOOKSCOPE_SKIP_PEERS") == "1",
                    reason="circuit-tracer's environment (/work/venv-ct) is not on this machine")
def test_live_peer_regenerates_the_same_graph(tmp_path: Path) -> None:
    out = tmp_path / "peer_graph.safetensors"
    subprocess.run([str(PEER_PYTHON), str(BENCH / "circuit_tracer_peer.py"), str(out)], check=True,
                   capture_output=True, env={"PATH": os.environ.get("PATH", "")}, timeout=300)
    model, transcoders, peer = rebuild(out)
    graph = hookscope.attribution_graph(model, peer["input_ids"], transcoders=transcoders,
                                        folder=tmp_path / "graph")
    torch.testing.assert_close(torch.from_numpy(np.array(graph.adjacency)), peer["adjacency"], rtol=0,
                               atol=1e-5 * float(peer["adjacency"].abs().max()))
