"""Pruning an attribution graph by influence on the logits, circuit-tracer's ``prune_graph``
(Ameisen et al., 2025, methods, "Graph pruning"), read in row chunks so that the dense
adjacency is never held whole.

A node's influence is its total (all paths) weight into the logits in the row-normalized
``|adjacency|``, the logits weighted by their probabilities: ``w @ (B + B^2 + ...)``, summed
until no path is left (the graph is acyclic). Nodes are kept, most influential first, until they
hold ``node_threshold`` of the total; edges among them likewise with ``edge_threshold``, each edge
scored by its normalized weight times its target's influence (logit weight included); then
features and errors without an outgoing kept edge, and features without an incoming one, are
dropped until nothing changes. Tokens and logits are always kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hookscope.errors import CircuitError

if TYPE_CHECKING:
    from hookscope.circuits.graph import Graph

__all__ = ["Pruned", "node_influence", "prune"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Pruned:
    """``node_mask`` ``(n_nodes,)`` bool; ``cumulative_scores`` ``(n_nodes,)``: the share of total
    influence held by the nodes at least as influential as each (what the viewer shows as a
    node's influence); ``kept`` ``(k,)`` the nodes that passed the influence threshold and
    ``kept_edges`` ``(k, k)`` bool ``[target, source]`` the edges kept among them."""

    node_mask: Tensor
    cumulative_scores: Tensor
    kept: Tensor
    kept_edges: Tensor

    @property
    def edge_mask(self) -> Tensor:
        """``(n_nodes, n_nodes)`` bool ``[target, source]`` (dense: for small graphs)."""
        n = len(self.node_mask)
        mask = torch.zeros((n, n), dtype=torch.bool)
        mask[self.kept[:, None], self.kept[None, :]] = self.kept_edges
        return mask


def _row_sums(adjacency: np.ndarray, chunk_rows: int) -> Tensor:
    sums = [torch.from_numpy(np.abs(adjacency[r:r + chunk_rows])).sum(1)
            for r in range(0, adjacency.shape[0], chunk_rows)]
    return torch.cat(sums).clamp(min=1e-10)


def node_influence(adjacency: np.ndarray, logit_weights: Tensor, *, chunk_rows: int = 4096,
                   max_iter: int = 1000) -> Tensor:
    """``w @ (B + B^2 + ...)`` for ``B`` the row-normalized ``|adjacency|`` ``(n, n)``, reading
    ``chunk_rows`` rows at a time (only rows whose weight is non-zero).

    Raises:
        CircuitError: paths remain after ``max_iter`` products (the graph has a cycle).
    """
    sums = _row_sums(adjacency, chunk_rows)
    current, total = logit_weights.float(), torch.zeros(adjacency.shape[1])
    for _ in range(max_iter):
        current = _times(adjacency, current, sums, chunk_rows)
        if not current.any():
            return total
        total += current
    raise CircuitError(f"node influence did not converge after {max_iter} products: an attribution "
                       f"graph is acyclic, so this adjacency is not one")


def _times(adjacency: np.ndarray, vector: Tensor, sums: Tensor, chunk_rows: int) -> Tensor:
    out = torch.zeros(adjacency.shape[1])
    rows = torch.nonzero(vector).flatten()
    for start in range(0, len(rows), chunk_rows):
        chunk = rows[start:start + chunk_rows].numpy()
        block = torch.from_numpy(np.abs(adjacency[chunk]))          # (chunk, n)
        out += (vector[chunk] / sums[chunk]) @ block
    return out


def _threshold(scores: Tensor, threshold: float) -> Tensor:
    """The score above which the top scores hold ``threshold`` of the total (circuit-tracer's
    ``find_threshold``)."""
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, 0) / ordered.sum()
    index = min(int(torch.searchsorted(cumulative, threshold)), len(cumulative) - 1)
    return ordered[index]


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98, *,
          chunk_rows: int = 4096) -> Pruned:
    """Prune ``graph`` as circuit-tracer's ``prune_graph(graph, node_threshold, edge_threshold)``.

    Memory: the node influences read the adjacency in ``chunk_rows`` rows; the edge step holds
    the square of the kept nodes only.

    Raises:
        CircuitError: a threshold outside [0, 1].
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise CircuitError(f"{name}={value!r:.20} is a share of total influence, in [0, 1]")
    adjacency, n = graph.adjacency, graph.adjacency.shape[0]
    n_logits, n_tokens, n_features = len(graph.logit_ids), graph.n_pos, graph.n_features
    weights = torch.zeros(n)
    weights[n - n_logits:] = graph.logit_probabilities.float()
    influence = node_influence(adjacency, weights, chunk_rows=chunk_rows)
    node_mask = influence >= _threshold(influence, node_threshold)
    node_mask[n - n_logits - n_tokens:] = True
    kept = torch.nonzero(node_mask).flatten()
    sub = torch.from_numpy(np.asarray(adjacency[np.ix_(kept.numpy(), kept.numpy())]))
    normalized = sub.abs() / sub.abs().sum(1, keepdim=True).clamp(min=1e-10)
    sub_weights = weights[kept]
    sub_influence = sub_weights @ normalized
    current = sub_influence
    while current.any():
        current = current @ normalized
        sub_influence = sub_influence + current
    scores = normalized * (sub_influence + sub_weights)[:, None]
    sub_edges = scores >= _threshold(scores.flatten(), edge_threshold)
    node_mask = _drop_dangling(node_mask, kept, sub_edges, n - n_logits - n_tokens, n_features)
    sub_edges &= node_mask[kept][:, None] & node_mask[kept][None, :]
    ordered, order = torch.sort(influence, descending=True)
    cumulative = torch.zeros_like(influence)
    cumulative[order] = torch.cumsum(ordered, 0) / ordered.sum()
    return Pruned(node_mask, cumulative, kept, sub_edges)


def _drop_dangling(node_mask: Tensor, kept: Tensor, sub_edges: Tensor, n_inner: int,
                   n_features: int) -> Tensor:
    """Drop features and errors without a kept outgoing edge, and features without a kept
    incoming one, until nothing changes (circuit-tracer's loop, on the kept nodes)."""
    node_mask = node_mask.clone()
    inner = kept < n_inner              # features and errors among the kept
    features = kept < n_features
    while True:
        before = node_mask.clone()
        live = node_mask[kept]
        sub_edges &= live[:, None] & live[None, :]
        node_mask[kept[inner]] &= sub_edges[:, inner].any(0)
        node_mask[kept[features]] &= sub_edges[features].any(1)
        if torch.equal(before, node_mask):
            return node_mask
