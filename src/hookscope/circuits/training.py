"""Training SAEs and transcoders: from a store's token stream (``store.tokens(layer).stream``:
one shuffled window of ``buffer_tokens`` in memory at a time), or straight from forwards of the
model (each batch's activations are used and dropped: nothing is cached, for users who cannot
afford the disk).

The objective is the sparse-dictionary one of Anthropic's "Towards Monosemanticity" update
(2024) as SAELens trains it: ``||decode(encode(x)) - y||^2`` summed over the vector, plus
``l1 * sum_f f * ||W_dec[f]||``, averaged over the tokens of a batch; Adam. ``y`` is ``x`` for an
SAE and the module's output for a transcoder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.circuits.dictionary import Activation, Dictionary
from hookscope.circuits.sae import SAE
from hookscope.circuits.splicing import module_input
from hookscope.circuits.transcoder import Transcoder
from hookscope.errors import CircuitError
from hookscope.record import capture
from hookscope.store import Store

__all__ = ["Training", "train_sae", "train_transcoder"]

Tensor = torch.Tensor
Pairs = Iterator[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Training:
    """How to train: ``d_features`` (the dictionary's width), ``l1`` (sparsity coefficient),
    ``lr`` (Adam's), ``epochs`` (passes over a store; forwards pass over ``source`` once per
    epoch too), ``batch_size`` (tokens per step), ``buffer_tokens`` (the store stream's window),
    ``seed`` (initialization and shuffle), ``activation``/``k`` (``"relu"``, or ``"topk"`` with
    ``k``), ``exclude`` (token ids left out, e.g. BOS)."""

    d_features: int
    l1: float = 1e-3
    lr: float = 1e-3
    epochs: int = 1
    batch_size: int = 1024
    buffer_tokens: int = 1 << 16
    seed: int = 0
    activation: Activation = "relu"
    k: int | None = None
    exclude: Sequence[int] = ()


def _init(kind: type[Dictionary], d_in: int, d_out: int, options: Training) -> Dictionary:
    """Decoder rows of norm 0.1 in random directions, the encoder their transpose, biases zero."""
    g = torch.Generator().manual_seed(options.seed)
    W_dec = torch.randn(options.d_features, d_out, generator=g)  # noqa: N806
    W_dec = W_dec / W_dec.norm(dim=1, keepdim=True) * 0.1  # noqa: N806
    if d_in == d_out:
        W_enc = W_dec.T.clone()  # noqa: N806
    else:
        W_enc = torch.randn(d_in, options.d_features, generator=g) * 0.1 / d_in ** 0.5  # noqa: N806
    weights = {"W_enc": W_enc, "b_enc": torch.zeros(options.d_features), "W_dec": W_dec,
               "b_dec": torch.zeros(d_out), "activation": options.activation, "k": options.k}
    return SAE(**weights) if kind is SAE else Transcoder(**weights)


def fit(dictionary: Dictionary, pairs: Iterable[tuple[Tensor, Tensor]], options: Training) -> list[float]:
    """Train ``dictionary`` in place on ``(x, y)`` batches ``(tokens, d_in)``, ``(tokens, d_out)``
    in the given order, ``options.batch_size`` tokens per step; return each step's loss."""
    optimizer = torch.optim.Adam(dictionary.parameters(), lr=options.lr)
    losses = []
    dictionary.train()
    for x, y in _rebatch(pairs, options.batch_size):
        x, y = x.to(dictionary.W_enc.dtype), y.to(dictionary.W_dec.dtype)
        features = dictionary.encode(x)
        error = (dictionary.decode(features) - y).pow(2).sum(-1)
        sparsity = (features * dictionary.W_dec.norm(dim=1)).sum(-1)
        loss = (error + options.l1 * sparsity).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    dictionary.eval()
    return losses


def _rebatch(pairs: Iterable[tuple[Tensor, Tensor]], size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Cut or join ``(x, y)`` batches into batches of ``size`` tokens (the last may be shorter)."""
    held_x: list[Tensor] = []
    held_y: list[Tensor] = []
    count = 0
    for x, y in pairs:
        held_x.append(x)
        held_y.append(y)
        count += len(x)
        while count >= size:
            all_x, all_y = torch.cat(held_x), torch.cat(held_y)
            yield all_x[:size], all_y[:size]
            held_x, held_y, count = [all_x[size:]], [all_y[size:]], count - size
    if count:
        yield torch.cat(held_x), torch.cat(held_y)


def _store_pairs(store: Store, reads: str, writes: str, options: Training) -> Iterator[tuple[Tensor, Tensor]]:
    """Aligned ``(x, y)`` batches from two layers' token streams: the same seed and token count
    give the same permutation, so token ``k`` of one stream is token ``k`` of the other."""
    views = [store.tokens(layer, exclude=options.exclude) for layer in dict.fromkeys((reads, writes))]
    if len({len(v) for v in views}) != 1:
        raise CircuitError(f"layers {reads!r} and {writes!r} of {store.path} hold {[len(v) for v in views]} "
                           f"tokens: a transcoder trains on pairs, so both must be extracted from "
                           f"the same batches")
    block = min(256, options.buffer_tokens)
    for epoch in range(options.epochs):
        streams = [v.stream(buffer_tokens=options.buffer_tokens, block_tokens=block, seed=options.seed,
                            batch_size=options.batch_size) for v in views]
        for s in streams:
            s.set_epoch(epoch)
        for batches in zip(*streams):
            yield batches[0], batches[-1]


def _forward_pairs(model: nn.Module, source: Iterable[Any], reads: str, writes: str,
                   options: Training, sae: bool) -> Iterator[tuple[Tensor, Tensor]]:
    """``(x, y)`` per batch of ``source`` from one forward each (no gradient), real tokens only
    (``attention_mask``), ids in ``options.exclude`` left out; nothing outlives its batch."""
    for _ in range(options.epochs):
        for batch in source:
            with torch.no_grad(), capture(model, *dict.fromkeys((reads, writes)), inputs=not sae) as acts:
                model(**batch) if isinstance(batch, Mapping) else model(batch)
            if sae:
                x = acts[reads]
            else:
                call = acts.inputs(reads)
                x = module_input(call.args, call.kwargs, reads)
            y = acts[writes]
            keep = _keep(batch, x.shape[:-1], options.exclude)
            yield x[keep], y[keep]


def _keep(batch: Any, shape: torch.Size, exclude: Sequence[int]) -> Tensor:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    device = next((t.device for t in (mask, ids) if isinstance(t, Tensor)), None)
    keep = torch.ones(shape, dtype=torch.bool, device=device)  # on the batch's device (a GPU's)
    if isinstance(mask, Tensor):
        keep &= mask.bool().reshape(shape)
    if len(exclude) and isinstance(ids, Tensor) and ids.shape == shape:
        keep &= ~torch.isin(ids, torch.as_tensor(list(exclude), device=ids.device))
    return keep


def _first(pairs: Pairs) -> tuple[tuple[Tensor, Tensor], Pairs]:
    first = next(pairs, None)
    if first is None:
        raise CircuitError("the source gave no tokens to train on")

    def chained() -> Pairs:
        yield first
        yield from pairs
    return first, chained()


def train_sae(source: Store | Iterable[Any], layers: str, options: Training, *,
              model: nn.Module | None = None) -> SAE:
    """Train an SAE on the activations of ``layers`` (one store layer, or one module's output).

    Args:
        source: a ``Store`` (its ragged layer, read as a shuffled token stream: memory holds
            ``options.buffer_tokens`` tokens), or batches to run ``model`` on (forward mode:
            one batch's activations in memory, none on disk; the order is the batches').
        layers: the store's layer, or the module path (one; named as every verb names them).
        options: ``Training``.
        model: the model, for forward mode only.

    Returns:
        The trained ``SAE`` (``.losses``: each step's loss), in eval mode.

    Raises:
        CircuitError: forward mode without a model, a store given a model, or no tokens.
        StoreError: ``layers`` is not a ragged layer of the store.
    """
    pairs = _pairs(source, layers, layers, options, model, sae=True)
    (x, _), pairs = _first(pairs)
    sae = _init(SAE, x.shape[-1], x.shape[-1], options)
    sae.losses = fit(sae, pairs, options)  # type: ignore[assignment]
    assert isinstance(sae, SAE)
    return sae


def train_transcoder(source: Store | Iterable[Any], reads: str, writes: str, options: Training, *,
                     model: nn.Module | None = None) -> Transcoder:
    """Train a transcoder from ``reads`` to ``writes``.

    From a store, ``reads`` and ``writes`` are two layers extracted from the same batches (for
    an MLP: the norm before it, e.g. ``"transformer.h.0.ln_2"``, and the MLP itself); their token
    streams are read in the same shuffled order. In forward mode, ``reads`` is the module whose
    *input* is read and ``writes`` the one whose output is the target (both the MLP's path for
    an MLP transcoder).

    Returns:
        The trained ``Transcoder`` (``.losses``), in eval mode.

    Raises:
        CircuitError: as ``train_sae``; the two layers hold different numbers of tokens.
    """
    pairs = _pairs(source, reads, writes, options, model, sae=False)
    (x, y), pairs = _first(pairs)
    transcoder = _init(Transcoder, x.shape[-1], y.shape[-1], options)
    transcoder.losses = fit(transcoder, pairs, options)  # type: ignore[assignment]
    assert isinstance(transcoder, Transcoder)
    return transcoder


def _pairs(source: Store | Iterable[Any], reads: str, writes: str, options: Training,
           model: nn.Module | None, sae: bool) -> Iterator[tuple[Tensor, Tensor]]:
    if not isinstance(options, Training):
        raise CircuitError(f"options is a hookscope.circuits.Training(d_features=...), not "
                           f"{type(options).__name__}")
    if isinstance(source, Store):
        if model is not None:
            raise CircuitError("a store holds the activations already: pass model=None, or pass the "
                               "batches instead of the store to train from forwards")
        return _store_pairs(source, reads, writes, options)
    if model is None:
        raise CircuitError("training from forwards runs the model on each batch: pass model=, or "
                           "pass a Store to train from its token stream")
    return _forward_pairs(model, source, reads, writes, options, sae)
