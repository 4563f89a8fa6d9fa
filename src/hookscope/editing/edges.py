"""Edge attribution patching: a first-order score for every edge between the attention heads and
MLPs of a transformer, from one clean forward, one corrupted forward and one backward.

Syed, Rager and Conmy, "Attribution Patching Outperforms Automated Circuit Discovery" (2023,
arXiv:2310.10348): an edge ``u -> v`` is upstream node ``u``'s output as downstream node ``v``
reads it through the residual stream. Patching that edge alone (``v`` reads ``u``'s clean
output, every other node and edge stays corrupted) changes the metric by about

    (u_clean - u_corrupted) . d metric / d v_input |corrupted

summed over rows, positions and channels (the node-level estimate of ``attribution_patching``
with the gradient taken at ``v``'s input instead of ``u``'s output). EAP-IG (Hanna, Pezzelle and
Belinkov, "Have Faith in Faithfulness", 2024, arXiv:2403.17806) averages that gradient over
``steps`` inputs on the straight line from the corrupted to the clean input embedding (the
block input, ``resid_pre.0``), at ``alpha = k / steps`` for ``k = 0 … steps - 1`` (so
``steps=1`` is EAP).

The nodes, read from the standard names (``engine.standard_names``):

- upstream: ``input`` (``resid_pre.0``: embeddings), ``a{l}.h{h}`` (head ``h`` of block ``l``:
  its slice of ``attn.z.{l}`` through the output projection) and ``m{l}`` (``mlp_out.{l}``);
- downstream: ``a{l}`` (the input of the norm before block ``l``'s attention: every head of the
  block reads the same one), ``m{l}`` (the norm before the MLP) and ``logits`` (the final norm).

A head's change reaches the residual stream through the output projection, so its score is
``(z_clean - z_corrupted)[head] . (d attn_out / d z)^T g_v`` (one vector-Jacobian product per
block and downstream node, through the projection only). Sequential pre-norm blocks only (GPT-2,
Llama, Gemma, a ``HookedTransformer``): see ``engine.standard_names.branch_norms``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.editing.attribution import _differentiable, _once, _zero_added
from hookscope.editing.edit import edit
from hookscope.editing.sweep import Metric, _forward, _number, _plain, check_metric
from hookscope.engine.checks import check_int, check_model
from hookscope.engine.names import index, one_index_per_call
from hookscope.engine.run import untouched
from hookscope.engine.standard_names import blocks_of, branch_norms, resolve_standard
from hookscope.errors import EditError
from hookscope.record.capture import capture
from hookscope.record.grads import gradient_pass

__all__ = ["Edges", "edge_attribution_patching"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Edges:
    """``edge_attribution_patching``'s result.

    Attributes:
        upstream: the upstream nodes, ``["input", "a0.h0", …, "m0", "a1.h0", …]``.
        downstream: the downstream nodes, ``["a0", "m0", "a1", …, "logits"]``.
        scores: ``(len(upstream), len(downstream))`` float64: the estimated change of the
            metric when that one edge is patched from corrupted to clean; NaN where there is
            no edge (a node never reads one at or after it).
        clean, corrupted: the metric of the clean and the corrupted run.
        steps: the EAP-IG steps (1: EAP).
    """

    upstream: list[str]
    downstream: list[str]
    scores: Tensor
    clean: float
    corrupted: float
    steps: int

    def rows(self) -> list[tuple[str, str, float]]:
        """Every edge ``(upstream, downstream, score)``, largest ``|score|`` first."""
        found = [(u, d, float(self.scores[i, j])) for i, u in enumerate(self.upstream)
                 for j, d in enumerate(self.downstream) if not self.scores[i, j].isnan()]
        return sorted(found, key=lambda row: -abs(row[2]))

    def table(self, k: int = 10) -> str:
        """The top ``k`` edges as aligned text: ``upstream  downstream  score``."""
        lines = [f"{'upstream':10} {'downstream':10} {'score':>10}"]
        lines += [f"{u:10} {d:10} {s:>10.4f}" for u, d, s in self.rows()[:k]]
        return "\n".join(lines)

    def plot(self, out: str | os.PathLike[str], k: int = 20) -> Path:
        """Draw the top ``k`` edges as a PNG, a circuit from ``input`` (bottom) to ``logits``
        (top): block ``l``'s heads side by side on row ``2l`` (their shared input ``a{l}`` just
        below), its MLP on row ``2l + 1``; an arrow per edge, width by ``|score|``, blue
        positive, red negative. Missing parent folders are created. Returns its path.

        Raises:
            MissingExtraError: matplotlib is not installed.
        """
        from hookscope.util.figures import new_figure, save_figure
        figure = new_figure("Edges.plot")
        ax = figure.subplots()
        heads = sum(1 for n in self.upstream if n.startswith("a0."))
        layers = (len(self.downstream) - 1) // 2
        top = self.rows()[:k]
        largest = max((abs(s) for _, _, s in top), default=1.0) or 1.0
        used: set[str] = set()
        for u, d, s in top:
            source, target = _place(u, heads, layers), _place(d if d[0] != "a" else d + ".in", heads, layers)
            ax.annotate("", target, source, arrowprops={
                "arrowstyle": "-|>", "connectionstyle": "arc3,rad=0.15", "alpha": 0.8,
                "color": "tab:blue" if s > 0 else "tab:red", "linewidth": 0.5 + 4 * abs(s) / largest})
            used |= {u, d if d[0] != "a" else d + ".in"}
        for node in used:
            ax.annotate(node, _place(node, heads, layers), fontsize=8, ha="center", va="center",
                        bbox={"boxstyle": "round", "fc": "white", "ec": "grey"})
        ax.set_xlim(-1, heads)
        ax.set_ylim(-1.6, 2 * layers + 0.4)
        method = f"EAP-IG, {self.steps} steps" if self.steps > 1 else "EAP"
        ax.set_title(f"top {len(top)} edges ({method}); metric clean {self.clean:.3f}, "
                     f"corrupted {self.corrupted:.3f}")
        ax.axis("off")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        return save_figure(figure, Path(out))


@dataclass(frozen=True)
class _Graph:
    """The standard names and norms of a model's nodes."""

    layers: int
    input_key: str                 # resid_pre.0
    z_keys: list[str]              # attn.z.{l}
    norms: list[str]               # a0, m0, a1, m1, …, logits: the norms whose input they read


@one_index_per_call
def edge_attribution_patching(model: nn.Module, clean: Any, corrupted: Any, metric: Metric, *,
                              steps: int = 1, plot: str | os.PathLike[str] | None = None) -> Edges:
    """Score every edge between heads and MLPs (EAP, Syed et al. 2023; EAP-IG with ``steps``,
    Hanna et al. 2024; see the module docstring).

    ::

        edges = hookscope.edge_attribution_patching(gpt2, clean_ids, corrupt_ids, logit_diff, steps=5)
        print(edges.table(10))          # the 10 edges that matter most

    The model is left as it was found (``engine.run.untouched``); no parameter's ``.grad``
    changes. Call ``model.eval()`` first.

    Args:
        model: a transformer with sequential pre-norm blocks whose standard names ``resid_pre.0``,
            ``attn.z.{l}``, ``attn_out.{l}``, ``mlp_out.{l}`` and ``final_norm`` resolve
            (GPT-2, Llama, Gemma, a TransformerLens ``HookedTransformer``).
        clean, corrupted: model inputs of the same shape (tensor, dict, tuple).
        metric: ``metric(output) -> Tensor`` of one element, differentiable (a logit
            difference, ``.mean()`` over the batch).
        steps: EAP-IG's interpolation steps; 1 (default) is EAP: one clean forward, one
            corrupted forward with its backward. Each step is one forward and backward.
        plot: write ``Edges.plot``'s PNG there.

    Returns:
        An ``Edges``: ``scores`` ``(upstream, downstream)`` float64, ``rows()``, ``table()``.

    Raises:
        SelectorError: a standard name does not resolve, or the blocks are not sequential
            pre-norm blocks (``branch_norms``).
        ArgumentTypeError, ArgumentValueError: ``steps`` not an int >= 1; ``metric`` not callable.
        EditError: ``metric`` does not return one differentiable number; a node runs more than
            once; the two inputs give activations of different shapes.
    """
    check_model(model)
    check_int("steps", steps, minimum=1)
    check_metric(metric)
    graph = _graph(model)
    clean, corrupted = _plain(clean), _plain(corrupted)
    upstream_names = [graph.input_key, *graph.z_keys,
                      *(f"mlp_out.{layer}" for layer in range(graph.layers))]
    with untouched(model):
        with torch.no_grad(), capture(model, *upstream_names, on_unfired="error") as acts:
            clean_metric = _number(metric(_forward(model, clean)))
        clean_acts = {name: acts[name] for name in upstream_names}
        heads_axis = acts.layout(graph.z_keys[0]).heads
        # step 0 is the corrupted run itself (alpha = 0): its values give the differences
        first = _gradients(model, corrupted, metric, graph, None, upstream_names)
        delta = {name: _difference(clean_acts[name], first.acts[name], name)
                 for name in upstream_names}
        grads, heads = first.grads, first.heads
        for k in range(1, steps):  # EAP-IG: alpha = k / steps along corrupted -> clean
            replaced = first.acts[graph.input_key] + k / steps * delta[graph.input_key].to(
                first.acts[graph.input_key].device)
            step = _gradients(model, corrupted, metric, graph, replaced, [])
            grads = [a + b for a, b in zip(grads, step.grads, strict=True)]
            heads = [[a + b for a, b in zip(x, y, strict=True)]
                     for x, y in zip(heads, step.heads, strict=True)]
    assert heads_axis is not None  # attn.z is a heads value (the layout table)
    edges = _scores(graph, delta, [g / steps for g in grads],
                    [[h / steps for h in row] for row in heads], heads_axis, clean_metric,
                    first.metric, steps)
    if plot is not None:
        edges.plot(plot)
    return edges


def _graph(model: nn.Module) -> _Graph:
    names = index(model)
    structure = blocks_of(names, "edge_attribution_patching")
    norms = [path for i in range(structure.count) for path in branch_norms(names, i, structure)]
    ((_, final, _, _),) = resolve_standard(names, "final_norm")
    z_keys = [f"attn.z.{layer}" for layer in range(structure.count)]
    return _Graph(structure.count, "resid_pre.0", z_keys, [*norms, final])


def _difference(clean: Any, corrupted: Any, name: str) -> Tensor:
    if not isinstance(clean, Tensor) or not isinstance(corrupted, Tensor) or clean.shape != corrupted.shape:
        shapes = [tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for v in (clean, corrupted)]
        raise EditError(f"'{name}' gives {shapes[0]} on the clean input and {shapes[1]} on the "
                        f"corrupted one; edge attribution compares them position by position: "
                        f"give two inputs of the same shape (pad the shorter, with its mask)")
    return clean.double().cpu() - corrupted.double().cpu()


@dataclass(frozen=True)
class _Step:
    """One forward and backward: ``grads[v]``, d metric / d downstream node ``v``'s input
    ``(batch, seq, d_model)``; ``heads[l][j]``, ``grads[2l + 1 + j]`` pulled back through block
    ``l``'s output projection to ``attn.z.{l}`` (the nodes after its attention); the metric and
    the values recorded (float64, CPU)."""

    grads: list[Tensor]
    heads: list[list[Tensor]]
    metric: float
    acts: dict[str, Tensor]


def _gradients(model: nn.Module, inputs: Any, metric: Metric, graph: _Graph,
               replaced: Tensor | None, record: list[str]) -> _Step:
    """One forward and backward of ``inputs`` (block input replaced by ``replaced`` when
    given), recording the values of ``record``."""
    norm_found: dict[str, list[tuple[Tensor, Tensor]]] = {path: [] for path in graph.norms}
    z_found: dict[str, list[tuple[Tensor, Tensor]]] = {key: [] for key in graph.z_keys}
    attn_out: dict[str, list[Tensor]] = {f"attn_out.{layer}": [] for layer in range(graph.layers)}
    outputs: dict[str, Callable[[Any], Any]] = {key: _zero_added(z_found[key], key) for key in graph.z_keys}
    outputs |= {key: _kept(found) for key, found in attn_out.items()}
    if replaced is not None:
        outputs[graph.input_key] = lambda value: replaced.to(value.dtype)
    recording = capture(model, *record, on_unfired="error") if record else contextlib.nullcontext()
    with gradient_pass(model, EditError):
        with edit(model, {p: _input_zero_added(norm_found[p], p) for p in graph.norms},
                  inputs=True, on_unfired="error"), edit(model, outputs, on_unfired="error"), \
                recording as acts:
            value = _differentiable(metric(_forward(model, inputs)))
        zeros = [_once(norm_found[p], p)[1] for p in graph.norms]
        found = torch.autograd.grad(value, zeros, retain_graph=True, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(z) for g, z in zip(found, zeros, strict=True)]
        heads = []
        for layer in range(graph.layers):
            if len(attn_out[f"attn_out.{layer}"]) != 1:
                raise EditError(f"'attn_out.{layer}' ran {len(attn_out[f'attn_out.{layer}'])} "
                                f"times in one forward pass; edge attribution reads blocks that "
                                f"run once")
            out = attn_out[f"attn_out.{layer}"][0]
            z_zero = _once(z_found[graph.z_keys[layer]], graph.z_keys[layer])[1]
            heads.append([torch.autograd.grad(out, z_zero, grad_outputs=g, retain_graph=True)[0]
                          .double().cpu() for g in grads[2 * layer + 1:]])
    return _Step([g.detach().double().cpu() for g in grads], heads, _number(value),
                 {name: acts[name] for name in record} if acts is not None else {})


def _kept(found: list[Tensor]) -> Callable[[Any], Any]:
    def fn(value: Any) -> Any:
        found.append(value)
        return value
    return fn


def _input_zero_added(found: list[tuple[Tensor, Tensor]], path: str) -> Callable[..., Any]:
    """The input edit: the norm's first argument plus a zero that requires grad."""
    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not args or not isinstance(args[0], Tensor):
            raise EditError(f"'{path}' was called without its input as the first positional "
                            f"argument; edge attribution reads a norm called as norm(x)")
        zero = torch.zeros_like(args[0], requires_grad=True)
        found.append((args[0].detach(), zero))
        return (args[0] + zero, *args[1:]), kwargs
    return fn


def _scores(graph: _Graph, delta: dict[str, Tensor], grads: list[Tensor], heads: list[list[Tensor]],
            heads_axis: int, clean: float, corrupted: float, steps: int) -> Edges:
    count = delta[graph.z_keys[0]].shape[heads_axis]
    downstream = [f"{kind}{layer}" for layer in range(graph.layers) for kind in ("a", "m")] + ["logits"]
    upstream = ["input"]
    rows: list[Tensor] = [torch.stack([(delta[graph.input_key] * g).sum() for g in grads])]
    for layer in range(graph.layers):
        z = delta[graph.z_keys[layer]].movedim(heads_axis, 1).flatten(2)  # (batch, heads, rest)
        first = 2 * layer + 1  # a head feeds its own block's MLP and everything after
        for h in range(count):
            upstream.append(f"a{layer}.h{h}")
            scores = [(z[:, h] * v.movedim(heads_axis, 1).flatten(2)[:, h]).sum() for v in heads[layer]]
            rows.append(torch.cat([torch.full((first,), torch.nan, dtype=torch.float64),
                                   torch.stack(scores)]))
        upstream.append(f"m{layer}")
        mlp = delta[f"mlp_out.{layer}"]
        rows.append(torch.cat([torch.full((first + 1,), torch.nan, dtype=torch.float64),
                               torch.stack([(mlp * g).sum() for g in grads[first + 1:]])]))
    return Edges(upstream, downstream, torch.stack(rows).cpu(), clean, corrupted, steps)


def _place(node: str, heads: int, layers: int) -> tuple[float, float]:
    """Where a node is drawn (``Edges.plot``): head ``h`` of block ``l`` at ``(h, 2l)``, the
    attention's input ``a{l}.in`` below the heads' middle, MLP ``l`` at ``(middle, 2l + 1)``."""
    middle = (heads - 1) / 2
    if node in ("input", "logits"):
        return middle, -1.2 if node == "input" else 2 * layers
    layer, _, rest = node[1:].partition(".")
    if node[0] == "m":
        return middle, 2 * int(layer) + 1
    if rest == "in":
        return middle, 2 * int(layer) - 0.45
    return float(rest[1:]), 2 * int(layer)
