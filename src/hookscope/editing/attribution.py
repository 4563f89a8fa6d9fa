"""Attribution patching: a first-order estimate of a whole activation-patching sweep from one
clean forward, one corrupted forward and one backward.

Nanda, "Attribution Patching: Activation Patching At Industrial Scale" (2023,
https://www.neelnanda.io/mechanistic-interpretability/attribution-patching); Syed, Rager and
Conmy, "Attribution Patching Outperforms Automated Circuit Discovery" (2023, arXiv:2310.10348);
Kramár et al., "AtP*" (2024, arXiv:2403.00745). Patching ``a`` from its corrupted value to its
clean one changes the metric by about

    metric(patched) - metric(corrupted) ~ (a_clean - a_corrupted) . d metric / d a |corrupted

(a Taylor expansion at the corrupted run), summed over the patched rows and channels. Exact where
the metric is linear in ``a``; where attention saturates or a norm divides, it can miss (AtP* and
the exact ``patching_sweep`` are the checks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hookscope.editing.edits import edit
from hookscope.editing.sweep import (
    Metric,
    Sweep,
    _all_positions,
    _forward,
    _heads,
    _length,
    _number,
    _plain,
    _sequence_tensor,
    captured_metric,
    cells,
    check_metric,
    check_sweep_positions,
)
from hookscope.engine import (
    Layout,
    as_patterns,
    asked_names,
    check_flag,
    check_int,
    one_index_per_call,
    resolve,
    untouched,
    warn_if_dropout_trains,
)
from hookscope.errors import EditError
from hookscope.record import Capture, capture, gradient_pass, tokens_first

__all__ = ["attribution_patching"]

Tensor = torch.Tensor


@one_index_per_call
def attribution_patching(model: nn.Module, clean: Any, corrupted: Any, metric: Metric, *,
                         layers: str | Sequence[str], positions: Sequence[int] | None = None,
                         heads: bool = False, all_positions: bool = False,
                         seq_dim: int | None = None,
                         plot: str | os.PathLike[str] | None = None) -> Sweep:
    """Estimate ``patching_sweep``'s table from one clean forward, one corrupted forward and one
    backward (Nanda 2023; Syed et al. 2023, arXiv:2310.10348).

    ```python
    atp = hookscope.attribution_patching(model, clean_ids, corrupt_ids, logit_diff,
                                         layers="transformer.h.*")
    atp.values     # ~ patching_sweep(...).values, at the cost of three passes
    ```

    ``values[i, j] = corrupted + sum((a_clean - a_corrupted) * d metric / d a)`` over the rows
    and channels of ``layers[i]`` at ``positions[j]`` (the positions as ``patching_sweep``
    resolves them: on each value's token axis, among the real tokens of its own run's
    ``attention_mask``, both read from the records' layouts, ``engine.layout``), so the table
    reads as the exact sweep's; with ``heads=True``, ``values[i, j, k]`` sums over head ``k``
    only. The gradient is taken with respect to each layer's output (a zero
    added to it), so frozen weights and integer inputs need nothing; no parameter's ``.grad``
    changes, and the model is left as it was found (``engine.run.untouched``). Call
    ``model.eval()`` first (dropout in training mode: a ``TrainingModeWarning``).

    Args:
        model: root module.
        clean, corrupted: model inputs as for ``patching_sweep`` (tensor, dict, tuple).
        metric: ``metric(output) -> Tensor`` of one element, differentiable (a logit
            difference, ``.mean()`` over the batch).
        layers: patterns of the layers; each must output a ``(batch, seq, ...)`` tensor (a
            part selects one of a structured output, ``"layers.*[0]"``) or be a function-level
            address whose token axis is known (the query axis of
            ``"path::scaled_dot_product_attention"``'s ``(batch, heads, query, head_dim)``) or
            given by ``seq_dim``, and run once.
        positions: positions (ints); ``None``: every position of the corrupted input that
            the clean input has too (a warning names the positions left out when the
            corrupted input is longer, as in ``patching_sweep``).
        heads: estimate each head on its own (``values`` gets a heads axis), as
            ``patching_sweep(heads=True)``; the layers must have a heads axis.
        all_positions: estimate patching every position at once, as
            ``patching_sweep(all_positions=True)``: the sum of the per-position estimates
            (first order is additive), one position column.
        seq_dim: the token axis of the values, overriding their known layout.
        plot: write the heat map PNG there (``Sweep.plot``); missing parent folders are
            created, as in ``patching_sweep``.

    Returns:
        A ``Sweep`` (``values`` float64 ``(len(layers), len(positions))``, ``(len(layers),
        len(positions), len(heads))`` with ``heads``; ``clean`` and ``corrupted`` are the two
        runs' metrics; ``layers`` are the names asked, a standard name as given, and
        ``paths`` maps each to its module path, as ``patching_sweep``'s).

    Raises:
        SelectorError: a pattern matches no module.
        ArgumentTypeError, ArgumentValueError: at the call, ``positions`` not a list of ints,
            or (token-id inputs) a position outside either input.
        PositionError: a position does not exist in a row of either input; a function's value
            of unknown layout without ``seq_dim``; ``heads=True`` on a value without a heads
            axis; a padded input without its attention mask.
        EditError: a layer's output is not a ``(batch, seq, ...)`` tensor or the layer runs
            more than once; ``metric`` does not return one differentiable number.
    """
    keys, names = asked_names(resolve(model, as_patterns(layers)))
    check_metric(metric)
    check_flag("heads", heads)
    check_flag("all_positions", all_positions)
    if seq_dim is not None:
        check_int("seq_dim", seq_dim)
    clean, corrupted = _plain(clean), _plain(corrupted)
    check_sweep_positions(positions, clean, corrupted)
    warn_if_dropout_trains(model, "attribution_patching")
    found: dict[str, list[tuple[Tensor, Tensor]]] = {key: [] for key in keys}
    with untouched(model):
        runs = _runs(model, keys, clean, corrupted, metric, found)
    (acts, clean_metric), (live_acts, value, grads) = runs
    sources = {key: _sequence_tensor(acts[key], key) for key in keys}
    # what each value holds (token and heads axes, the mask of its run), from its record
    layouts = {key: (acts.layout(key, seq_dim=seq_dim, heads=heads),
                     live_acts.layout(key, seq_dim=seq_dim, heads=heads)) for key in keys}
    first = keys[0]
    chosen = list(positions) if positions is not None else _all_positions(
        *(_length(layout) for layout in layouts[first]))
    head_list = _heads({key: clean for key, (clean, _) in layouts.items()}) if heads else None
    values = torch.stack([torch.stack([_estimate(key, sources[key], _once(found[key], key)[0],
                                                 grad, p, layouts[key], heads) for p in chosen])
                          for key, grad in zip(keys, grads)])  # (layers, positions[, heads])
    if all_positions:
        values = values.sum(dim=1, keepdim=True)
    sweep = Sweep(values + _number(value), names, chosen, clean_metric, _number(value), head_list,
                  all_positions, dict(zip(names, keys)))
    if plot is not None:
        sweep.plot(plot)
    return sweep


def _runs(model: nn.Module, keys: list[str], clean: Any, corrupted: Any, metric: Metric,
          found: dict[str, list[tuple[Tensor, Tensor]]]) -> tuple[Any, Any]:
    """The clean run (captured, without gradients) and the corrupted one (``_corrupted_run``)."""
    with torch.no_grad():
        clean_run = captured_metric(model, keys, clean, metric)
    passing = gradient_pass(model, EditError)
    with passing:
        corrupted_run = _corrupted_run(model, keys, corrupted, metric, found)
    return clean_run, corrupted_run


def _corrupted_run(model: nn.Module, keys: list[str], corrupted: Any, metric: Metric,
                   found: dict[str, list[tuple[Tensor, Tensor]]]) -> tuple[Capture, Tensor, Any]:
    """The corrupted run, captured, a zero added to each layer's output (kept in ``found``);
    ``(capture, metric, d metric / d zero of each layer)``."""
    edits = edit(model, {key: _zero_added(found[key], key) for key in keys}, on_unfired="error")
    live_acts = capture(model, *keys, on_unfired="error")
    with edits, live_acts:
        value = _differentiable(metric(_forward(model, corrupted)))
    grads = torch.autograd.grad(value, [_once(found[key], key)[1] for key in keys], allow_unused=True)
    return live_acts, value, grads


def _zero_added(found: list[tuple[Tensor, Tensor]], key: str) -> Callable[[Any], Tensor]:
    """The edit: ``output + zero``, keeping ``(output, zero)``; ``d metric / d zero`` is
    ``d metric / d output`` whatever requires grad upstream."""
    def fn(value: Any) -> Tensor:
        live = _sequence_tensor(value, key)
        zero = torch.zeros_like(live, requires_grad=True)
        found.append((live.detach(), zero))
        return live + zero
    return fn


def _once(found: list[tuple[Tensor, Tensor]], key: str) -> tuple[Tensor, Tensor]:
    if len(found) != 1:
        raise EditError(f"'{key}' ran {len(found)} times in one forward pass; attribution "
                        f"patching patches a layer that runs once: select one that does")
    return found[0]


def _differentiable(value: Any) -> Tensor:
    if not isinstance(value, Tensor) or value.numel() != 1 or not value.requires_grad:
        what = (f"a tensor of shape {tuple(value.shape)}" + ("" if value.requires_grad else
                                                              " that does not require grad")
                if isinstance(value, Tensor) else type(value).__name__)
        raise EditError(f"metric returned {what}; attribution patching differentiates it: "
                        f"return one-element tensor computed from the output (no .item(), no "
                        f"torch.no_grad()), e.g. (logits[:, -1, a] - logits[:, -1, b]).mean()")
    return value


def _estimate(key: str, source: Tensor, live: Tensor, grad: Tensor | None, position: int,
              layouts: tuple[Layout, Layout], heads: bool) -> Tensor:
    """``sum((clean - corrupted) * grad)`` over the rows and channels patched at ``position``
    (float64; per head, ``(heads,)``, with ``heads``), each run's tokens counted by its layout."""
    (src_rows, src_columns), (dest_rows, dest_columns) = cells(key, position, layouts)
    clean_layout, live_layout = layouts
    count = clean_layout.shape[clean_layout.heads] if heads and clean_layout.heads is not None else 0
    if grad is None:  # the metric does not depend on this layer
        return torch.zeros(count, dtype=torch.float64) if heads else torch.zeros((), dtype=torch.float64)
    dest = (dest_rows.to(live.device), dest_columns.to(live.device))
    clean = tokens_first(source, clean_layout)[src_rows, src_columns]  # (n, [heads,] ...)
    change = clean.to(device=live.device, dtype=torch.float64) - \
        tokens_first(live, live_layout)[dest].double()
    product = (change * tokens_first(grad, live_layout)[dest].double()).cpu()
    if heads:
        return product.transpose(0, 1).flatten(1).sum(dim=1)
    return product.sum()
