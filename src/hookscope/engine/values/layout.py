"""What a recorded value holds: its batch, token and heads axes, and the attention mask and
KV-cache length of the forward pass that produced it. The one place every verb reads them from.

A ``Layout`` is made by ``layout_of`` from a value's address and shape and the ``Tokens`` of its
forward pass; ``Tokens`` are what a ``MaskWatcher`` (a forward pre-hook on the root module) saw
the model called with. A capture keeps the ``Tokens`` of each call with its record
(``Records.layout``), so a capture used as ``source=`` brings its own mask; an edit reads them
from the forward it is editing.

**Axes.** A module's output is ``(batch, seq, ...)`` by convention (token axis 1);
``scaled_dot_product_attention`` returns ``(batch, heads, query, head_dim)``: tokens on dim 2
(the second to last), heads on dim 1. A value selected with a heads part
(``"...c_attn[heads:8:0/3]"``, what the standard names ``attn.q/k/v.{i}`` resolve to,
``util.nested.heads_part``) is ``(batch, seq, heads, head_dim)``: tokens on dim 1, heads on
dim 2. Any other function's value (``"path::fn"`` addresses) has no known layout and needs
``seq_dim=``; it is refused with its shape named.

**Modules whose tokens are not dim 1.** ``TOKEN_AXES`` is the table of module kinds whose output
is not ``(batch, seq, ...)``, one row each: torch's sequence-first modules
(``nn.MultiheadAttention``, ``nn.Transformer*`` and the RNNs with ``batch_first=False``, the
default) return ``(seq, batch, ...)``; 1-D convolutions, pools and norms return ``(batch,
channels, length)``, tokens last; an RNN's final state ``(layers, batch, hidden)`` has no token
axis and is refused. ``token_axes`` reads the row; every verb gets it through ``layout_of``.

**Mask.** ``Tokens.mask`` is the ``attention_mask`` the model was called with, ``(batch,
past + seq)`` under a KV cache (transformers' ``generate()`` passes it covering the cached
tokens), ``(batch, seq)`` otherwise; ``Layout.mask`` is its last ``seq`` columns, the tokens of
this forward. ``Tokens.past`` is the number of tokens the cache held before this forward: from
the mask's width, else the ``cache_position`` argument, else the cache's ``get_seq_length()``
(``past_key_values``, or ``cache`` in transformers 5).

**Padding without a mask.** ``Tokens.unmasked_padding`` says why the input looks padded though no
mask was given: the model's ``config.pad_token_id`` fills the end (or start) of some rows of a
batch of several rows more than of others. Verbs whose answer depends on padding refuse it
(``check_no_unmasked_padding``); a single row, or rows whose runs of the pad id are alike, is
never refused, and where the pad id is also the model's bos/eos id (GPT-2's often is, and a
prompt may end with it) the runs must differ by two tokens or more.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.errors import PositionError

__all__ = ["Layout", "Tokens", "MaskWatcher", "layout_of", "unmasked_padding", "check_no_unmasked_padding",
           "NO_TOKENS", "AxesRow", "TOKEN_AXES", "token_axes", "batch_first", "stacks"]

Tensor = torch.Tensor

#: functions whose value has a known layout: its token axis is the second to last (the queries
#: of ``(batch, heads, query, head_dim)``), its heads axis dim 1 when it has four dims
QUERY_LAST_BUT_ONE = frozenset({"scaled_dot_product_attention"})
#: a record key ending with a heads part: its value is ``(batch, seq, heads, head_dim)``
HEADS_PART_KEY = re.compile(r"\[heads(?::[^\]]*)?\](?::\d+)?$")


@dataclass(frozen=True)
class Tokens:
    """The tokens of one forward pass as the model was called.

    Attributes:
        mask: the ``attention_mask`` given (``(batch, past + seq)``; nonzero = real token), or
            ``None``.
        past: tokens held by the KV cache before this forward (0 without a cache).
        input_ids: the ``input_ids`` given, kept (by reference) only when there was no mask,
            for ``unmasked_padding``.
        pad_token_id: the model's ``config.pad_token_id``, or ``None``.
        ambiguous: the pad id is also the model's bos/eos id.
    """

    mask: Tensor | None = None
    past: int = 0
    input_ids: Tensor | None = None
    pad_token_id: int | None = None
    ambiguous: bool = False

    @functools.cached_property
    def unmasked_padding(self) -> str:
        """Why the input looks padded without a mask (``unmasked_padding``), or ``""``;
        computed when first asked, not in every forward."""
        if self.mask is not None or self.input_ids is None:
            return ""
        return unmasked_padding(self.input_ids, self.pad_token_id, self.ambiguous)

    @property
    def known(self) -> bool:
        """True when the forward said anything about its tokens (a mask, a cache, token ids
        that may hold padding)."""
        return self.mask is not None or self.past != 0 or self.input_ids is not None


NO_TOKENS = Tokens()


@dataclass(frozen=True)
class Layout:
    """What one value holds: where its batch, tokens and heads are, and which tokens are real.

    Attributes:
        shape: the value's shape.
        seq: the token axis (``1`` for a module's ``(batch, seq, ...)`` output, ``2`` for
            scaled_dot_product_attention's ``(batch, heads, query, head_dim)``).
        heads: the heads axis, or ``None`` when the value has none hookscope knows.
        tokens: the ``Tokens`` of the forward that produced the value.
        batch: the batch axis, always 0.
    """

    shape: tuple[int, ...]
    seq: int
    heads: int | None = None
    tokens: Tokens = NO_TOKENS
    batch: int = 0

    @property
    def rows(self) -> int:
        """The batch size."""
        return int(self.shape[self.batch])

    @property
    def length(self) -> int:
        """The tokens of this forward (the token axis' size)."""
        return int(self.shape[self.seq])

    @property
    def past(self) -> int:
        """Tokens before this forward (a KV cache's); the mask's extra width when it is wider."""
        mask = self.tokens.mask
        if mask is not None and mask.dim() == 2 and mask.shape[1] > self.length:
            return int(mask.shape[1]) - self.length
        return self.tokens.past

    @property
    def mask(self) -> Tensor | None:
        """``(batch, seq)``: the mask of this forward's tokens (the last ``seq`` columns of a
        wider one), or ``None`` when the model was called without one."""
        mask = self.tokens.mask
        if (mask is not None and mask.dim() == 2 and mask.shape[0] == self.rows
                and mask.shape[1] > self.length):
            return mask[:, mask.shape[1] - self.length:]
        return mask

    @property
    def sequence_mask(self) -> Tensor | None:
        """``(batch, past + seq)``: the mask of the whole sequence so far (the cached tokens
        and this forward's), or ``None`` when the model was called without a mask covering
        the cache."""
        mask = self.tokens.mask
        if mask is not None and mask.dim() == 2 and mask.shape[1] == self.past + self.length:
            return mask
        return None


Parts = tuple[int | str, ...]


def _batch_first(module: nn.Module) -> bool:
    """The module's ``batch_first``, or its first ``nn.MultiheadAttention``'s (an
    ``nn.TransformerEncoderLayer`` keeps it there); ``True`` when neither says."""
    found = getattr(module, "batch_first", None)
    if isinstance(found, bool):
        return found
    attention = next((m for m in module.modules() if isinstance(m, nn.MultiheadAttention)), None)
    return True if attention is None else bool(attention.batch_first)


Axes = tuple[int, int | None]


def _sequence_first(module: nn.Module, parts: Parts, dims: int) -> Axes:
    return (0, 1) if _batch_first(module) else (1, 0)


def _attention(module: nn.Module, parts: Parts, dims: int) -> Axes:
    """``(attn_output, attn_weights)``: the weights are ``(batch, [heads,] query, key)`` whatever
    ``batch_first`` says; the output follows it."""
    return (0, dims - 2) if parts[:1] == (1,) else _sequence_first(module, parts, dims)


def _recurrent(module: nn.Module, parts: Parts, dims: int) -> Axes:
    """``(output, h_n)`` or ``(output, (h_n, c_n))``: the output follows ``batch_first``; the
    final state is ``(layers * directions, batch, hidden)`` whatever ``batch_first`` says, one
    vector per row and layer: no token axis."""
    return (1, None) if parts[:1] == (1,) else _sequence_first(module, parts, dims)


def _length_last(module: nn.Module, parts: Parts, dims: int) -> Axes:
    return (0, dims - 1)


@dataclass(frozen=True)
class AxesRow:
    """One kind of module whose output is not ``(batch, seq, ...)``.

    Attributes:
        kind: what the row covers, for messages and tests.
        types: the module classes (subclasses included).
        axes: ``axes(module, parts, dims)`` -> ``(batch axis, token axis)`` of the output part
            ``parts`` (``()``: the output, ``(1,)``: its item 1) with ``dims`` dims; the token
            axis is ``None`` when the value has none (an RNN's final state).
    """

    kind: str
    types: tuple[type[nn.Module], ...]
    axes: Callable[[nn.Module, Parts, int], Axes]


#: the module kinds whose tokens are not dim 1; a new kind is a new row
TOKEN_AXES: tuple[AxesRow, ...] = (
    AxesRow("RNN (seq, batch, hidden) unless batch_first", (nn.RNNBase,), _recurrent),
    AxesRow("nn.MultiheadAttention (seq, batch, d) unless batch_first", (nn.MultiheadAttention,),
            _attention),
    AxesRow("nn.Transformer* (seq, batch, d) unless batch_first",
            (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
             nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), _sequence_first),
    AxesRow("1-D convolution, pool or norm (batch, channels, length)",
            (nn.Conv1d, nn.ConvTranspose1d, nn.MaxPool1d, nn.AvgPool1d, nn.LPPool1d,
             nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d, nn.BatchNorm1d, nn.InstanceNorm1d),
            _length_last),
)


def token_axes(module: nn.Module | None, parts: Parts = (), dims: int = 3) -> Axes:
    """``(batch axis, token axis)`` of part ``parts`` of ``module``'s output, of ``dims`` dims:
    the first ``TOKEN_AXES`` row whose types hold the module, else ``(0, 1)``; the token axis
    is ``None`` when that value has none (an RNN's final state)."""
    if module is not None:
        for row in TOKEN_AXES:
            if isinstance(module, row.types):
                return row.axes(module, parts, dims)
    return (0, 1)


def batch_first(t: Tensor, axes: Axes) -> Tensor:
    """A view of ``t`` as ``(batch, seq, ...)`` (``(batch, ...)`` when it has no token axis),
    ``axes`` its ``(batch, token)`` axes (``token_axes``): how reductions and stores, which read
    dim 0 as the batch and dim 1 as the tokens, see it."""
    batch, seq = axes
    if t.dim() < 2 or axes == (0, 1):
        return t
    return t.movedim(batch, 0) if seq is None else t.movedim((batch, seq), (0, 1))


def layout_of(key: str, op: str | None, shape: Sequence[int], seq_dim: int | None = None, *,
              heads: bool = False, tokens: Tokens = NO_TOKENS, module: nn.Module | None = None,
              parts: Parts = ()) -> Layout:
    """The layout of the value recorded as ``key``, of ``shape``.

    Args:
        key: the record name, for messages (``"h.0.attn::scaled_dot_product_attention"``).
        op: the function of a ``"path::fn"`` address (``"softmax#1"``), ``None`` for a module.
        shape: the value's shape.
        seq_dim: the token axis given by the user (negative counts from the end); wins.
        heads: the caller selects heads, so the value must have a heads axis.
        tokens: the forward's mask and cache length (``MaskWatcher.tokens``,
            ``Records.tokens``).
        module: the module whose output (part ``parts``) the value is, for its ``TOKEN_AXES``
            row (``None``: a ``(batch, seq, ...)`` output).
        parts: the keys of the value inside the module's output (``(1,)``: its item 1).

    Raises:
        PositionError: ``seq_dim`` is the batch axis or out of range; ``op`` is a function whose
            layout hookscope does not know and no ``seq_dim`` is given; the module's value has
            no token axis (an RNN's final state); ``heads`` and the value has no heads axis
            (the message names the shape and the fix).
    """
    dims, size = len(shape), tuple(int(s) for s in shape)
    batch, seq = token_axes(module if op is None else None, parts, dims)
    known = op is not None and op.split("#")[0] in QUERY_LAST_BUT_ONE and dims >= 3
    head_axis = 1 if known and dims == 4 else None
    if op is None and dims == 4 and HEADS_PART_KEY.search(key):
        head_axis = 2
    if seq_dim is not None:
        if not -dims <= seq_dim < dims or seq_dim % dims == batch:
            raise PositionError(f"seq_dim={seq_dim} is not a token axis of '{key}', shape "
                                f"{size}: give a dim in 0 … {dims - 1} other than {batch}, "
                                f"the batch")
        layout = Layout(size, seq_dim % dims, head_axis, tokens, batch)
    elif known:
        layout = Layout(size, dims - 2, head_axis, tokens)
    elif op is None:
        if seq is None:
            raise PositionError(
                f"'{key}', shape {size}, has no token axis: dim {batch} is the batch and no "
                f"other dim holds tokens ({type(module).__name__}'s final state, one vector per "
                f"row and layer); select the part that holds the tokens, e.g. "
                f"'{key.split('[')[0]}[0]'")
        if dims < 3:  # (batch, features): dim 1 is features, as reduce="first" refuses it
            raise PositionError(
                f"positions index the token axis, dim 1 of a (batch, seq, ...) module output, but "
                f"'{key}' has shape {size}, without one (dim 1 of a (batch, features) "
                f"output is features, not tokens); select a module that returns (batch, seq, "
                f"features), or give seq_dim=1 if dim 1 really holds the tokens")
        layout = Layout(size, seq, head_axis, tokens, batch)
    else:
        raise PositionError(
            f"positions on '{key}': it is the value of the function {op.split('#')[0]}, shape "
            f"{size}, and hookscope knows the token axis only of module outputs ((batch, "
            f"seq, ...)) and of scaled_dot_product_attention ((batch, heads, query, head_dim)); "
            f"give seq_dim=N, the axis that holds the tokens")
    if heads and layout.heads is None:
        path = key.split("::")[0].split("[")[0]  # the module, without parts
        raise PositionError(
            f"heads= on '{key}', shape {size}: this value has no heads axis (the heads "
            f"of an attention module's output are already mixed); select the attention's "
            f"'{path}::scaled_dot_product_attention', shape (batch, heads, query, head_dim)")
    return layout


def unmasked_padding(input_ids: Any, pad_token_id: Any, ambiguous: bool = False) -> str:
    """Why ``input_ids`` ``(batch, seq)`` looks padded with ``pad_token_id``: the runs of it at
    the end (or start) of the rows differ in length, as a tokenizer pads a batch to one length;
    ``""`` when it does not (one row; no pad id; runs alike in every row).

    ``ambiguous``: the pad id is also a real token the model uses (its ``bos``/``eos`` id, as
    GPT-2's pad id often is), so one such token at a row's end may be real: the runs must then
    differ by two or more.
    """
    if (not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[0] < 2
            or input_ids.is_floating_point() or not isinstance(pad_token_id, int)
            or isinstance(pad_token_id, bool)):
        return ""
    pad = (input_ids == pad_token_id).int()
    for side, flip in (("right", True), ("left", False)):
        ends = pad.flip(1) if flip else pad
        runs = ends.cumprod(dim=1).sum(dim=1)  # padding tokens at that end of each row
        if int(runs.max() - runs.min()) >= (2 if ambiguous else 1):
            rows = (runs > runs.min()).nonzero().flatten().tolist()
            return (f"input_ids has runs of the pad token id {pad_token_id} (config.pad_token_id) "
                    f"at the {'end' if flip else 'start'} of row{'s' if len(rows) > 1 else ''} "
                    f"{rows[:8]} longer than in the others: a {side}-padded batch")
    return ""


def check_no_unmasked_padding(tokens: Tokens, what: str, *, positions: bool = True) -> None:
    """Refuse a forward whose input looks padded but was given no attention mask, for ``what``
    (a verb whose answer depends on which tokens are real); ``positions``: ``what`` takes
    ``positions=``, so ``absolute=True`` is a fix too.

    Raises:
        PositionError: ``tokens.unmasked_padding`` is set; the message says how to fix it.
    """
    if tokens.unmasked_padding and tokens.mask is None:
        raise PositionError(
            f"{what} depends on which tokens are real, but {tokens.unmasked_padding}, and no "
            f"attention_mask was given, so padding would count as tokens: pass the tokenizer's "
            f"attention_mask (model(input_ids, attention_mask=mask))"
            f"{', or absolute=True to index the token axis as it is' if positions else ''}")


class MaskWatcher:
    """Keeps the ``Tokens`` of the running forward pass: those the root module was called with,
    then, in an encoder-decoder model, those of each stack as it starts.

    Register ``watcher.hook`` as a forward pre-hook with ``with_kwargs=True`` on each of
    ``watcher.modules``: the root, and the stacks of an encoder-decoder model (``get_encoder()``,
    ``get_decoder()``: T5, BART, Whisper), whose decoder runs on tokens of its own, with its own
    mask (``decoder_attention_mask``, handed to it as ``attention_mask``) or none; the
    decoder's tokens hold from its start to the end of the forward (``lm_head`` included). The
    mask is read by name (``attention_mask``) whether passed by keyword or by position, the
    cache length from ``cache_position`` or ``past_key_values``, the padding from
    ``input_ids`` and ``config.pad_token_id``. ``tokens.mask`` is ``None`` when the call has no
    mask. An explicit mask given at construction wins.
    """

    def __init__(self, model: nn.Module, given: Tensor | None = None):
        self.given = given
        self.tokens = Tokens(given)
        self.modules = [(path, module) for path, module in stacks(model)]
        self._index = _positional_index(model, "attention_mask")
        self._indices = {id(m): (_positional_index(m, "attention_mask"), _positional_index(m, "input_ids"))
                         for _, m in self.modules}
        config = getattr(model, "config", None)
        self._pad = getattr(config, "pad_token_id", None)
        self._ambiguous = self._pad is not None and self._pad in (
            getattr(config, "bos_token_id", None), getattr(config, "eos_token_id", None))

    @property
    def current(self) -> Tensor | None:
        """The mask of the running forward (``tokens.mask``)."""
        return self.tokens.mask

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask_index, ids_index = self._indices.get(id(module), (self._index, None))
        found = self.given
        if found is None:
            found = _argument(args, kwargs, "attention_mask", mask_index)
        mask = found if isinstance(found, Tensor) else None
        ids = None
        if mask is None and self._pad is not None:
            given = _argument(args, kwargs, "input_ids", ids_index)
            ids = given if isinstance(given, Tensor) and given.dim() == 2 else None
        self.tokens = Tokens(mask, _past(kwargs), ids, self._pad, self._ambiguous)

    @property
    def find(self) -> Callable[..., Tensor | None]:
        """``find(module, args, kwargs)``: the mask of the call, or None: what a compiled graph
        passes out of the root's pre-hook (``engine.compile.graph``) to ``set``. One function per
        position of ``attention_mask`` (``_finding``), so the blocks of several threads on one
        model hook its root with one shared entry (``sharing.ModuleHooks``)."""
        return _finding(self._index)

    def set(self, mask: Tensor | None) -> None:
        """Make ``Tokens(mask)`` (the mask given at construction, when one was) the running
        forward's: a compiled call's mask, ``find``."""
        self.tokens = Tokens(mask if self.given is None else self.given)

    def layout(self, key: str, op: str | None, shape: Sequence[int], seq_dim: int | None = None,
               *, heads: bool = False, module: nn.Module | None = None, parts: Parts = ()) -> Layout:
        """``layout_of`` a value of the running forward."""
        return layout_of(key, op, shape, seq_dim, heads=heads, tokens=self.tokens, module=module,
                         parts=parts)

    def mask_for(self, shape: Sequence[int]) -> Tensor | None:
        """The mask of a ``(batch, seq, ...)`` output of the running forward (``Layout.mask``)."""
        if len(shape) < 2:
            return self.tokens.mask
        return Layout(tuple(int(s) for s in shape), 1, None, self.tokens).mask


def stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(path, module)]``: the root (``""``) and the encoder and decoder stacks of an
    encoder-decoder model (``get_encoder()``/``get_decoder()``, submodules of the root that are
    not it), whose calls each say which tokens run in them (``MaskWatcher``)."""
    found = [("", model)]
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return found  # one stack: no walk of every module (a capture builds one per block)
    paths = {id(m): path for path, m in model.named_modules()}
    for name in ("get_encoder", "get_decoder"):
        getter = getattr(model, name, None)
        try:
            stack = getter() if callable(getter) else None
        except (TypeError, AttributeError, NotImplementedError):
            continue
        if isinstance(stack, nn.Module) and stack is not model and id(stack) in paths:
            found.append((paths[id(stack)], stack))
    return found


@functools.cache
def _finding(index: int | None) -> Callable[..., Tensor | None]:
    """``MaskWatcher.find`` for a model taking ``attention_mask`` at position ``index``."""
    def find(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
        found = _argument(args, kwargs, "attention_mask", index)
        return found if isinstance(found, Tensor) else None
    return find


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, index: int | None) -> Any:
    found = kwargs.get(name)
    if found is None and index is not None and len(args) > index:
        found = args[index]
    return found


def _past(kwargs: dict[str, Any]) -> int:
    """Tokens a KV cache held before this forward: ``cache_position[0]`` (transformers 4 passes
    it from ``generate()``), else the ``get_seq_length()`` of ``past_key_values`` (4) or
    ``cache`` (5); 0 without either."""
    position = kwargs.get("cache_position")
    if isinstance(position, Tensor) and position.numel():
        return int(position.flatten()[0])
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 4 / 5 names
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        try:
            return int(length())
        except (TypeError, ValueError, RuntimeError):
            return 0
    return 0


def _positional_index(model: nn.Module, name: str) -> int | None:
    """The position of parameter ``name`` in ``model.forward``'s positional arguments, or None.
    Read once per forward function (``_parameters``): ``inspect.signature`` cost a block
    about as much as registering its hooks (``python -m bench.dispatch``, per capture)."""
    forward = model.forward
    try:
        names = _parameters(getattr(forward, "__func__", forward), hasattr(forward, "__func__"))
    except TypeError:  # an unhashable callable: asked as it is
        names = _signature_names(forward)
    return names.index(name) if name in names else None


@functools.lru_cache(maxsize=256)
def _parameters(function: Callable[..., Any], bound: bool) -> tuple[str, ...]:
    """The parameter names of ``forward`` (the function of a bound method, ``bound``: without
    its ``self``), once per function."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return ()
    if bound and parameters:  # as inspect binds a method: its first positional parameter goes
        if parameters[0].kind == inspect.Parameter.KEYWORD_ONLY:
            return ()  # inspect refuses such a method (ValueError): no position, as before
        if parameters[0].kind != inspect.Parameter.VAR_POSITIONAL:
            parameters = parameters[1:]
    return tuple(p.name for p in parameters)


def _signature_names(function: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()
