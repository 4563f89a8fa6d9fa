"""Edge attribution patching: a first-order score for every edge between the attention heads and
MLPs of a transformer, from one clean forward, one corrupted forward and one backward.

Syed, Rager and Conmy, "Attribution Patching Outperforms Automated Circuit Discovery" (2023,
arXiv:2310.10348): an edge ``u -> v`` is upstream node ``u``'s output as downstream node ``v``
reads it through the residual stream. Patching that edge alone (``v`` reads ``u``'s clean
output, every other node and edge stays corrupted) changes the metric by about

    (u_clean - u_corrupted) . d metric / d v_input |corrupted

summed over the batch's rows, the token positions and the channels (a sum, not a mean;
``per_position=True`` keeps one score per position): the node-level estimate of
``attribution_patching`` with the gradient taken at ``v``'s input instead of ``u``'s output.
EAP-IG (Hanna, Pezzelle and Belinkov, "Have Faith in Faithfulness", 2024, arXiv:2403.17806)
averages that gradient over
``steps`` inputs on the straight line from the corrupted to the clean input embedding (the
block input, ``resid_pre.0``), at ``alpha = k / steps`` for ``k = 1 … steps`` (their eq. for
EAP-IG; ``alpha = 0`` would be the corrupted run, EAP's point).

The nodes, read from the standard names (``engine.standard_names``):

- upstream: ``input`` (``resid_pre.0``: embeddings), ``a{l}.h{h}`` (head ``h`` of block ``l``:
  its slice of ``attn.z.{l}`` through the output projection) and ``m{l}`` (``mlp_out.{l}``);
- downstream: ``a{l}.h{h}.q``, ``.k``, ``.v`` (head ``h``'s query, key and value input: the
  input of the norm before block ``l``'s attention, as only that head's q, k or v reads it;
  under grouped-query attention k and v have the key-value heads), ``m{l}`` (the input of the
  norm before the MLP) and ``logits`` (of the final norm).

A head's change reaches the residual stream through the output projection ``J`` (linear), so
its change there is ``J (z_clean - z_corrupted)[head]`` (taken once, as the gradient of
``J^T u`` with respect to ``u``), and every score is a change times a gradient; a head's q (k, v)
input gradient is ``(d q / d x)^T`` of the gradient at ``attn.q.{l}`` kept on that head only (one
batched vector-Jacobian product per block and letter, through the norm and one projection).
Sequential pre-norm blocks only (GPT-2, Llama, Gemma, a ``HookedTransformer``): see
``engine.standard_names.branch_norms``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookscope.editing.attribution import _differentiable, _once
from hookscope.editing.edits import edit
from hookscope.editing.sweep import Metric, _forward, _number, _plain, check_metric
from hookscope.engine import (
    Tokens,
    blocks_of,
    branch_norms,
    check_flag,
    check_int,
    check_model,
    check_no_unmasked_padding,
    index,
    one_index_per_call,
    resolve_standard,
    untouched,
    warn_if_dropout_trains,
)
from hookscope.errors import EditError
from hookscope.record import capture, gradient_pass

__all__ = ["Edges", "edge_attribution_patching"]

Tensor = torch.Tensor
Found = list[tuple[Tensor, Tensor]]  # (value, the zero added to it) of each call of a node


@dataclass(frozen=True)
class Edges:
    """``edge_attribution_patching``'s result.

    Attributes:
        upstream: the upstream nodes, ``["input", "a0.h0", …, "m0", "a1.h0", …]``.
        downstream: the downstream nodes, ``["a0.h0.q", …, "a0.h0.k", …, "a0.h0.v", …,
            "m0", "a1.h0.q", …, "logits"]``.
        scores: ``(len(upstream), len(downstream))`` float64: the estimated change of the
            metric when that one edge is patched from corrupted to clean at every position of
            every row at once: ``sum over rows b, positions s, channels c of (u_clean -
            u_corrupted)[b, s, c] * (d metric / d v_input)[b, s, c]``, a **sum** over the batch
            and the positions (not a mean: a metric that is a mean over the batch already
            divides by it); NaN where there is no edge (a node never reads one at or after it).
        clean, corrupted: the metric of the clean and the corrupted run.
        steps: the EAP-IG steps (``None``: EAP).
        position_scores: with ``per_position=True``, ``(len(upstream), len(downstream), seq)``
            float64: the same sum over rows and channels only, one score per token position
            (``position_scores.sum(-1)`` is ``scores``, up to float64 rounding); else ``None``.
    """

    upstream: list[str]
    downstream: list[str]
    scores: Tensor
    clean: float
    corrupted: float
    steps: int | None
    position_scores: Tensor | None = None

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
        (top): block ``l``'s heads side by side on row ``2l`` (their q, k, v inputs just
        below), its MLP on row ``2l + 1``; an arrow per edge, width by ``|score|``, blue
        positive, red negative. Missing parent folders are created. Returns its path.

        Raises:
            MissingExtraError: matplotlib is not installed.
        """
        from hookscope.util import new_figure, save_figure
        figure = new_figure("Edges.plot")
        ax = figure.subplots()
        heads = sum(1 for n in self.upstream if n.startswith("a0."))
        layers = sum(1 for n in self.upstream if n.startswith("m"))
        top = self.rows()[:k]
        largest = max((abs(s) for _, _, s in top), default=1.0) or 1.0
        for u, d, s in top:
            ax.annotate("", _place(d, heads, layers), _place(u, heads, layers), arrowprops={
                "arrowstyle": "-|>", "connectionstyle": "arc3,rad=0.15", "alpha": 0.8,
                "color": "tab:blue" if s > 0 else "tab:red", "linewidth": 0.5 + 4 * abs(s) / largest})
        for node in {u for u, _, _ in top} | {d for _, d, _ in top}:
            ax.annotate(node, _place(node, heads, layers), fontsize=7, ha="center", va="center",
                        bbox={"boxstyle": "round", "fc": "white", "ec": "grey"})
        ax.set_xlim(-1, heads)
        ax.set_ylim(-1.6, 2 * layers + 0.4)
        method = "EAP" if self.steps is None else f"EAP-IG, {self.steps} steps"
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
    attention_norms: list[str]     # the norm before block l's attention
    mlp_norms: list[str]           # the norm before block l's MLP
    final_norm: str


@one_index_per_call
def edge_attribution_patching(model: nn.Module, clean: Any, corrupted: Any, metric: Metric, *,
                              steps: int | None = None, per_position: bool = False,
                              plot: str | os.PathLike[str] | None = None) -> Edges:
    """Score every edge between heads and MLPs (EAP, Syed et al. 2023; EAP-IG with ``steps``,
    Hanna et al. 2024; see the module docstring).

    ```python
    edges = hookscope.edge_attribution_patching(gpt2, clean_ids, corrupt_ids, logit_diff, steps=5)
    print(edges.table(10))          # the 10 edges that matter most
    ```

    The model is left as it was found (``engine.run.untouched``); no parameter's ``.grad``
    changes. Call ``model.eval()`` first.

    Args:
        model: a transformer with sequential pre-norm blocks whose standard names ``resid_pre.0``,
            ``attn.z.{l}``, ``attn_out.{l}``, ``mlp_out.{l}`` and ``final_norm`` resolve
            (GPT-2, Llama, Gemma, a TransformerLens ``HookedTransformer``).
        clean, corrupted: model inputs of the same shape (tensor, dict, tuple).
        metric: ``metric(output) -> Tensor`` of one element, differentiable (a logit
            difference, ``.mean()`` over the batch).
        steps: ``None`` (default): EAP, one clean forward and one corrupted forward with its
            backward. An int: EAP-IG with that many interpolation steps (Hanna et al. use 5
            to 30), each one forward and backward, plus the two runs without gradients.
        per_position: also keep each edge's score per token position,
            ``Edges.position_scores`` ``(upstream, downstream, seq)`` float64 (memory: 8 bytes
            times their product; ``scores`` is its sum over the positions).
        plot: write ``Edges.plot``'s PNG there.

    Returns:
        An ``Edges``: ``scores`` ``(upstream, downstream)`` float64, each the sum over the
        batch's rows, the positions and the channels of change times gradient (``Edges``),
        ``rows()``, ``table()``.

    Raises:
        SelectorError: a standard name does not resolve, or the blocks are not sequential
            pre-norm blocks (``branch_norms``).
        ArgumentTypeError, ArgumentValueError: ``steps`` not ``None`` or an int >= 1;
            ``metric`` not callable.
        EditError: ``metric`` does not return one differentiable number, or returns NaN or an
            infinity; a node runs more than once; the two inputs give activations of
            different shapes.
    """
    check_model(model)
    if steps is not None:
        check_int("steps", steps, minimum=1)
    check_metric(metric)
    check_flag("per_position", per_position)
    warn_if_dropout_trains(model, "edge_attribution_patching")
    graph = _graph(model)
    clean, corrupted = _plain(clean), _plain(corrupted)
    upstream_names = [graph.input_key, *graph.z_keys,
                      *(f"mlp_out.{layer}" for layer in range(graph.layers))]
    with untouched(model):
        clean_metric, clean_acts, heads_axis, tokens = _record(model, clean, metric, upstream_names)
        if steps is None:  # EAP: the corrupted run's gradient; its values recorded in that pass
            step = _Pass(graph, clean_acts, heads_axis, tokens=tokens)
            downstream, scores = step.run(model, corrupted, metric, None)
            corrupted_metric = step.metric
        else:  # EAP-IG: the mean over alpha = k / steps, k = 1 … steps, corrupted -> clean
            corrupted_metric, corrupted_acts, _, corrupted_tokens = _record(
                model, corrupted, metric, upstream_names)
            _check_same_tokens(tokens, corrupted_tokens)
            step = _Pass(graph, clean_acts, heads_axis, corrupted_acts)
            start, delta = corrupted_acts[graph.input_key], step.delta[graph.input_key]
            total: Tensor | None = None  # a running sum: one (upstream, downstream, seq) held
            for k in range(1, steps + 1):
                downstream, one = step.run(model, corrupted, metric,
                                           start + k / steps * delta.to(start.device))
                total = one if total is None else total + one
            assert total is not None  # steps >= 1
            scores = total / steps
    for name, value in (("clean", clean_metric), ("corrupted", corrupted_metric)):
        if not math.isfinite(float(value)):
            raise EditError(f"metric is {float(value)} on the {name} input: every edge's score "
                            f"would be NaN or infinite. Return a finite number (a logit "
                            f"difference; check the model's output with hookscope nan)")
    edges = Edges(step.upstream, downstream, scores.sum(-1), clean_metric, corrupted_metric, steps,
                  scores if per_position else None)
    if plot is not None:
        edges.plot(plot)
    return edges


def _graph(model: nn.Module) -> _Graph:
    names = index(model)
    structure = blocks_of(names, "edge_attribution_patching")
    norms = [branch_norms(names, i, structure) for i in range(structure.count)]
    ((_, final, _, _),) = resolve_standard(names, "final_norm")
    z_keys = [f"attn.z.{layer}" for layer in range(structure.count)]
    return _Graph(structure.count, "resid_pre.0", z_keys, [a for a, _ in norms],
                  [m for _, m in norms], final)


def _record(model: nn.Module, inputs: Any, metric: Metric,
            names: list[str]) -> tuple[float, dict[str, Tensor], int, Tokens]:
    """One forward under ``no_grad``: the metric, the values of ``names``, the heads axis of
    ``attn.z`` and the forward's tokens (``engine.values.layout``; ``names[1]`` is ``attn.z.0``)."""
    with torch.no_grad(), capture(model, *names, on_unfired="error") as acts:
        value = _number(metric(_forward(model, inputs)))
    axis = acts.layout(names[1]).heads
    assert axis is not None  # attn.z is a heads value (the layout table)
    return value, {name: acts[name] for name in names}, axis, acts.layout(names[0]).tokens


def _check_same_tokens(clean: Tokens, corrupted: Tokens) -> None:
    """Edges are scored position by position (clean minus corrupted at each position), so the
    two runs' real tokens must sit at the same positions: the same attention mask (or none,
    and no padding that looks real).

    Raises:
        PositionError: an input looks padded without a mask (``check_no_unmasked_padding``).
        EditError: the two masks differ.
    """
    for tokens in (clean, corrupted):
        check_no_unmasked_padding(tokens, "edge_attribution_patching", positions=False)
    same = (clean.mask is None and corrupted.mask is None) or (
        clean.mask is not None and corrupted.mask is not None
        and torch.equal(clean.mask.bool(), corrupted.mask.bool()))
    if not same:
        raise EditError("edge_attribution_patching compares the clean and corrupted runs position "
                        "by position, but their attention masks differ, so a real token would be "
                        "set against padding or another token: pad both inputs the same way "
                        "(the same attention_mask)")


def _difference(clean: Any, corrupted: Any, name: str) -> Tensor:
    if not isinstance(clean, Tensor) or not isinstance(corrupted, Tensor) or clean.shape != corrupted.shape:
        shapes = [tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for v in (clean, corrupted)]
        raise EditError(f"'{name}' gives {shapes[0]} on the clean input and {shapes[1]} on the "
                        f"corrupted one; edge attribution compares them position by position: "
                        f"give two inputs of the same shape (pad both the same way, with the same mask)")
    return clean.double().cpu() - corrupted.double().cpu()


class _Pass:
    """One forward and backward (``run``) scoring every edge: the gradient at each downstream
    node's input is computed, used for its column of scores and dropped, so memory holds one
    ``(batch, seq, d_model)`` gradient at a time, not one per node."""

    def __init__(self, graph: _Graph, clean_acts: dict[str, Tensor], heads_axis: int,
                 corrupted_acts: dict[str, Tensor] | None = None, tokens: Tokens | None = None):
        self.graph, self.clean_acts, self.heads_axis = graph, clean_acts, heads_axis
        self.tokens = tokens  # the clean run's, to check the corrupted run's against (EAP)
        self.delta: dict[str, Tensor] = {} if corrupted_acts is None else _deltas(clean_acts, corrupted_acts)
        self.metric = math.nan
        # what the running pass found: (value, zero added) at each norm's input, projection and z
        self.at_norms: dict[str, Found] = {}
        self.live: dict[str, Found] = {}
        self.attn_out: dict[str, Found] = {}
        self.changes: Tensor | None = None  # (upstream, batch * seq * d_model): what each adds
        count = clean_acts[graph.z_keys[0]].shape[heads_axis]
        self.upstream = ["input", *(name for layer in range(graph.layers) for name in
                                    [*(f"a{layer}.h{h}" for h in range(count)), f"m{layer}"])]

    def run(self, model: nn.Module, inputs: Any, metric: Metric,
            replaced: Tensor | None) -> tuple[list[str], Tensor]:
        """``(downstream nodes, scores (upstream, downstream, seq) float64)`` of one pass of
        ``inputs`` (block input replaced by ``replaced`` when given); without ``delta`` yet (EAP),
        the pass records the corrupted values and makes it."""
        graph = self.graph
        norms = [*graph.attention_norms, *graph.mlp_norms, graph.final_norm]
        self.at_norms = {path: [] for path in norms}
        self.live = {key: [] for key in [*graph.z_keys, *_projections(graph)]}
        self.attn_out = {f"attn_out.{layer}": [] for layer in range(graph.layers)}
        outputs = {key: _plus_zero(found) for key, found in [*self.live.items(), *self.attn_out.items()]}
        if replaced is not None:
            outputs[graph.input_key] = lambda value: replaced.to(value.dtype)
        record = list(self.clean_acts) if not self.delta else []
        recording = capture(model, *record, on_unfired="error") if record else contextlib.nullcontext()
        with gradient_pass(model, EditError):
            with edit(model, {p: _input_zero_added(self.at_norms[p], p) for p in norms},
                      inputs=True, on_unfired="error"), edit(model, outputs, on_unfired="error"), \
                    recording as acts:
                value = _differentiable(metric(_forward(model, inputs)))
            self.metric = _number(value)
            if acts is not None:
                if self.tokens is not None:
                    _check_same_tokens(self.tokens, acts.layout(record[0]).tokens)
                self.delta = _deltas(self.clean_acts, {name: acts[name] for name in record})
            if self.changes is None:  # the output projections are linear: once for every pass
                self.changes = self._changes()
            columns = dict(self._columns(value))
        return list(columns), torch.stack(list(columns.values()), dim=1)

    def _columns(self, value: Tensor) -> Iterator[tuple[str, Tensor]]:
        """``(downstream node, its column of scores)`` in ``Edges.downstream`` order."""
        graph = self.graph
        ends = [_once(self.at_norms[p], p)[1] for p in [*graph.mlp_norms, graph.final_norm]] + \
            [_once(self.live[key], key)[1] for key in _projections(graph)]
        found = torch.autograd.grad(value, ends, retain_graph=True, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(z) for g, z in zip(found, ends, strict=True)]
        at_projection = dict(zip(_projections(graph), grads[graph.layers + 1:], strict=True))
        for layer in range(graph.layers):
            norm = graph.attention_norms[layer]
            for x in "qkv":  # a head's input as only its q (k, v) reads it: (d q / d x)^T g_q[head]
                key = f"attn.{x}.{layer}"
                projected, g = _once(self.live[key], key)[0], at_projection[key]
                norm_zero = _read_call(self.at_norms[norm], norm, projected, key)
                kept = torch.zeros(g.shape[2], *g.shape, dtype=g.dtype, device=g.device)
                for h in range(g.shape[2]):  # g: (batch, seq, heads, head_dim); kept[h]: head h's
                    kept[h, :, :, h] = g[:, :, h]
                inputs = torch.autograd.grad(projected, norm_zero, grad_outputs=kept,
                                             retain_graph=True, is_grads_batched=True)[0]
                for h in range(g.shape[2]):
                    yield f"a{layer}.h{h}.{x}", self._column(f"a{layer}.h{h}.{x}", inputs[h])
            yield f"m{layer}", self._column(f"m{layer}", grads[layer])
        yield "logits", self._column("logits", grads[graph.layers])

    def _column(self, target: str, g: Tensor) -> Tensor:
        """Each upstream node's score for the edge into ``target`` at each position, ``(upstream,
        seq)``: its change in the residual stream times ``g``, the gradient at ``target``'s
        input ``(batch, seq, d_model)``, summed over rows and channels; NaN where there is no
        edge."""
        assert self.changes is not None
        g = g.detach().double().cpu()  # (batch, seq, d_model)
        changes = self.changes.view(len(self.upstream), *g.shape)  # (upstream, batch, seq, d_model)
        column = torch.einsum("ubsd,bsd->us", changes, g)
        before = torch.tensor([_position(node) < _position(target) for node in self.upstream])
        return column.where(before[:, None], torch.nan)

    def _changes(self) -> Tensor:
        """``(upstream, batch * seq * d_model)`` float64: what each upstream node's clean value
        adds to the residual stream over its corrupted one. A head's is its z difference through
        the output projection, ``J dz``, taken as the gradient of ``J^T u`` with respect to
        ``u`` (two autograd calls per block, no module called twice)."""
        graph, axis = self.graph, self.heads_axis
        found = {"input": self.delta[graph.input_key].flatten()}
        for layer in range(graph.layers):
            out = _once(self.attn_out[f"attn_out.{layer}"], f"attn_out.{layer}")[0]
            z_zero = _once(self.live[graph.z_keys[layer]], graph.z_keys[layer])[1]
            u = torch.zeros_like(out, requires_grad=True)
            back = torch.autograd.grad(out, z_zero, grad_outputs=u, create_graph=True)[0]  # J^T u
            dz = self.delta[graph.z_keys[layer]].to(device=back.device, dtype=back.dtype)
            for h in range(dz.shape[axis]):
                only = torch.zeros_like(dz)
                only.select(axis, h).copy_(dz.select(axis, h))
                change = torch.autograd.grad(back, u, grad_outputs=only, retain_graph=True)[0]
                found[f"a{layer}.h{h}"] = change.detach().double().cpu().flatten()
            found[f"m{layer}"] = self.delta[f"mlp_out.{layer}"].flatten()
        return torch.stack([found[node] for node in self.upstream])


def _read_call(found: Found, norm: str, projected: Tensor, key: str) -> Tensor:
    """The zero added to the input of the call of ``norm`` that ``projected`` (``attn.q.{l}``,
    ``.k``, ``.v``) reads. One call feeds q, k and v on most models (Hugging Face GPT-2, Llama);
    TransformerLens's ``HookedTransformer`` calls ``ln1`` once per q, k and v input (its
    ``TransformerBlock.forward``), so the call is found from the graph (the only one whose zero
    ``projected`` depends on), not assumed from the order of the calls.

    Raises:
        EditError: ``projected`` reads no call of ``norm``, or more than one.
    """
    if len(found) == 1:
        return found[0][1]
    zeros = [zero for _, zero in found]
    reached = torch.autograd.grad(projected, zeros, grad_outputs=torch.ones_like(projected),
                                  retain_graph=True, allow_unused=True)
    read = [zero for zero, g in zip(zeros, reached, strict=True) if g is not None]
    if len(read) != 1:
        raise EditError(f"'{norm}' ran {len(found)} times in one forward pass and '{key}' reads "
                        f"{len(read)} of its calls; edge attribution needs the norm before the "
                        f"attention called once, or once for each of q, k and v (as "
                        f"TransformerLens's HookedTransformer does)")
    return read[0]


def _projections(graph: _Graph) -> list[str]:
    return [f"attn.{x}.{layer}" for layer in range(graph.layers) for x in "qkv"]


def _deltas(clean: dict[str, Tensor], corrupted: dict[str, Tensor]) -> dict[str, Tensor]:
    """``clean - corrupted`` of each upstream value, float64 on the CPU."""
    return {name: _difference(clean[name], corrupted[name], name) for name in clean}


def _plus_zero(found: Found) -> Callable[[Any], Any]:
    """The output edit: ``value + zero``, keeping ``(value, zero)`` in the graph: ``d metric /
    d zero`` is the gradient at the value, and the value links it to what came before."""
    def fn(value: Any) -> Any:
        zero = torch.zeros_like(value, requires_grad=True)
        found.append((value, zero))
        return value + zero
    return fn


def _input_zero_added(found: Found, path: str) -> Callable[..., Any]:
    """The input edit: the norm's first argument plus a zero that requires grad."""
    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not args or not isinstance(args[0], Tensor):
            raise EditError(f"'{path}' was called without its input as the first positional "
                            f"argument; edge attribution reads a norm called as norm(x)")
        zero = torch.zeros_like(args[0], requires_grad=True)
        found.append((args[0].detach(), zero))
        return (args[0] + zero, *args[1:]), kwargs
    return fn


def _position(node: str) -> int:
    """Where a node runs in the forward: ``input`` -1, block ``l``'s heads ``2l``, its MLP
    ``2l + 1``, ``logits`` after every block. An edge goes from an earlier to a later one."""
    if node == "input":
        return -1
    if node == "logits":
        return 1 << 30
    return 2 * int(node[1:].split(".")[0]) + (1 if node[0] == "m" else 0)


def _place(node: str, heads: int, layers: int) -> tuple[float, float]:
    """Where a node is drawn (``Edges.plot``): head ``h`` of block ``l`` at ``(h, 2l)``, its q,
    k, v inputs just below it, MLP ``l`` at ``(middle, 2l + 1)``."""
    middle = (heads - 1) / 2
    if node in ("input", "logits"):
        return middle, -1.2 if node == "input" else 2 * layers
    parts = node[1:].split(".")
    row = 2 * int(parts[0])
    if node[0] == "m":
        return middle, row + 1
    x = float(parts[1][1:])
    if len(parts) == 3:  # an input: q, k, v side by side below the head
        return x + {"q": -0.25, "k": 0.0, "v": 0.25}[parts[2]], row - 0.45
    return x, row
