"""The logit lens: what a decoder language model would predict from each layer's residual stream.

nostalgebraist, "interpreting GPT: the logit lens" (LessWrong, 2020): the residual stream after
block ``l`` is read out as if it were the last one, through the model's own final norm and
unembedding, ``log_softmax(unembed(final_norm(h_l)))``. The last block's reading is the model's
own output; the earlier ones show how the prediction forms layer by layer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope.diagnostics.readout import Readout, model_readout
from hookscope.engine import (
    NO_TOKENS,
    Tokens,
    as_patterns,
    asked_names,
    blocks_of,
    check_tensor,
    check_token_ids,
    decoder_blocks,
    index,
    layout_of,
    resolve,
    resolve_standard,
    untouched,
)
from hookscope.errors import ArgumentValueError, CaptureError, SelectorError
from hookscope.record import capture, layout_positions
from hookscope.util import new_figure, save_figure

__all__ = ["LogitLens", "logit_lens"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class LogitLens:
    """The result of ``logit_lens``.

    Attributes:
        log_probs: ``(len(layers), batch, seq, vocab)`` float32 log-probabilities of the next
            token read from each layer's residual stream.
        layers: the blocks read by the names asked, ``named_modules()`` order: ``resid_post.0``
            ... by default (a standard name as given), else the record names (an exact path,
            a glob's matches).
        tokens: the forward's ``Tokens`` (its ``attention_mask``), from the capture's record:
            positions count among each row's real tokens.
        paths: ``{name in layers: module path}`` (``{"resid_post.0": "transformer.h.0"}``); a
            name that is a path maps to itself. Empty for a ``LogitLens`` built by hand.
    """

    log_probs: Tensor
    layers: list[str]
    tokens: Tokens = NO_TOKENS
    paths: dict[str, str] = field(default_factory=dict)

    def position(self, row: int = 0, position: int = -1) -> int:
        """The index on the token axis of ``position`` of batch ``row``, counted among the row's
        real tokens when the mask is known: ``-1`` is the last real token, whichever side the
        batch is padded on (``record.positions``, the rule of every verb).

        Raises:
            ArgumentValueError: ``row`` is not a row of the batch.
            PositionError: the row lacks the position; the input looks padded but no mask was
                given (``engine.values.layout.check_no_unmasked_padding``).
        """
        batch = int(self.log_probs.shape[1])
        if not -batch <= row < batch:
            raise ArgumentValueError(f"row={row} is not a row of this batch of {batch}: give "
                                     f"0 … {batch - 1}")
        row %= batch
        layout = layout_of("logit lens", None, self.log_probs.shape[1:], tokens=self.tokens)
        rows, columns = layout_positions(position, layout, "the logit lens")
        return int(columns[rows == row][0])

    def top(self, k: int = 5) -> tuple[Tensor, Tensor]:
        """The ``k`` most likely tokens: ``(probabilities, token ids)``, each ``(layers, batch,
        seq, k)``, most likely first."""
        values, ids = self.log_probs.topk(k, dim=-1)
        return values.exp(), ids

    def table(self, k: int = 3, *, row: int = 0, position: int = -1,
              decode: Callable[[int], str] | None = None) -> str:
        """The top ``k`` tokens at one ``position`` of batch ``row``, one line per layer, as
        ``token (probability)``; ``decode`` turns an id into text (``tokenizer.decode``).
        ``position`` counts among the row's real tokens (``position``): the default ``-1`` is
        the last real token, never a right-padded row's padding."""
        probabilities, ids = self.top(k)
        position = self.position(row, position)
        width = max(len(layer) for layer in self.layers)
        show = decode or str
        lines = [f"{layer:<{width}}  " + "  ".join(f"{show(int(i))!s:>6} ({p:.3f})" for p, i in
                                                   zip(probs[row, position].tolist(),
                                                       token_ids[row, position].tolist()))
                 for layer, probs, token_ids in zip(self.layers, probabilities, ids)]
        return "\n".join(lines)

    def plot(self, file: str | os.PathLike[str], *, row: int = 0,
             decode: Callable[[int], str] | None = None, title: str = "logit lens") -> Path:
        """Write the heat map of batch ``row`` (layers down, positions across, colour = the top
        token's probability, each cell labelled with that token) as a PNG, atomically.

        Raises:
            MissingExtraError: matplotlib is not installed (extra ``[viz]``).
        """
        probabilities, ids = self.top(1)
        heat, tokens = probabilities[:, row, :, 0].numpy(), ids[:, row, :, 0].tolist()
        figure = new_figure("LogitLens.plot")
        axes = figure.add_axes((0.22, 0.12, 0.68, 0.78))
        image = axes.imshow(heat, cmap="viridis", aspect="auto", vmin=0.0, vmax=1.0)
        for (layer, position), token in np.ndenumerate(np.array(tokens, dtype=object)):
            axes.text(position, layer, (decode or str)(int(token)), ha="center", va="center",
                      color="white", fontsize=8)
        axes.set_yticks(np.arange(len(self.layers)), self.layers)
        axes.set_xlabel("position")
        figure.colorbar(image, ax=axes, label="probability of the top token")
        axes.set_title(title)
        return save_figure(figure, Path(file))


def logit_lens(model: nn.Module, input_ids: Tensor, *, layers: str | Sequence[str] | None = None,
               attention_mask: Tensor | None = None, plot: str | os.PathLike[str] | None = None,
               decoder_input_ids: Tensor | None = None) -> LogitLens:
    """Read each selected block's residual stream through the model's final norm and unembedding.

    ```python
    lens = hookscope.logit_lens(gpt2, ids)          # every block of transformer.h
    print(lens.table(k=3, decode=tokenizer.decode)) # the top 3 at the last position
    ```

    One forward under ``torch.no_grad()`` in the model's current mode; the model is left as it
    was found (``engine.run.untouched``). The last block's reading equals
    ``log_softmax(model(input_ids).logits)``: what the model applies after its last block (final
    norm, projections, ``lm_head``, Gemma 2's soft-cap, a logit scale) is read from the model's
    own computation once per model and applied to every layer (``diagnostics.readout``: one
    probe forward at first use, kept); a model whose logits it cannot reproduce is refused.

    Args:
        model: a decoder language model whose standard names ``final_norm`` and ``unembed``
            resolve (``engine.standard_names``): a Hugging Face causal LM (``GPT2LMHeadModel``,
            ``LlamaForCausalLM`` …; its ``get_output_embeddings()`` is the unembedding) or a
            TransformerLens ``HookedTransformer`` (``ln_final``, ``unembed``). It is called
            ``model(input_ids, attention_mask=...)``.
        input_ids: ``(batch, seq)`` token ids.
        layers: patterns of the blocks to read (their output, or its first element, is the
            ``(batch, seq, hidden)`` residual stream); ``None``: ``"resid_post.*"``, every
            block's output.
        attention_mask: passed to the model.
        decoder_input_ids: ``(batch, dec_seq)`` token ids of an encoder-decoder's decoder
            (T5, BART ...; required there, refused elsewhere): the lens then reads the
            decoder's blocks (by default the list its ``decoder_hidden_states`` come from),
            and ``log_probs`` is ``(layers, batch, dec_seq, vocab)``.
        plot: write ``LogitLens.plot``'s PNG there, after the lens is computed; missing parent
            folders are created (the Python API's rule, as for ``patching_sweep`` and
            ``extract``; the CLI refuses them unless ``--parents``).

    Returns:
        A ``LogitLens``: ``log_probs`` ``(layers, batch, seq, vocab)`` float32.

    Raises:
        SelectorError: a pattern matches no module.
        ArgumentTypeError: ``input_ids`` is not an integer tensor, ``attention_mask`` not a tensor.
        ArgumentValueError: ``decoder_input_ids`` given to a model that is not an
            encoder-decoder, or not ``(batch, dec_seq)``; an id outside the model's
            vocabulary (``0 … vocab - 1``); an
            ``attention_mask`` of another shape than ``input_ids``, or with a row of no real token.
        CaptureError: an encoder-decoder called without ``decoder_input_ids``, or whose
            decoder blocks were not found; the model's own log-probabilities differ from
            every readout found after its last block (``diagnostics.readout``, naming the
            difference); the model has no final norm or unembedding the standard names find, no
            block list (give ``layers=``), or a selected block ran other than once or gave no
            ``(batch, seq, hidden)`` tensor.
    """
    seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    _check_decoder_ids(model, decoder_input_ids, seq2seq, input_ids)
    check_token_ids("input_ids", input_ids, _vocab_size(model, nn.Identity()))  # before any forward
    _check_mask(attention_mask, input_ids)
    keys, names = asked_names(resolve(model, _patterns(model, layers, seq2seq)))
    readout = model_readout(model, lambda: _readout(model))
    unembed = readout.modules[-1]
    check_token_ids("input_ids", input_ids, _vocab_size(model, unembed))
    acts = capture(model, *keys, on_unfired="error")
    inputs: dict[str, Any] = {"attention_mask": attention_mask}
    if seq2seq:
        inputs["decoder_input_ids"] = decoder_input_ids
    with untouched(model), torch.no_grad(), acts:
        model(input_ids, **inputs)
    hidden = readout.width if readout.width is not None else _width(unembed)
    with torch.no_grad():
        log_probs = _read_out(acts, keys, readout, hidden)
    lens = LogitLens(log_probs, names, acts.tokens(keys[0]), dict(zip(names, keys)))
    if plot is not None:
        lens.plot(plot)
    return lens


def _read_out(acts: Any, keys: list[str], readout: Readout, hidden: int | None) -> Tensor:
    """``(layers, batch, seq, vocab)`` float32 log-probabilities of each block's residual read
    out as the model reads its last block's output (``diagnostics.readout``)."""
    return torch.stack([torch.log_softmax(readout(_residual(acts, key, hidden)).float(), dim=-1)
                        for key in keys])


def _vocab_size(model: nn.Module, unembed: nn.Module) -> int:
    """The ids an input may hold: the rows of the input embedding (else of the unembedding)."""
    get_embed = getattr(model, "get_input_embeddings", None)
    embed = get_embed() if callable(get_embed) else None
    weight = getattr(embed if isinstance(embed, nn.Module) else unembed, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) else sys.maxsize


def _check_mask(mask: object, input_ids: Tensor) -> None:
    """An ``attention_mask`` of ``input_ids``' shape in which every row has a real token."""
    if mask is None:
        return
    check_tensor("attention_mask", mask, "tokenizer(text, return_tensors='pt').attention_mask")
    assert isinstance(mask, Tensor)
    if mask.shape != input_ids.shape:
        raise ArgumentValueError(f"attention_mask has shape {tuple(mask.shape)}, but input_ids "
                                 f"{tuple(input_ids.shape)}: pass the mask the tokenizer returned "
                                 f"with these ids (one 1 or 0 per token)")
    empty = [i for i, row in enumerate(mask) if not bool(row.any())]
    if empty:
        raise ArgumentValueError(f"attention_mask marks no real token in row{'s' if len(empty) > 1 else ''} "
                                 f"{empty}: every position would be padding; drop those rows or "
                                 f"pass the tokenizer's mask")


def _readout(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The final norm and the unembedding: the standard names ``final_norm`` and ``unembed``
    (a Hugging Face model's ``get_output_embeddings()`` first)."""
    names = index(model)
    get_unembed = getattr(model, "get_output_embeddings", None)
    found = get_unembed() if callable(get_unembed) else None
    paths: dict[str, str] = {}
    for name, what in (("final_norm", "final norm"), ("unembed", "unembedding")):
        if name == "unembed" and isinstance(found, nn.Module):
            return names.modules[paths["final_norm"]], found
        try:
            paths[name] = resolve_standard(names, name)[0][1]
        except SelectorError as err:
            raise CaptureError(f"{type(model).__name__} has no {what} the logit lens can read "
                               f"out through ({err}); load the model with its LM head "
                               f"(AutoModelForCausalLM)") from err
    return names.modules[paths["final_norm"]], names.modules[paths["unembed"]]


def _check_decoder_ids(model: nn.Module, ids: object, seq2seq: bool, input_ids: Tensor) -> None:
    """``decoder_input_ids`` given exactly when the model is an encoder-decoder."""
    if seq2seq and ids is None:
        raise CaptureError(f"{type(model).__name__} is an encoder-decoder: its logits are the "
                           f"decoder's, so the logit lens reads the decoder's blocks during a "
                           f"forward with decoder ids: pass decoder_input_ids=... (e.g. "
                           f"torch.tensor([[model.config.decoder_start_token_id]]))")
    if not seq2seq and ids is not None:
        raise ArgumentValueError(f"decoder_input_ids is for an encoder-decoder (T5, BART ...); "
                                 f"{type(model).__name__} is not one (config.is_encoder_decoder): "
                                 f"leave it out")
    if ids is not None:
        check_tensor("decoder_input_ids", ids, "torch.tensor([[model.config.decoder_start_token_id]])")
        assert isinstance(ids, Tensor)
        check_token_ids("decoder_input_ids", ids, _vocab_size(model, nn.Identity()))
        if ids.dim() != 2 or ids.shape[0] != input_ids.shape[0]:
            raise ArgumentValueError(f"decoder_input_ids has shape {tuple(ids.shape)}: give "
                                     f"(batch, dec_seq) with input_ids' batch of "
                                     f"{input_ids.shape[0]}")


def _patterns(model: nn.Module, layers: str | Sequence[str] | None,
              seq2seq: bool = False) -> list[str]:
    if layers is not None:
        return as_patterns(layers)
    if seq2seq:
        found = decoder_blocks(index(model))
        if found is None:
            raise CaptureError(f"{type(model).__name__}'s decoder blocks were not found: no block "
                               f"list gives the model's own decoder_hidden_states; give the "
                               f"blocks, logit_lens(..., layers='model.decoder.layers.*')")
        return [f"{found[0]}.*"]
    try:
        blocks_of(index(model), "resid_post.*")
    except SelectorError as err:
        raise CaptureError(f"{err}; or give the blocks, logit_lens(..., layers='model.layers.*')") from err
    return ["resid_post.*"]


def _width(unembed: nn.Module) -> int | None:
    weight = getattr(unembed, "weight", None)
    return int(weight.shape[-1]) if isinstance(weight, Tensor) and weight.dim() == 2 else None


def _residual(acts: Any, key: str, hidden: int | None) -> Tensor:
    if acts.counts[key] != 1:
        raise CaptureError(f"'{key}' ran {acts.counts[key]} times in one forward pass; the logit "
                           f"lens reads a block that runs once: select the decoder's blocks")
    value = acts[key]
    value = value[0] if isinstance(value, tuple) and value else value
    if not isinstance(value, Tensor) or value.dim() != 3 or hidden not in (None, value.shape[-1]):
        kind = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise CaptureError(f"'{key}' gives {kind}, not the (batch, seq, {hidden or 'hidden'}) "
                           f"residual stream that the unembedding reads: "
                           f"select the decoder's blocks ('model.layers.*', 'transformer.h.*')")
    return value
