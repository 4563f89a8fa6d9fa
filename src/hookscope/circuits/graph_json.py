"""Circuit-tracer's graph JSON (``create_graph_files``), which Neuronpedia's attribution-graph
viewer (and circuit-tracer's local server) reads: ``metadata``, ``qParams``, ``nodes`` and
``links`` of the pruned graph, node ids as circuit-tracer writes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookscope.circuits.pruning import prune
from hookscope.util import write_atomic, write_bytes

if TYPE_CHECKING:
    from hookscope.circuits.graph import Graph

__all__ = ["graph_payload", "write_graph_json"]


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def _node(graph: Graph, index: int, influence: float, decode: Callable[[int], str]) -> dict[str, Any]:
    n_features, n_pos, n_layers = graph.n_features, graph.n_pos, graph.n_layers
    errors_end = n_features + n_layers * n_pos
    base: dict[str, Any] = {"token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
                            "reverse_ctx_idx": 0, "clerp": "", "influence": influence,
                            "activation": None}
    if index < n_features:
        layer, pos, feature = (int(v) for v in graph.features[index])
        return {**base, "node_id": f"{layer}_{feature}_{pos}", "feature": _cantor(layer, feature),
                "layer": str(layer), "ctx_idx": pos, "feature_type": "cross layer transcoder",
                "jsNodeId": f"{layer}_{feature}-0", "activation": float(graph.activations[index])}
    if index < errors_end:
        layer, pos = divmod(index - n_features, n_pos)
        return {**base, "node_id": f"0_{layer}_{pos}", "feature": -1, "layer": str(layer),
                "ctx_idx": pos, "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_{pos}-0"}
    if index < errors_end + n_pos:
        pos = index - errors_end
        token = int(graph.input_ids[pos])
        return {**base, "node_id": f"E_{token}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos,
                "feature_type": "embedding", "jsNodeId": f"E_{token}-{pos}"}
    k = index - errors_end - n_pos
    token, prob, logit_layer = int(graph.logit_ids[k]), float(graph.logit_probabilities[k]), str(n_layers + 1)
    return {**base, "node_id": f"{logit_layer}_{token}_{n_pos - 1}", "feature": token, "layer": logit_layer,
            "ctx_idx": n_pos - 1, "feature_type": "logit", "token_prob": prob, "is_target_logit": k == 0,
            "jsNodeId": f"L_{token}-{n_pos - 1}", "clerp": f'Output "{decode(token)}" (p={prob:.3f})',
            "influence": None}


def graph_payload(graph: Graph, *, slug: str = "graph", scan: str = "hookscope",
                  node_threshold: float = 0.8, edge_threshold: float = 0.98,
                  decode: Callable[[int], str] | None = None, prompt: str | None = None) -> dict[str, Any]:
    """The JSON object circuit-tracer's ``create_graph_files(graph, slug, ..., scan,
    node_threshold, edge_threshold)`` writes, for ``graph`` pruned with the same thresholds.

    Args:
        decode: token id -> text (``lambda t: tokenizer.decode([t])``); ids as text when None.
        prompt: the prompt's text for ``metadata.prompt`` (the tokens joined when None).
    """
    decode = decode or str
    pruned = prune(graph, node_threshold, edge_threshold)
    nodes = {int(i): _node(graph, int(i), float(pruned.cumulative_scores[int(i)]), decode)
             for i in pruned.node_mask.nonzero().flatten().tolist()}
    kept = pruned.kept.tolist()
    targets, sources = pruned.kept_edges.nonzero(as_tuple=True)
    links = []
    for t, s in zip(targets.tolist(), sources.tolist()):
        target, source = kept[t], kept[s]
        if source in nodes and target in nodes:
            links.append({"source": nodes[source]["node_id"], "target": nodes[target]["node_id"],
                          "weight": float(graph.adjacency[target, source])})
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    used = [node for node in nodes.values()
            if node["node_id"] in connected or node["feature_type"] in ("embedding", "logit")]
    tokens = [decode(int(t)) for t in graph.input_ids]
    metadata = {"slug": slug, "scan": scan, "transcoder_list": [], "prompt_tokens": tokens,
                "prompt": "".join(tokens) if prompt is None else prompt,
                "node_threshold": node_threshold, "schema_version": 1}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": used, "links": links}


def write_graph_json(graph: Graph, path: str | Path, **options: Any) -> Path:
    """Write ``graph_payload(graph, **options)`` to ``path`` (atomically) and return the path."""
    path = Path(path)
    data = json.dumps(graph_payload(graph, **options), indent=2).encode()
    write_atomic(path, lambda tmp: write_bytes(tmp, data))
    return path
