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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from hookscope.editing.edit import edit
from hookscope.engine.run import untouched
from hookscope.engine.select import resolve
from hookscope.errors import EditError, PositionError
from hookscope.record.capture import capture
from hookscope.record.positions import resolve_positions
from hookscope.util.extras import require
from hookscope.util.figures import new_figure, save_figure
from hookscope.util.nested import map_tensors

__all__ = ["Sweep", "patching_sweep"]

Tensor = torch.Tensor
Metric = Callable[[Any], "Tensor | float"]
#: rows (batch rows times patched copies) of one forward when ``batch_size`` is not given
DEFAULT_ROWS = 64


@dataclass(frozen=True)
class Sweep:
    """The result of ``patching_sweep``.

    Attributes:
        values: ``(len(layers), len(positions))`` float64: the metric of the corrupted run with
            that one layer and position patched from the clean run.
        layers: record names of the patched layers, ``named_modules()`` order.
        positions: the positions (counted among real tokens when a mask is known).
        clean: the metric of the clean run, unpatched.
        corrupted: the metric of the corrupted run, unpatched.
    """

    values: Tensor
    layers: list[str]
    positions: list[int]
    clean: float
    corrupted: float

    def table(self) -> str:
        """The values as an aligned text table, one line per layer."""
        width = max(len(layer) for layer in self.layers)
        head = " " * width + "".join(f"{p:>10}" for p in self.positions)
        lines = [f"{layer:<{width}}" + "".join(f"{v:>10.4g}" for v in row)
                 for layer, row in zip(self.layers, self.values.tolist())]
        return "\n".join([head, *lines])

    def plot(self, file: str | os.PathLike[str], *, title: str = "activation patching") -> Path:
        """Write the heat map (layers down, positions across) as a PNG, atomically.

        Raises:
            MissingExtraError: matplotlib is not installed (extra ``[viz]``).
        """
        colors = require("matplotlib.colors", "Sweep.plot")
        figure = new_figure("Sweep.plot")
        axes = figure.add_axes((0.22, 0.12, 0.68, 0.78))
        # white = the corrupted run's metric; red above it, blue below
        image = axes.imshow(self.values.numpy(), cmap="RdBu_r", aspect="auto",
                            norm=colors.CenteredNorm(vcenter=self.corrupted))
        axes.set_xticks(np.arange(len(self.positions)), [str(p) for p in self.positions])
        axes.set_yticks(np.arange(len(self.layers)), self.layers)
        axes.set_xlabel("position")
        figure.colorbar(image, ax=axes, label=f"metric (clean {self.clean:.4g}, "
                                               f"corrupted {self.corrupted:.4g})")
        axes.set_title(title)
        return save_figure(figure, Path(file))


def patching_sweep(model: nn.Module, clean: Any, corrupted: Any, *, layers: str | Sequence[str],
                   metric: Metric, positions: Sequence[int] | None = None,
                   batch_size: int | None = None, plot: str | os.PathLike[str] | None = None,
                   progress: bool = True) -> Sweep:
    """Patch each (layer, position) of ``corrupted`` with ``clean``'s value; tabulate ``metric``.

    For each selected layer and each position ``p``, the corrupted input runs with that layer's
    output at ``p`` (in every batch row) replaced by the clean run's value at ``p``, and
    ``metric(output)`` is recorded. Forwards run under ``torch.no_grad()`` in the model's
    current mode (call ``model.eval()`` first: in training mode dropout makes every forward
    differ), and the model is left as it was found afterwards (BatchNorm statistics, spectral
    norm, train/eval flags, ``requires_grad``, ``.grad``, the RNG state:
    ``engine.run.untouched``); ``batch_size``
    patched runs share one forward (the corrupted batch repeated along dim 0, each copy patched
    at its own position), so ``metric`` sees each copy's output alone.

    ::

        sweep = hookscope.patching_sweep(model, clean_ids, corrupt_ids, layers="transformer.h.*",
                                         metric=lambda out: out.logits[:, -1, 3] - out.logits[:, -1, 7])

    Args:
        model: root module.
        clean, corrupted: model inputs: a tensor (``model(x)``), a dict (``model(**x)``, its
            ``attention_mask`` counts positions among real tokens) or a tuple (``model(*x)``).
            Their sequence lengths may differ when every position exists in both.
        layers: patterns of the layers to patch; each must output a ``(batch, seq, ...)`` tensor
            (select the tensor of a tuple output with a part, ``"layers.*[0]"``).
        metric: ``metric(output) -> float`` or a one-element tensor (a mean over the batch,
            e.g. a logit difference), given the model's output of one patched run.
        positions: positions to patch (ints); ``None``: every position of the corrupted input.
        batch_size: patched runs per forward; ``None``: as many as keep a forward at 64 rows.
        plot: write the heat map PNG there.
        progress: show a tqdm bar on stderr (one step per forward).

    Returns:
        A ``Sweep``: ``values[i, j]`` is the metric with ``sweep.layers[i]`` patched at
        ``sweep.positions[j]``.

    Raises:
        SelectorError: a pattern matches no module.
        PositionError: a position does not exist in a row of either input; ``positions=None``
            with rows of different real lengths.
        EditError: a layer's output is not a ``(batch, seq, ...)`` tensor; ``metric`` does not
            return one number.
    """
    clean, corrupted = _plain(clean), _plain(corrupted)
    targets = resolve(model, [layers] if isinstance(layers, str) else list(layers))
    keys = list(dict.fromkeys(t.key for t in targets))
    clean_mask, corrupted_mask = _mask(clean), _mask(corrupted)
    rows = _rows(corrupted)
    with untouched(model), torch.no_grad():
        with capture(model, *keys, on_unfired="error") as acts:
            clean_metric = _number(metric(_forward(model, clean)))
        corrupted_metric = _number(metric(_forward(model, corrupted)))
        sources = {key: _sequence_tensor(acts[key], key) for key in keys}
        chosen = list(positions) if positions is not None else _all_positions(sources, corrupted_mask)
        copies = batch_size or max(1, DEFAULT_ROWS // rows)
        chunks = [chosen[i:i + copies] for i in range(0, len(chosen), copies)]
        bar = tqdm(total=len(keys) * len(chunks), desc="patching sweep", unit="forward",
                   file=sys.stderr, disable=not progress)
        with bar:
            values = torch.tensor([[v for chunk in chunks
                                    for v in _run_chunk(model, corrupted, key, sources[key], chunk,
                                                        metric, (clean_mask, corrupted_mask), bar)]
                                   for key in keys], dtype=torch.float64)
    sweep = Sweep(values, keys, chosen, clean_metric, corrupted_metric)
    if plot is not None:
        sweep.plot(plot)
    return sweep


def _run_chunk(model: nn.Module, corrupted: Any, key: str, source: Tensor, chunk: list[int],
               metric: Metric, masks: tuple[Tensor | None, Tensor | None], bar: Any) -> list[float]:
    """One forward of ``len(chunk)`` copies of ``corrupted``, copy ``j`` patched at ``chunk[j]``
    in ``key``; the metric of each copy."""
    rows = _rows(corrupted)
    with edit(model, {key: _patcher(source, chunk, rows, *masks)}, on_unfired="error"):
        output = _forward(model, _repeat(corrupted, len(chunk), rows))
    bar.update()
    return [_number(metric(_copy_of(output, j, len(chunk), rows))) for j in range(len(chunk))]


def _patcher(source: Tensor, chunk: list[int], rows: int, clean_mask: Tensor | None,
             corrupted_mask: Tensor | None) -> Callable[[Any], Tensor]:
    """The edit of one forward: copy ``j`` (rows ``j*rows`` …) patched at ``chunk[j]``."""
    def fn(value: Any) -> Tensor:
        live = _sequence_tensor(value, "the patched layer")
        new = live.clone()
        for j, position in enumerate(chunk):
            dest_rows, dest_columns = resolve_positions(position, (rows, live.shape[1]), corrupted_mask)
            src_rows, src_columns = resolve_positions(position, source.shape, clean_mask)
            new[j * rows + dest_rows.to(live.device), dest_columns.to(live.device)] = \
                source[src_rows, src_columns].to(device=live.device, dtype=live.dtype)
        return new
    return fn


def _all_positions(sources: dict[str, Tensor], mask: Tensor | None) -> list[int]:
    seq = next(iter(sources.values())).shape[1]
    if mask is None:
        return list(range(seq))
    lengths = set((mask != 0).sum(dim=1).tolist())
    if len(lengths) != 1:
        raise PositionError(f"the corrupted rows have {sorted(lengths)} real tokens, so 'every "
                            f"position' differs by row: give positions=[...] (e.g. [-3, -2, -1])")
    return list(range(lengths.pop()))


def _sequence_tensor(value: Any, key: str) -> Tensor:
    if not isinstance(value, Tensor) or value.dim() < 2:
        kind = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise EditError(f"'{key}' returns {kind}, not a (batch, seq, ...) tensor; select the "
                        f"tensor of a structured output with a part, e.g. '{key}[0]'")
    return value


def _number(value: Tensor | float) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise EditError(f"metric returned a tensor of shape {tuple(value.shape)}; return one "
                            f"number, e.g. its .mean() over the batch")
        return float(value.item())
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


def _mask(inputs: Any) -> Tensor | None:
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    return mask if isinstance(mask, Tensor) else None


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

