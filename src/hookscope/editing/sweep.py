"""Activation-patching sweeps: the metric of a corrupted run with one (layer, position) patched
from a clean run, for every layer and position (a layers x positions table and its heat map).

The method is the causal tracing of Meng et al., "Locating and Editing Factual Associations in
GPT" (2022, arXiv:2202.05262) and the activation patching of Wang et al., "Interpretability in
the Wild" (2022, arXiv:2211.00593); TransformerLens offers it as ``patching.get_act_patch_*``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from hookscope.editing.edits import edit
from hookscope.engine import (
    Layout,
    as_patterns,
    asked_names,
    check_callable,
    check_flag,
    check_int,
    check_iterable,
    check_nonempty,
    check_positions,
    one_index_per_call,
    resolve,
    untouched,
    warn_if_dropout_trains,
)
from hookscope.errors import ArgumentTypeError, ArgumentValueError, EditError, PositionError, warn
from hookscope.record import Capture, capture, layout_positions, tokens_first
from hookscope.util import map_tensors, new_figure, require, save_figure

__all__ = ["Sweep", "patching_sweep", "Metric", "cells", "check_metric", "check_sweep_positions"]

Tensor = torch.Tensor
Metric = Callable[[Any], "Tensor | float"]
#: rows (batch rows times patched copies) of one forward when ``batch_size`` is not given
DEFAULT_ROWS = 64
Cell = tuple[tuple[int, ...], "int | None"]  # positions patched together and a head (None: every head)


@dataclass(frozen=True)
class Sweep:
    """The result of ``patching_sweep``.

    Attributes:
        values: ``(len(layers), len(positions))`` float64 (``(len(layers), len(positions),
            len(heads))`` with ``heads``): the metric of the corrupted run with that one layer
            and position (and head) patched from the clean run.
        layers: the patched layers by the names asked, ``named_modules()`` order: a standard
            name as given (``"attn.z.0"``, one per block for ``"attn.z.*"``), else the record
            name (an exact path, a glob's matches, ``"h.0.attn::scaled_dot_product_attention"``).
        positions: the token positions (counted among real tokens when a mask is known).
        clean: the metric of the clean run, unpatched.
        corrupted: the metric of the corrupted run, unpatched.
        heads: the heads patched one at a time, or ``None`` when whole positions were patched.
        all_positions: every position of ``positions`` was patched at once (``values`` has
            one position column, labelled ``"first…last"``), not one at a time.
        paths: ``{name in layers: record name}``, the module path (with ``::function`` and
            output parts) each name resolved to: ``{"attn.z.0":
            "transformer.h.0.attn::scaled_dot_product_attention"}``; a name that is already a
            path maps to itself. Empty for a ``Sweep`` built by hand.
    """

    values: Tensor
    layers: list[str]
    positions: list[int]
    clean: float
    corrupted: float
    heads: list[int] | None = None
    all_positions: bool = False
    paths: dict[str, str] = field(default_factory=dict)

    @property
    def columns(self) -> list[str]:
        """The label of each position column: the position, or ``"first…last"`` for all
        positions patched at once."""
        if self.all_positions:
            return [f"{self.positions[0]}…{self.positions[-1]}" if len(self.positions) > 1
                    else str(self.positions[0])]
        return [str(p) for p in self.positions]

    def normalized(self) -> Tensor:
        """``(values - corrupted) / (clean - corrupted)``, float64 of ``values``' shape: 0 where
        the patch changes nothing, 1 where it restores the clean metric (the normalisation of
        Wang et al. 2022, arXiv:2211.00593, and Heimersheim & Nanda 2024, arXiv:2404.15255).

        Raises:
            EditError: the clean and corrupted metrics are equal, so there is nothing to restore.
        """
        if self.clean == self.corrupted:
            raise EditError(f"the clean and corrupted metrics are both {self.clean:.6g}: the "
                            f"corruption changes nothing, so no patch can restore it; choose a "
                            f"corrupted input (or a metric) on which the runs differ")
        return (self.values - self.corrupted) / (self.clean - self.corrupted)

    def _grid(self) -> tuple[list[str], Tensor]:
        """Row labels and the ``(rows, positions)`` grid: one row per layer, or per (layer, head)."""
        if self.heads is None:
            return list(self.layers), self.values
        labels = [f"{layer} head {h}" for layer in self.layers for h in self.heads]
        return labels, self.values.permute(0, 2, 1).reshape(len(labels), len(self.columns))

    def table(self) -> str:
        """The values as an aligned text table, one line per layer (per layer and head)."""
        labels, grid = self._grid()
        width = max(len(label) for label in labels)
        head = " " * width + "".join(f"{c:>10}" for c in self.columns)
        lines = [f"{label:<{width}}" + "".join(f"{v:>10.4g}" for v in row)
                 for label, row in zip(labels, grid.tolist())]
        return "\n".join([head, *lines])

    def plot(self, file: str | os.PathLike[str], *, title: str = "activation patching",
             tokens: Sequence[str] | None = None, normalized: bool = False) -> Path:
        """Write the heat map (layers, or layers x heads, down; positions across) as a PNG,
        atomically: ``figure(...)`` saved to ``file``, ``FIGURE_SIZE_PX`` pixels.

        Args:
            file: the PNG's path.
            title, tokens, normalized: as ``figure``.

        Raises:
            As ``figure``.
        """
        return save_figure(self.figure(title=title, tokens=tokens, normalized=normalized), Path(file))

    def figure(self, *, title: str = "activation patching", tokens: Sequence[str] | None = None,
               normalized: bool = False) -> Any:
        """The heat map as a ``matplotlib.figure.Figure`` (Agg, no pyplot), laid out with
        matplotlib's constrained layout so that the row labels (``"h.0.attn::
        scaled_dot_product_attention head 3"``), the ticks and the colour bar lie inside it.

        Args:
            title: the figure's title.
            tokens: a label per position (the token strings), instead of the position numbers.
            normalized: draw ``normalized()`` (0 = corrupted, 1 = clean) instead of the metric.

        Raises:
            ArgumentValueError: ``tokens`` does not have one label per position.
            EditError: as ``normalized()``.
            MissingExtraError: matplotlib is not installed (extra ``[viz]``).
        """
        if tokens is not None and len(tokens) != len(self.columns):
            raise ArgumentValueError(
                f"tokens has {len(tokens)} labels for {len(self.positions)} positions "
                f"{self.positions}: give one per position, e.g. [tokens[p] for p in "
                f"sweep.positions]" if not self.all_positions else
                f"tokens has {len(tokens)} labels for the one column of positions "
                f"{self.columns[0]}, all patched at once: give one label, e.g. ['all']")
        colors = require("matplotlib.colors", "Sweep.plot")
        labels, grid = self._grid()
        center = 0.0 if normalized else self.corrupted
        if normalized:
            grid = Sweep(grid, labels, self.positions, self.clean, self.corrupted).normalized()
        figure = new_figure("Sweep.plot")
        figure.set_layout_engine("constrained")  # labels of any length stay inside the PNG
        axes = figure.add_subplot()
        # white = the corrupted run's metric; red above it, blue below
        image = axes.imshow(grid.numpy(), cmap="RdBu_r", aspect="auto",
                            norm=colors.CenteredNorm(vcenter=center))
        axes.set_xticks(np.arange(len(self.columns)),
                        list(tokens) if tokens is not None else self.columns)
        axes.set_yticks(np.arange(len(labels)), labels)
        axes.set_xlabel("token" if tokens is not None else "position")
        label = ("(patched - corrupted) / (clean - corrupted)" if normalized else
                 f"metric (clean {self.clean:.4g}, corrupted {self.corrupted:.4g})")
        figure.colorbar(image, ax=axes, label=label)
        axes.set_title(title)
        return figure


@one_index_per_call
def patching_sweep(model: nn.Module, clean: Any, corrupted: Any, *, layers: str | Sequence[str],
                   metric: Metric, positions: Sequence[int] | None = None, heads: bool = False,
                   all_positions: bool = False, seq_dim: int | None = None,
                   batch_size: int | None = None, plot: str | os.PathLike[str] | None = None,
                   progress: bool = True) -> Sweep:
    """Patch each (layer, position) of ``corrupted`` with ``clean``'s value; tabulate ``metric``.

    For each selected layer and each position ``p``, the corrupted input runs with that layer's
    value at token ``p`` (in every batch row) replaced by the clean run's value at ``p``, and
    ``metric(output)`` is recorded. The token axis is dim 1 of a module's output and the query
    axis of a ``"path::scaled_dot_product_attention"`` value ``(batch, heads, query,
    head_dim)``; any other function's value needs ``seq_dim``. With ``heads=True`` each head
    of such an attention value is patched on its own at each position. Forwards run under
    ``torch.no_grad()`` in the model's
    current mode (call ``model.eval()`` first: in training mode dropout makes every forward
    differ, and a ``TrainingModeWarning`` says so), and the model is left as it was found
    afterwards (BatchNorm statistics, spectral norm, train/eval flags, ``requires_grad``,
    ``.grad``, the RNG state: ``engine.run.untouched``); ``batch_size``
    patched runs share one forward (the corrupted batch repeated along dim 0, each copy patched
    at its own position), so ``metric`` sees each copy's output alone.

    ```python
    sweep = hookscope.patching_sweep(model, clean_ids, corrupt_ids, layers="transformer.h.*",
                                     metric=lambda out: out.logits[:, -1, 3] - out.logits[:, -1, 7])
    ```

    Args:
        model: root module.
        clean, corrupted: model inputs: a tensor (``model(x)``), a dict (``model(**x)``, its
            ``attention_mask`` counts positions among real tokens) or a tuple (``model(*x)``).
            Their sequence lengths may differ.
        layers: patterns of the layers to patch; each must output a ``(batch, seq, ...)`` tensor
            (select the tensor of a tuple output with a part, ``"layers.*[0]"``), or be a
            function-level address whose token axis is known or given by ``seq_dim``.
        metric: ``metric(output) -> float`` or a one-element tensor (a mean over the batch,
            e.g. a logit difference), given the model's output of one patched run.
        positions: positions to patch (ints); ``None``: every position of the corrupted input
            that the clean input has too (a warning names the positions left out when the
            corrupted input is longer).
        heads: patch each head on its own (``values`` gets a heads axis); the layers must be
            ``"path::scaled_dot_product_attention"`` addresses.
        all_positions: patch every position of ``positions`` at once instead of one at a
            time: one run per layer (per layer and head with ``heads``), ``values`` of shape
            ``(len(layers), 1[, len(heads)])``; with ``heads=True`` this is TransformerLens's
            ``get_act_patch_attn_head_out_all_pos``.
        seq_dim: the token axis of the patched values, overriding their known layout.
        batch_size: patched runs per forward; ``None``: as many as keep a forward at 64 rows.
        plot: write the heat map PNG there; its missing parent folders are created (the
            Python API's rule for ``plot=``/``out=``, as in ``extract`` and ``logit_lens``; the
            CLI refuses a missing parent unless ``--parents``).
        progress: show a tqdm bar on stderr (one step per forward).

    Returns:
        A ``Sweep``: ``values[i, j]`` (``values[i, j, k]`` with heads) is the metric with
        ``sweep.layers[i]`` patched at ``sweep.positions[j]`` (head ``sweep.heads[k]``); with
        ``all_positions``, ``values[i, 0]`` is the metric with every one of them patched.

    Raises:
        SelectorError: a pattern matches no module.
        ArgumentTypeError, ArgumentValueError: at the call: ``batch_size`` not an int >= 1;
            ``positions`` not a list of ints, or (token-id inputs) a position outside either
            input; at the first metric, ``metric`` returns neither a number nor a tensor.
        PositionError: a position does not exist in a row of either input; ``positions=None``
            with rows of different real lengths; a function's value of unknown layout without
            ``seq_dim``; ``heads=True`` on a value without a heads axis.
        EditError: a layer's output is not a tensor with a batch and a token axis; layers with
            different head counts; ``metric`` does not return one number.
    """
    targets = resolve(model, as_patterns(layers))
    _check_arguments(metric, heads, progress, batch_size)
    warn_if_dropout_trains(model, "patching_sweep")
    check_flag("all_positions", all_positions)
    clean, corrupted = _plain(clean), _plain(corrupted)
    check_sweep_positions(positions, clean, corrupted)
    keys, names = asked_names(targets)
    rows = _rows(corrupted)
    with untouched(model), torch.no_grad():
        acts, clean_metric = captured_metric(model, keys, clean, metric)
        corrupted_acts, corrupted_metric = captured_metric(model, keys, corrupted, metric)
        sources = {key: _sequence_tensor(acts[key], key) for key in keys}
        # what each value holds (token and heads axes, the mask of its run), from its record
        layouts = {key: (acts.layout(key, seq_dim=seq_dim, heads=heads),
                         corrupted_acts.layout(key, seq_dim=seq_dim, heads=heads)) for key in keys}
        chosen = list(positions) if positions is not None else _all_positions(
            *(_length(layout) for layout in layouts[keys[0]]))
        head_list = _heads({key: clean for key, (clean, _) in layouts.items()}) if heads else None
        each_head: list[int | None] = [None] if head_list is None else list(head_list)
        groups = [tuple(chosen)] if all_positions else [(p,) for p in chosen]
        cells: list[Cell] = [(group, h) for group in groups for h in each_head]
        copies = batch_size or max(1, DEFAULT_ROWS // rows)
        chunks = [cells[i:i + copies] for i in range(0, len(cells), copies)]
        bar = tqdm(total=len(keys) * len(chunks), desc="patching sweep", unit="forward",
                   file=sys.stderr, disable=not progress)
        with bar:
            values = torch.tensor([[v for chunk in chunks
                                    for v in _run_chunk(model, corrupted, key, sources[key],
                                                        layouts[key], chunk, metric, bar)]
                                   for key in keys], dtype=torch.float64)
    if head_list is not None:
        values = values.reshape(len(keys), len(groups), len(head_list))
    sweep = Sweep(values, names, chosen, clean_metric, corrupted_metric, head_list, all_positions,
                  dict(zip(names, keys)))
    if plot is not None:
        sweep.plot(plot)
    return sweep


def check_metric(metric: object) -> None:
    """Raise ``ArgumentTypeError`` unless ``metric`` is a function (sweeps, attribution)."""
    check_callable("metric", metric, "lambda out: out.logits[:, -1, 3].mean(), returning one number")


def check_sweep_positions(positions: object, clean: Any, corrupted: Any) -> None:
    """Refuse, before any forward, ``positions`` that is not a non-empty list of ints or that
    holds a position outside the inputs when their token count is known (token ids, a tensor
    of ints ``(batch, seq)`` or a dict's ``input_ids``): it must exist in both inputs."""
    if positions is None:
        return
    check_iterable("positions", positions, "positions=[-2, -1] (None: every position)")
    check_nonempty("positions", positions, "positions=[-2, -1] (None: every position)")
    lengths = [n for n in (_token_count(clean), _token_count(corrupted)) if n is not None]
    check_positions("positions", list(positions), min(lengths) if lengths else None)  # type: ignore[call-overload]


def _token_count(inputs: Any) -> int | None:
    """The seq length of token-id inputs; None for any other input (images, embeddings)."""
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        return int(ids.shape[1])
    return None


def _check_arguments(metric: object, heads: object, progress: object, batch_size: object) -> None:
    """Refuse, before any forward, a metric that is not a function, flags that are not bools
    and a ``batch_size`` that is not a positive int (``engine.checks``)."""
    check_metric(metric)
    check_flag("heads", heads)
    check_flag("progress", progress)
    if batch_size is not None:
        check_int("batch_size", batch_size, minimum=1)


def _run_chunk(model: nn.Module, corrupted: Any, key: str, source: Tensor,
               layouts: tuple[Layout, Layout], chunk: list[Cell], metric: Metric,
               bar: Any) -> list[float]:
    """One forward of ``len(chunk)`` copies of ``corrupted``, copy ``j`` patched at ``chunk[j]``
    (positions and a head or ``None``) in ``key``; the metric of each copy."""
    rows = _rows(corrupted)
    edits, inputs = edit(model, {key: _patcher(key, source, layouts, chunk, rows)},
                         on_unfired="error"), _repeat(corrupted, len(chunk), rows)
    with edits:
        output = _forward(model, inputs)
    bar.update()
    return [_number(metric(_copy_of(output, j, len(chunk), rows))) for j in range(len(chunk))]


def cells(key: str, position: int, layouts: tuple[Layout, Layout]
          ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The ``(rows, columns)`` of ``position`` in the clean and in the corrupted run, each
    counted by its own run's layout (its token axis and its mask).

    Raises:
        PositionError: a row of either run lacks the position.
        EditError: the two runs select a different number of tokens (other batch sizes).
    """
    clean, corrupted = (layout_positions(position, layout, key) for layout in layouts)
    if clean[0].numel() != corrupted[0].numel():
        raise EditError(f"position {position} of '{key}' selects {clean[0].numel()} tokens in the "
                        f"clean run and {corrupted[0].numel()} in the corrupted one: give inputs "
                        f"with the same batch size")
    return clean, corrupted


def _patcher(key: str, source: Tensor, layouts: tuple[Layout, Layout], chunk: list[Cell],
             rows: int) -> Callable[[Any], Tensor]:
    """The edit of one forward: copy ``j`` (rows ``j*rows`` …) patched at ``chunk[j]``."""
    clean_view = tokens_first(source, layouts[0])  # (batch, seq, [heads,] ...)
    where = [(j, head, cells(key, position, layouts))
             for j, (positions, head) in enumerate(chunk) for position in positions]

    def fn(value: Any) -> Tensor:
        new = _sequence_tensor(value, "the patched layer").clone()
        view = tokens_first(new, layouts[1])
        for j, head, ((src_rows, src_columns), (dest_rows, dest_columns)) in where:
            at_head = () if head is None else (head,)
            view[(j * rows + dest_rows.to(new.device), dest_columns.to(new.device), *at_head)] = \
                clean_view[(src_rows, src_columns, *at_head)].to(device=new.device, dtype=new.dtype)
        return new
    return fn


def _length(layout: Layout) -> int:
    """The real token count of every row of a run (its token axis without a mask).

    Raises:
        PositionError: the rows have different real lengths.
    """
    mask = layout.mask
    if mask is None:
        return layout.length
    lengths = set((mask != 0).sum(dim=1).tolist())
    if len(lengths) != 1:
        raise PositionError(f"the rows have {sorted(lengths)} real tokens, so 'every "
                            f"position' differs by row: give positions=[...] (e.g. [-3, -2, -1])")
    return int(lengths.pop())


def _all_positions(clean: int, corrupted: int) -> list[int]:
    """Every position of the corrupted input that the clean one has; a warning names the rest."""
    if corrupted > clean:
        warn(f"patching_sweep covers positions 0 … {clean - 1}: the corrupted input has "
             f"{corrupted} tokens and the clean one {clean}, so positions {clean} … "
             f"{corrupted - 1} have no clean value to patch in and are left out; give "
             f"positions=[...] to choose (negative positions count from each input's end)",
             UserWarning)
    return list(range(min(clean, corrupted)))


def _heads(layouts: dict[str, Layout]) -> list[int]:
    counts = {key: layout.shape[layout.heads or 0] for key, layout in layouts.items()}
    if len(set(counts.values())) != 1:
        raise EditError(f"heads=True needs one head count across the layers, but they have "
                        f"{counts}; sweep layers with the same number of heads together")
    return list(range(next(iter(counts.values()))))


def _sequence_tensor(value: Any, key: str) -> Tensor:
    if not isinstance(value, Tensor) or value.dim() < 2:
        kind = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise EditError(f"'{key}' returns {kind}, not a (batch, seq, ...) tensor; select the "
                        f"tensor of a structured output with a part, e.g. '{key}[0]'")
    return value


def captured_metric(model: nn.Module, keys: list[str], inputs: Any,
                    metric: Callable[[Any], Any]) -> tuple[Capture, float]:
    """A capture of ``keys`` over one forward of ``inputs``, and ``metric`` of its output."""
    acts = capture(model, *keys, on_unfired="error")
    with acts:
        value = metric(_forward(model, inputs))
    return acts, _number(value)


def _number(value: Tensor | float) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise EditError(f"metric returned a tensor of shape {tuple(value.shape)}; return one "
                            f"number, e.g. its .mean() over the batch")
        return float(value.item())
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ArgumentTypeError(f"metric returned a {type(value).__name__} {value!r:.40}; it must "
                                f"return one number (a float or a one-element tensor), e.g. "
                                f"lambda out: out.logits[:, -1, 3].mean()")
    return float(value)


def _plain(inputs: Any) -> Any:
    """A mapping (a tokenizer's ``BatchEncoding``) as a plain dict, anything else as it is."""
    return dict(inputs) if isinstance(inputs, Mapping) else inputs


def _forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _rows(inputs: Any) -> int:
    first = next((t for t in (inputs.values() if isinstance(inputs, dict) else
                              inputs if isinstance(inputs, tuple) else [inputs])
                  if isinstance(t, Tensor)), None)
    if first is None or first.dim() == 0:
        raise EditError("the corrupted input holds no batch-first tensor; give a tensor, a dict "
                        "or a tuple of batch-first tensors")
    return int(first.shape[0])


def _repeat(inputs: Any, copies: int, rows: int) -> Any:
    """``inputs`` with every batch-first tensor repeated ``copies`` times along dim 0."""
    if copies == 1:
        return inputs
    def repeat(t: Tensor) -> Tensor:
        return t.repeat(copies, *[1] * (t.dim() - 1)) if t.dim() and t.shape[0] == rows else t
    return map_tensors(repeat, inputs)


def _copy_of(output: Any, j: int, copies: int, rows: int) -> Any:
    """Copy ``j`` of a batched output: rows ``j*rows … (j+1)*rows`` of each batch-first tensor."""
    if copies == 1:
        return output
    def take(t: Tensor) -> Tensor:
        return t[j * rows:(j + 1) * rows] if t.dim() and t.shape[0] == rows * copies else t
    return map_tensors(take, output)

