"""Capture around ``model.generate()``: every record labelled with its generation step and the
token positions it covers, and one layer's activations aligned with the generated sequence.

``generate()`` calls the model once per new token. With a KV cache, step 0 runs the prompt
(positions ``0 … prompt-1``) and each later step runs only the newest token; without a cache,
every step runs the whole sequence so far again. Each forward of the root module is one step;
its positions are read from the root's inputs: the columns ``[stop - length, stop)`` where
``length`` is the number of tokens fed (``input_ids`` or ``inputs_embeds``, dim 1) and ``stop``
the width of the ``attention_mask`` given (the sequence so far); without a mask, a step feeding
more tokens than were seen starts again at 0 (no cache), else it continues after them.

The aligned view keeps, for each position, the value of the first step that computed it, so a
cache gives no duplicates and a run without a cache gives the same rows. The last generated token
is returned by ``generate()`` but never fed to the model, so ``len(sequence) - 1`` positions have
activations. This is the per-token view asked for in TransformerLens #697/#889 and vLLM #5406.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from hookscope.engine import (
    Observer,
    OnUnfired,
    Target,
    check_options,
    flat_patterns,
    layout_of,
    release_signals,
    same_values,
    unwrap,
)
from hookscope.errors import CaptureError
from hookscope.record.captures import Capture
from hookscope.record.positions import tokens_first
from hookscope.record.verbs import capture, capture_options
from hookscope.util import check_new_file, write_atomic

__all__ = ["Step", "GenerationRecord", "GenerationCapture", "capture_generation"]

Tensor = torch.Tensor
CACHE_KEYS = ("cache", "past_key_values", "past_key_value")  # transformers 5's name, then older


@dataclass(frozen=True)
class Step:
    """One forward of the root during generation: it fed positions ``start … stop-1``.

    Attributes:
        index: the step, from 0 (the prompt) in call order.
        start, stop: the columns of the generated sequence that this forward computed.
        token_ids: ``(batch, stop - start)`` int64, the tokens fed (``None`` for embeddings).
        kept: the positions the KV cache held when the step began (``None``: no cache object
            seen); fewer than an earlier step computed means generate() cropped the cache
            (assisted decoding rejected candidates), and those positions are recomputed here.
    """

    index: int
    start: int
    stop: int
    token_ids: Tensor | None
    kept: int | None = None


@dataclass(frozen=True)
class GenerationRecord:
    """One call of a selected module: its step, the positions it covers, and its output."""

    step: int
    start: int
    stop: int
    value: Any


class GenerationCapture:
    """A ``Capture`` whose calls are labelled with generation steps; see ``capture_generation``.

    Attributes:
        capture: the underlying ``Capture`` (every call, as ``hookscope.capture`` keeps them).
        steps: one ``Step`` per forward of the root, in order.
    """

    def __init__(self, model: nn.Module, layers: tuple[str, ...], on_unfired: OnUnfired,
                 options: dict[str, Any]):
        check_options("options", options, capture_options() - {"on_unfired"})
        self.capture: Capture = capture(model, *layers, on_unfired=on_unfired, **options)
        self.steps: list[Step] = []
        self._step_of_call: dict[str, list[int]] = {t.key: [] for t in self.capture.targets}
        self._labels = _StepLabels(self, self.capture.targets)
        self._seen = 0
        self._fingerprint: Tensor | None = None
        self._reordered: int | None = None  # the step at which rows changed places (beams)
        self._strategy = ""  # the beam search generate() runs, read from the call stack
        self.encoder_length: int | None = None

    def __enter__(self) -> GenerationCapture:
        # the labels first: their hooks run before the capture's, so before an early stop.
        # an exception anywhere, a KeyboardInterrupt included, leaves neither session entered;
        # leaving a session never entered does nothing.
        try:
            self._labels.__enter__()
            self.capture.__enter__()
            release_signals()  # a signal held back so far: a failed entry
        except BaseException as exc:
            try:
                self._abort(exc)
            finally:
                release_signals()  # one held back while the entry was undone
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        try:
            return self._leave(exc_type, exc, tb)
        except BaseException as error:
            self._abort(error)  # what an exception in the first exit left (exits are idempotent)
            raise
        finally:
            release_signals()  # a signal held back during the exit surfaces here

    def _leave(self, exc_type: type[BaseException] | None, exc: BaseException | None,
               tb: TracebackType | None) -> bool | None:
        stopped = self.capture.__exit__(exc_type, exc, tb)  # True: our early stop ended the block
        self._labels.__exit__(*((None, None, None) if stopped else (exc_type, exc, tb)))
        return stopped

    def _abort(self, exc: BaseException) -> None:
        self.capture.__exit__(type(exc), exc, exc.__traceback__)
        self._labels.__exit__(type(exc), exc, exc.__traceback__)

    def _label(self, target: Target) -> Callable[..., None]:
        calls, steps = self._step_of_call[target.key], self.steps

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            calls.append(len(steps) - 1)
        return hook

    def _on_step(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        decoder = kwargs.get("decoder_input_ids", kwargs.get("decoder_inputs_embeds"))
        fed: Any
        if isinstance(decoder, Tensor):  # an encoder-decoder: the decoder's sequence is generated
            fed, mask = decoder, kwargs.get("decoder_attention_mask")
            self.encoder_length = _encoder_length(kwargs.get("encoder_outputs"))
        else:
            fed = kwargs.get("input_ids", args[0] if args else None)
            if not isinstance(fed, Tensor):
                fed = kwargs.get("inputs_embeds")
            mask = kwargs.get("attention_mask")
        if not isinstance(fed, Tensor) or fed.dim() < 2:
            raise CaptureError(
                "capture_generation needs the root called as generate() calls it: with input_ids "
                "or inputs_embeds (a decoder-only model), or decoder_input_ids (an "
                "encoder-decoder) of shape (batch, seq, ...); call model.generate(...) inside "
                "the block, or capture() a forward of your own")
        length = int(fed.shape[1])
        cache = next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
        kept = _cache_length(cache)
        if kept is not None and kept > self._seen:
            kept = None  # a cache holding more than was fed (a looped block caches twice): unread
        if isinstance(mask, Tensor) and mask.dim() == 2:
            stop = int(mask.shape[1])
        elif kept is not None:
            stop = kept + length
        else:
            stop = length if length > self._seen else self._seen + length
        self._seen = max(self._seen, stop)
        ids = fed.detach().clone() if not fed.is_floating_point() else None
        if not self.steps and (strategy := _beam_strategy()) is not None:
            self._reordered, self._strategy = 0, strategy
        self._watch_rows(cache, ids, stop - length)
        self.steps.append(Step(len(self.steps), stop - length, stop, ids, kept))

    def _watch_rows(self, cache: Any, ids: Tensor | None, start: int) -> None:
        """Note the first step at which the rows changed places: the cache's earlier positions
        (or, without a cache, the tokens fed again) differ from what that row held before, as
        beam search's reordering makes them."""
        if self._reordered is not None:
            return
        now = _fingerprint(cache)
        before = self._fingerprint
        if now is not None and before is not None and now.shape[0] == before.shape[0]:
            width = min(before.shape[1], now.shape[1])
            if not same_values(before[:, :width], now[:, :width], tolerance=1e-4):
                self._reordered = len(self.steps)
        if now is None and ids is not None and start == 0 and self.steps:
            fed_before = self.token_ids_so_far()
            width = min(fed_before.shape[1], ids.shape[1])
            if fed_before.shape[0] != ids.shape[0] or not torch.equal(
                    fed_before[:, :width], ids[:, :width].cpu()):
                self._reordered = len(self.steps)
        self._fingerprint = now

    def token_ids_so_far(self) -> Tensor:
        """``token_ids()`` of the steps seen so far, without the checks."""
        return _ids_of(self.steps)

    def records(self, path: str) -> list[GenerationRecord]:
        """Every call of ``path`` with its step and positions, in call order.

        Raises:
            CaptureError: as ``Capture.calls``.
        """
        values = self.capture.calls(path)
        return [GenerationRecord(step, *((self.steps[step].start, self.steps[step].stop)
                                         if step >= 0 else (0, _width(value))), value)
                for step, value in zip(self._step_of_call[path], values)]

    def encoder(self, path: str) -> Any:
        """The output of ``path`` from the encoder's one run, which an encoder-decoder's
        ``generate()`` makes itself before the first decoding step: ``(batch, source
        positions, ...)``, over the source tokens, not the generated sequence.

        Raises:
            CaptureError: ``path`` did not run before the first decoding step exactly once.
        """
        before = [r.value for r in self.records(path) if r.step < 0]
        if len(before) != 1:
            raise CaptureError(f"'{path}' ran {len(before)} times before the first decoding step, "
                               f"not once: it is not an encoder module of this generate() call; "
                               f"read it with aligned('{path}')")
        return before[0]

    def aligned(self, path: str, *, seq_dim: int | None = None) -> Tensor:
        """``path``'s output at every position of the sequence: ``(batch, positions, ...)``.

        Row ``t`` (dim 1) is the output at the ``t``-th token of the sequence ``generate()``
        returned (prompt tokens first, then one per generated token, except the last generated
        token, never fed); ``positions = len(sequence) - 1`` for a prompt without padding. Each
        position comes from the first step that computed it (no duplicates from the cache).

        The tokens are taken from the value's token axis, as ``positions=`` does
        (``engine.values.layout.layout_of``): dim 1 of a module output ``(batch, seq, ...)``; the
        query axis of ``"...::scaled_dot_product_attention"``, whose ``(batch, heads, query,
        head_dim)`` value is returned as ``(batch, positions, heads, head_dim)``.

        Args:
            path: a selected path (``"transformer.h.1"``, ``"transformer.h.0.attn::
                scaled_dot_product_attention"``, ``"layer[0]"``).
            seq_dim: the token axis of the recorded value (negative counts from the end);
                ``None``: the known layout above. Needed for a function whose layout hookscope
                does not know.

        Raises:
            CaptureError: ``path`` never ran; its output is not a tensor whose token axis
                holds the tokens fed (select a tensor part, e.g. ``"layer[0]"``); the batch
                changed between steps (beam search).
            PositionError: as ``layout_of``: ``seq_dim`` is out of range or the batch axis;
                ``path`` is a function of unknown layout and ``seq_dim`` is not given.
        """
        records = self.records(path)
        if not records:
            raise CaptureError(f"'{path}' recorded nothing during generation")
        self._check_aligned(path, records)
        steps = [r.step for r in records if r.step >= 0]
        repeated = next((step for step in steps if steps.count(step) > 1), None)
        if repeated is not None:
            raise CaptureError(
                f"'{path}' ran {steps.count(repeated)} times in step {repeated} (a block the "
                f"model loops over, or a module it reuses): one row per position cannot say "
                f"which call it holds; read each call with records('{path}')")
        first = records[0].value
        width = max(r.stop for r in records)
        out: Tensor | None = None
        filled = 0
        op = next((t.op for t in self.capture.targets if t.key == path), None)
        for record in (r for r in records if r.step >= 0):  # encoder calls: encoder()
            value = _fed_tokens(path, _tokens_at_dim1(path, op, record, seq_dim), self.encoder_length)
            kept = self.steps[record.step].kept
            filled = filled if kept is None else min(filled, kept)
            if out is None:
                out = first.new_zeros((value.shape[0], width, *value.shape[2:]))
            if value.shape[0] != out.shape[0] or value.shape[2:] != out.shape[2:]:
                raise CaptureError(f"'{path}' changed shape between steps ({tuple(out.shape)} "
                                   f"vs {tuple(value.shape)}); beam search reorders the batch, "
                                   f"so align greedy or sampled generation only")
            if record.stop > filled:  # positions first computed in this step
                new = max(filled, record.start)
                out[:, new:record.stop] = value[:, new - record.start:]
                filled = record.stop
        assert out is not None
        return out

    def token_ids(self) -> Tensor:
        """The tokens fed at every position, ``(batch, positions)`` int64, aligned as ``aligned``:
        the returned sequences but their last token (an encoder-decoder's: the decoder's).

        Raises:
            CaptureError: the model was fed embeddings, not token ids; the rows changed places
                during generation (beam search).
        """
        if not self.steps or any(s.token_ids is None for s in self.steps):
            raise CaptureError("the model was fed inputs_embeds, so there are no token ids")
        self._check_aligned("token_ids", [])
        return _ids_of(self.steps)

    def _check_aligned(self, path: str, records: list[GenerationRecord]) -> None:
        """Refuse what cannot be aligned with the returned sequences (``aligned``)."""
        if self._reordered is not None:
            why = (f"generate() runs {self._strategy}, whose rows are beams: each step reorders "
                   f"them and the KV cache, and it returns the best beams only"
                   if self._strategy else
                   f"the batch's rows changed places at step {self._reordered} (beam search, "
                   f"group or constrained beam search reorder their beams and the KV cache each "
                   f"step)")
            raise CaptureError(
                f"'{path}': {why}, so row r of a step is not row r of the returned sequences and "
                f"nothing can be aligned with them: use records('{path}') for each step's raw "
                f"calls, or generate with num_beams=1 (greedy, sampling, assisted decoding align)")
        if records and all(r.step < 0 for r in records):
            raise CaptureError(
                f"'{path}' ran only before the first decoding step: it is the encoder, which an "
                f"encoder-decoder's generate() runs once over the source tokens; its rows are "
                f"the source's, not the generated sequence's: read encoder('{path}')")

    def save(self, file: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write every selected path's ``aligned`` activations and ``token_ids`` to one
        safetensors file, atomically; the steps go in the metadata (``hookscope.steps``: JSON
        ``[[index, start, stop], ...]``). Read it back with ``safetensors.torch.load_file``.

        Raises:
            OutputExistsError: ``file`` exists and ``overwrite`` is False, or is a folder.
            CaptureError: as ``aligned`` and ``token_ids``.
        """
        file = check_new_file(file, overwrite=overwrite, example="generated.safetensors")
        tensors = {t.key: self.aligned(t.key).detach().cpu().contiguous() for t in self.capture.targets}
        tensors["token_ids"] = self.token_ids()
        steps = json.dumps([[s.index, s.start, s.stop] for s in self.steps])
        write_atomic(file, lambda tmp: save_file(tensors, tmp, metadata={"hookscope.steps": steps}))


class _StepLabels(Observer):
    """The step-labelling hooks of a ``GenerationCapture``, with a session's life cycle: a
    forward pre-hook on the root starts a step, a hook after each call of a selected module
    (or function call, for a ``path::fn`` target) notes its step."""

    def __init__(self, generation: GenerationCapture, targets: list[Target]):
        super().__init__(generation.capture.model, targets, forward=generation._label,
                         explain_unfired=False)
        self._on_step = generation._on_step

    def _register(self) -> None:
        self._hook(unwrap(self.model)[0], self._on_step, pre=True, with_kwargs=True)
        super()._register()


def _tokens_at_dim1(path: str, op: str | None, record: GenerationRecord,
                    seq_dim: int | None) -> GenerationRecord:
    """``record`` with its value's token axis moved to dim 1 (heads, if any, to dim 2)."""
    value = record.value
    if not isinstance(value, Tensor) or (op is None and seq_dim is None):
        return record
    return replace(record, value=tokens_first(value, layout_of(path, op, value.shape, seq_dim)))


def _beam_strategy() -> str | None:
    """The beam search (``_beam_search``, the hub's group or constrained beam search) that the
    running ``generate()`` called, read from the call stack; None for any other caller."""
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        name = frame.f_code.co_name
        if "beam_search" in name or "beam_sample" in name:
            return f"{name} (num_beams > 1)"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _ids_of(steps: list[Step]) -> Tensor:
    """The token ids of ``steps`` aligned as ``GenerationCapture.aligned`` aligns values."""
    if not steps or steps[0].token_ids is None:
        return torch.zeros(0, 0, dtype=torch.long)
    width = max(s.stop for s in steps)
    ids = torch.zeros(steps[0].token_ids.shape[0], width, dtype=torch.long)
    filled = 0
    for step in steps:
        filled = filled if step.kept is None else min(filled, step.kept)
        if step.stop > filled and step.token_ids is not None:
            new = max(filled, step.start)
            ids[:, new:step.stop] = step.token_ids[:, new - step.start:].cpu()
            filled = step.stop
    return ids


def _width(value: Any) -> int:
    return int(value.shape[1]) if isinstance(value, Tensor) and value.dim() >= 2 else 0


def _cache_length(cache: Any) -> int | None:
    """The positions a transformers ``Cache`` holds (``get_seq_length()``), else None."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return None
    try:
        return int(length())
    except (TypeError, ValueError, AttributeError, IndexError):
        return None


def _fingerprint(cache: Any) -> Tensor | None:
    """``(batch, positions)``: the first layer's cached keys summed per row and position (a
    row's history); None without a cache whose keys can be read."""
    inner = getattr(cache, "self_attention_cache", cache)
    layers = getattr(inner, "layers", None)
    keys = getattr(layers[0], "keys", None) if isinstance(layers, (list, tuple)) and layers else None
    if not isinstance(keys, Tensor) or keys.dim() != 4 or keys.numel() == 0:
        return None
    return keys.detach().float().sum(dim=(1, 3)).cpu()


def _encoder_length(outputs: Any) -> int | None:
    """The source positions of ``encoder_outputs`` (its first tensor's dim 1)."""
    first = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else \
        getattr(outputs, "last_hidden_state", None)
    return int(first.shape[1]) if isinstance(first, Tensor) and first.dim() >= 2 else None


def _fed_tokens(path: str, record: GenerationRecord, encoder_length: int | None = None) -> Tensor:
    value = record.value
    fed = record.stop - record.start
    if isinstance(value, Tensor) and value.dim() >= 2 and encoder_length is not None \
            and value.shape[1] == encoder_length != fed:
        raise CaptureError(
            f"'{path}' returned {tuple(value.shape)} at step {record.step}: its token axis holds "
            f"the encoder's {encoder_length} source positions (cross-attention keys and values, "
            f"computed once from the encoder's output and read from the cache afterwards), not "
            f"the decoder's sequence: read them with records('{path}')[0].value")
    if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] < fed:
        raise CaptureError(
            f"'{path}' returned {tuple(value.shape)} at step {record.step}, which fed {fed} "
            f"tokens: it ran on the last {value.shape[1]} token(s) only, as generate() computes "
            f"logits for the last token (logits_to_keep), so there is nothing to align for the "
            f"others. For per-token values capture the final norm (e.g. 'transformer.ln_f') and "
            f"apply the head yourself, or pass logits_to_keep=0 to generate() for every "
            f"position's logits")
    if not isinstance(value, Tensor) or value.dim() < 2 or value.shape[1] != fed:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise CaptureError(f"'{path}' returned {shape} at step {record.step}, which fed "
                           f"{record.stop - record.start} tokens: align a (batch, seq, ...) tensor "
                           f"output (select a tuple's tensor with a part, e.g. '{path}[0]')")
    return value


def capture_generation(model: nn.Module, *layers: str | Sequence[str], on_unfired: OnUnfired = "warn",
                       **options: Any) -> GenerationCapture:
    """Capture selected modules across ``model.generate()``, labelled by step and positions.

    ```python
    with hookscope.capture_generation(model, "transformer.h.1") as gen:
        sequences = model.generate(ids, max_new_tokens=5)
    gen.aligned("transformer.h.1")   # (batch, len(sequence) - 1, d_model)
    gen.token_ids()                  # (batch, len(sequence) - 1): the tokens at those rows
    gen.save("generated.safetensors")  # both, for every selected path
    ```

    Enter it around one ``generate()`` call (steps count the root's forwards since entry).

    Args:
        model: a causal LM whose ``forward`` takes ``input_ids`` (or ``inputs_embeds``) and an
            ``attention_mask``, as transformers' ``generate()`` calls it, with or without cache.
        *layers: patterns of the modules to capture (see ``hookscope.capture``).
        on_unfired: as in ``capture``.
        **options: keyword options of ``capture`` (``to``, ``dtype``, ``clone``, ...).

    Returns:
        A ``GenerationCapture``.

    Raises:
        SelectorError: a pattern matches no module (at once).
        ArgumentValueError: a keyword that is not an option of ``capture`` (at once).
        CaptureError: during generation, the root was called without token inputs.
    """
    return GenerationCapture(model, tuple(flat_patterns(layers)), on_unfired, options)
