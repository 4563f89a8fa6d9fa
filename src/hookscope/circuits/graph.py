"""Attribution graphs (Ameisen et al., 2025, "Circuit Tracing"; circuit-tracer's ``attribute``):
the direct linear effects between a prompt's active transcoder features, the transcoders' error
nodes, its token embeddings and its top logits, in the local replacement model
(``replacement.linearize``), written row by row to a file so that memory holds only the rows
of one batch of targets.

Conventions, as circuit-tracer's: nodes are ordered ``[features, errors (layer-major, then
position), tokens, logits]``; ``adjacency[target, source]``; an edge is the source's
contribution to the target's pre-activation (a feature: ``activation * W_dec[f] . grad``; an
error: ``error . grad``; a token: ``embedding . grad``, where ``grad`` is the gradient of the
target at the residual stream the source writes); a logit target is the unembedding row minus
the mean row, at the last position; biases (and position embeddings) are not nodes; features
and errors at position 0 are zeroed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope.circuits.replacement import Linearized, linearize
from hookscope.circuits.transcoder import Transcoder
from hookscope.circuits.view import frozen_view
from hookscope.engine import check_model
from hookscope.errors import CircuitError

__all__ = ["Graph", "attribution_graph"]

Tensor = torch.Tensor
_CHUNK = 4096  # feature sources contracted at once: (batch, _CHUNK, d_model) floats


@dataclass
class Graph:
    """An attribution graph; ``attribution_graph`` builds it.

    Attributes:
        input_ids: ``(seq,)`` int64, the prompt.
        features: ``(n_features, 3)`` int64 ``(layer, position, feature)``, in that sort order.
        activations: ``(n_features,)`` float32 activation of each.
        logit_ids: ``(n_logits,)`` int64, the target tokens, most probable first.
        logit_probabilities: ``(n_logits,)`` float32.
        adjacency: ``(n_nodes, n_nodes)`` float32 ``[target, source]``, ``folder/adjacency.npy``
            memory-mapped read-only (rows of errors and tokens are zero).
        n_layers: transcoded layers; ``layer_paths`` their MLP paths.
        folder: where the adjacency lives.
    """

    input_ids: Tensor
    features: Tensor
    activations: Tensor
    logit_ids: Tensor
    logit_probabilities: Tensor
    adjacency: np.ndarray
    n_layers: int
    layer_paths: list[str]
    folder: Path

    @property
    def n_pos(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_features(self) -> int:
        return int(self.features.shape[0])

    @property
    def nodes(self) -> list[tuple[str, int, int, int]]:
        """One ``(kind, layer, position, index)`` per node, in adjacency order: ``("feature",
        layer, pos, feature)``, ``("error", layer, pos, -1)``, ``("token", -1, pos, token id)``,
        ``("logit", n_layers, seq - 1, token id)``."""
        rows: list[tuple[str, int, int, int]] = [("feature", int(l_), int(p), int(f))
                                                 for l_, p, f in self.features.tolist()]
        rows += [("error", layer, pos, -1) for layer in range(self.n_layers) for pos in range(self.n_pos)]
        rows += [("token", -1, pos, int(t)) for pos, t in enumerate(self.input_ids.tolist())]
        rows += [("logit", self.n_layers, self.n_pos - 1, int(t)) for t in self.logit_ids.tolist()]
        return rows

    def to_json(self, path: str | Path, **options: Any) -> Path:
        """Write the pruned graph in circuit-tracer's graph JSON (Neuronpedia's viewer); see
        ``graph_json.write_graph_json`` for ``options``."""
        from hookscope.circuits.graph_json import write_graph_json

        return Path(write_graph_json(self, path, **options))


def _layer_order(model: nn.Module, transcoders: Mapping[str, Transcoder]) -> list[str]:
    order = [path for path, _ in model.named_modules() if path in transcoders]
    unknown = sorted(set(transcoders) - set(order))
    if unknown:
        raise CircuitError(f"transcoders name {unknown} which are not module paths of the model: "
                           f"give the MLPs' exact paths, e.g. 'transformer.h.0.mlp'")
    for path in order:
        if not isinstance(transcoders[path], Transcoder):
            raise CircuitError(f"transcoders[{path!r}] is {type(transcoders[path]).__name__}, not a "
                               f"Transcoder: build one with hookscope.Transcoder(W_enc=..., ...)")
    return order


def _path_of(model: nn.Module, module: nn.Module | None, what: str) -> str:
    for path, m in model.named_modules():
        if m is module and module is not None:
            return str(path)
    raise CircuitError(f"the model has no {what} module (get_input_embeddings / "
                       f"get_output_embeddings): attribution graphs read transformers' language "
                       f"models with an embedding and an unembedding module")


def _as_ids(inputs: Any) -> Tensor:
    ids = inputs["input_ids"] if isinstance(inputs, Mapping) else inputs
    ids = torch.as_tensor(ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or len(ids) < 2:
        raise CircuitError(f"inputs are one prompt of token ids, (seq,) or (1, seq) int64 with seq "
                           f">= 2, not {tuple(ids.shape)} {ids.dtype}: pass "
                           f"tokenizer(text, return_tensors='pt')['input_ids']")
    return ids.long()


def _top_logits(logits: Tensor, max_n_logits: int, desired_logit_prob: float) -> tuple[Tensor, Tensor]:
    """circuit-tracer's choice: the most probable tokens until their total reaches
    ``desired_logit_prob``, at most ``max_n_logits``."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_idx = torch.topk(probs, min(max_n_logits, probs.shape[-1]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), desired_logit_prob)) + 1
    return top_idx[:cutoff], top_p[:cutoff]


def attribution_graph(model: nn.Module, inputs: Any, *, transcoders: Mapping[str, Transcoder],
                      max_n_logits: int = 10, desired_logit_prob: float = 0.95, batch_size: int = 64,
                      folder: str | Path | None = None) -> Graph:
    """Build the attribution graph of one prompt over per-layer transcoders.

    ```python
    graph = hookscope.attribution_graph(model, ids, transcoders={f"transformer.h.{i}.mlp": tc[i]
                                                                 for i in range(n_layers)})
    graph.adjacency[target, source]; graph.nodes; graph.to_json("graph.json")
    ```

    The algorithm is circuit-tracer's ``attribute`` (every active feature gets a row; its
    ``max_feature_nodes`` ordering by partial influence is not done). Gradients run once per
    batch of ``batch_size`` targets, batched over the targets (``is_grads_batched``) on one
    forward, so memory holds one forward and ``batch_size`` gradients, plus the frozen attention
    patterns that the batched backward copies per target (about ``batch_size x layers x heads x
    seq^2 x 4`` bytes: lower ``batch_size`` for long prompts); each batch's rows go to
    ``folder/adjacency.npy`` as they are computed (written in place, not held). The forward
    runs on the model's frozen view (``circuits.view``: its modules in eval mode, weights
    without gradients, eager attention), so the model itself is never changed: its config,
    training flags, parameters' ``requires_grad`` and hook tables stay as they are, also for
    other threads using it meanwhile.

    Args:
        model: a transformers causal language model (its view runs eager attention, whatever
            the model's; LayerNorm or RMSNorm norms).
        inputs: token ids ``(seq,)`` or ``(1, seq)`` (or a dict with ``input_ids``).
        transcoders: ``{MLP path: Transcoder}``, one per MLP (an MLP without a transcoder is
            not cut from the gradient).
        max_n_logits, desired_logit_prob: logit targets, as circuit-tracer chooses them.
        batch_size: targets per backward pass.
        folder: where to write ``adjacency.npy`` (``n_nodes^2 x 4`` bytes on disk); a new
            temporary folder when None, left for the graph to read (delete it when done).

    Returns:
        A ``Graph``.

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Module``.
        CircuitError: inputs that are not one prompt of ids, a transcoder path that is not a
            module, a ``batch_size`` that is not a positive int, a model without embedding
            modules, without attention patterns to freeze or with other norms.
    """
    check_model(model)
    if type(batch_size) is not int or batch_size < 1:
        raise CircuitError(f"batch_size must be a positive int (targets per backward pass), not "
                           f"{batch_size!r:.20}")
    ids = _as_ids(inputs)
    paths = _layer_order(model, transcoders)
    embed_path = _path_of(model, _embedding(model, "get_input_embeddings"), "input embedding")
    unembed = _embedding(model, "get_output_embeddings")
    unembed_path = _path_of(model, unembed, "output embedding")
    assert unembed is not None
    ids = ids.to(next(model.parameters()).device)
    # eval mode (no dropout), no weight gradients, eager attention: on a view, not the model
    run = linearize(frozen_view(model), ids[None], paths, embed_path, unembed_path)
    return _build(run, ids, [transcoders[p] for p in paths], paths, unembed.weight,
                  max_n_logits, desired_logit_prob, batch_size, folder)


def _embedding(model: nn.Module, getter: str) -> Any:
    """``model.get_input_embeddings()`` (or output), None for a model without the method."""
    method = getattr(model, getter, None)
    return method() if callable(method) else None


def _build(run: Linearized, ids: Tensor, tcs: list[Transcoder], paths: list[str], w_u: Tensor,
           max_n_logits: int, desired_logit_prob: float, batch_size: int,
           folder: str | Path | None) -> Graph:
    n_pos, n_layers = len(ids), len(tcs)
    feats, acts, enc, dec, errors = _features(run, tcs)
    assert run.logits is not None
    logit_ids, logit_p = _top_logits(run.logits[-1], max_n_logits, desired_logit_prob)
    w = w_u.detach().float()
    logit_vecs = w[logit_ids] - w.mean(0, keepdim=True)   # (n_logits, d_model)
    n_feat, n_logits = len(feats), len(logit_ids)
    n_nodes = n_feat + (n_layers + 1) * n_pos + n_logits
    folder = Path(tempfile.mkdtemp(prefix="hookscope-graph-") if folder is None else folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "adjacency.npy"
    sources = _Sources(run, feats, dec, errors)
    targets = [(n_layers, n_pos - 1, logit_vecs[i], n_nodes - n_logits + i) for i in range(n_logits)]
    targets += [(int(feats[i, 0]), int(feats[i, 1]), enc[i], i) for i in range(n_feat)]
    with _RowWriter(path, n_nodes) as writer:
        for start in range(0, len(targets), batch_size):
            batch = targets[start:start + batch_size]
            rows = sources.rows(batch, n_pos).numpy()     # (batch, n_nodes - n_logits)
            for (_, _, _, node), row in zip(batch, rows):
                writer.write(node, row)
    adjacency = np.load(path, mmap_mode="r")
    return Graph(input_ids=ids.cpu(), features=feats, activations=acts, logit_ids=logit_ids.cpu(),
                 logit_probabilities=logit_p.cpu(), adjacency=adjacency, n_layers=n_layers,
                 layer_paths=paths, folder=folder)


class _RowWriter:
    """Write rows of an ``(n, n)`` float32 ``.npy`` file in place (``os.pwrite``, not a writable
    memory map: written rows leave memory, rather than staying as the process's dirty pages)."""

    def __init__(self, path: Path, n: int):
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (n, n)})
            self.offset = f.tell()
            f.truncate(self.offset + 4 * n * n)            # a sparse file: unwritten rows read as 0
        self.n, self.fd = n, os.open(path, os.O_WRONLY)

    def __enter__(self) -> _RowWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync(self.fd)
        os.close(self.fd)

    def write(self, node: int, row: np.ndarray) -> None:
        data = np.ascontiguousarray(row, dtype="<f4").tobytes()
        written = os.pwrite(self.fd, data, self.offset + 4 * self.n * node)
        if written != len(data):
            raise OSError(f"short write of adjacency row {node}: {written} of {len(data)} bytes")


def _features(run: Linearized,
              tcs: list[Transcoder]) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]:
    """Active features ``(n, 3)`` sorted by (layer, position, feature), their activations,
    encoder vectors ``(n, d_in)``, per-layer decoder vectors scaled by activation, and per-layer
    error vectors ``(seq, d_model)`` (output minus reconstruction; position 0 zeroed)."""
    feats, acts, enc, dec, errors = [], [], [], [], []
    with torch.no_grad():
        for layer, tc in enumerate(tcs):
            a = tc.encode(run.mlp_inputs[layer].detach()[0]).float()   # (seq, d_features)
            a[0] = 0
            pos, f = a.nonzero(as_tuple=True)
            values = a[pos, f]
            feats.append(torch.stack([torch.full_like(pos, layer), pos, f], 1))
            acts.append(values)
            enc.append(tc.W_enc.detach().float().T[f])
            dec.append(tc.W_dec.detach().float()[f] * values[:, None])
            reconstruction = a @ tc.W_dec.detach().float() + tc.b_dec.detach().float()
            error = run.mlp_outputs[layer][0].float() - reconstruction
            error[0] = 0
            errors.append(error)
    return torch.cat(feats), torch.cat(acts), torch.cat(enc), dec, errors


class _Sources:
    """Contract a batch of targets' gradients with every source: features (per layer), errors,
    tokens."""

    def __init__(self, run: Linearized, feats: Tensor, dec: list[Tensor], errors: list[Tensor]):
        self.run, self.dec, self.errors = run, dec, errors
        self.layer_pos = [feats[feats[:, 0] == layer, 1] for layer in range(len(dec))]

    def rows(self, batch: list[tuple[int, int, Tensor, int]], n_pos: int) -> Tensor:
        run = self.run
        n_layers = len(self.dec)
        layers = sorted({t[0] for t in batch})
        outputs, grad_outputs = [], []
        for layer in layers:
            point = run.final if layer == n_layers else run.mlp_inputs[layer]
            assert point is not None
            g = torch.zeros((len(batch), *point.shape), dtype=point.dtype, device=point.device)
            for b, (t_layer, pos, vec, _) in enumerate(batch):
                if t_layer == layer:
                    g[b, 0, pos] = vec.to(point.dtype)
            outputs.append(point)
            grad_outputs.append(g)
        assert run.embed is not None
        inputs = [run.embed, *run.mlp_leaves]
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        pieces = []
        for layer in range(n_layers):
            g = grads[1 + layer]
            if g is None:
                pieces += [torch.zeros(len(batch), len(self.dec[layer]))]
                continue
            g = g[:, 0].float()                                   # (batch, seq, d)
            positions, vectors = self.layer_pos[layer], self.dec[layer]
            pieces += [torch.einsum("bnd,nd->bn", g[:, positions[i:i + _CHUNK]], vectors[i:i + _CHUNK])
                       for i in range(0, len(vectors), _CHUNK)] or [torch.zeros(len(batch), 0)]
        for layer in range(n_layers):
            g = grads[1 + layer]
            pieces.append(torch.zeros(len(batch), n_pos) if g is None else
                          torch.einsum("bpd,pd->bp", g[:, 0].float(), self.errors[layer]))
        g = grads[0]
        pieces.append(torch.zeros(len(batch), n_pos) if g is None else
                      torch.einsum("bpd,pd->bp", g[:, 0].float(), run.embed.detach()[0].float()))
        return torch.cat(pieces, 1).cpu()

