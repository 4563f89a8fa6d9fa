"""One architecture through hookscope's verbs, each checked against the model's own values.

Every cell is one of:

- ``equal``: hookscope's value equals what the model itself computed (its ``hidden_states``,
  its log-probabilities, the sequences ``generate()`` returned and a teacher-forced forward over
  them, a plain ``register_forward_hook``'s value), within ``TOLERANCE``;
- ``refused``: hookscope raised a ``HookscopeError`` (its message is the reason);
- ``silent``: hookscope returned a value that differs from the model's: the defect the zoo hunts;
- ``crash``: hookscope raised something that is not a ``HookscopeError``;
- ``n/a``: the model itself cannot do it (no hidden states, no logits, ``generate()`` raises
  without hookscope), with the reason.

The oracles below are written with plain torch hooks and the model's own outputs, never with
hookscope's resolution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import hookscope
from hookscope.errors import HookscopeError

VERBS = ("names", "capture", "lens", "greedy", "sample", "beam", "attention", "patch", "steer", "eap")
TOLERANCE = 1e-4
PROMPT = 6


@dataclass(frozen=True)
class Cell:
    """One verb on one architecture: ``status`` (module docstring) and a short ``reason``."""

    status: str
    reason: str = ""


class NotApplicable(Exception):
    """The model itself cannot do what the verb needs."""


def run_cells(model: nn.Module, kind: str, verbs: tuple[str, ...] = VERBS) -> dict[str, Cell]:
    """``{verb: Cell}`` for ``model`` (built by ``tests.zoo.build``)."""
    try:
        feed = _inputs(model)
    except Exception as exc:  # noqa: BLE001 - the zoo cannot make this model's input
        return dict.fromkeys(verbs, Cell("n/a", f"no input made for it: {_short(str(exc))}"))
    cells = {}
    for verb in verbs:
        cells[verb] = _cell(lambda verb=verb: CHECKS[verb](model, kind, feed))  # type: ignore[misc]
    return cells


def _cell(check: Callable[[], bool]) -> Cell:
    try:
        with _quiet():
            equal = check()
    except NotApplicable as exc:
        return Cell("n/a", str(exc))
    except HookscopeError as exc:
        return Cell("refused", _short(f"{type(exc).__name__}: {exc}"))
    except Exception as exc:  # noqa: BLE001 - every other failure is hookscope's crash
        return Cell("crash", _short(f"{type(exc).__name__}: {exc}"))
    return Cell("equal") if equal else Cell("silent", "differs from the model's own value")


def _short(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line[:160]


@contextlib.contextmanager
def _quiet() -> Any:
    import warnings

    from transformers.utils import logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)


# ----------------------------------------------------------------------------- inputs


def _inputs(model: nn.Module) -> dict[str, Any]:
    config = model.config  # type: ignore[union-attr]
    main = getattr(model, "main_input_name", "input_ids")
    generator = torch.Generator().manual_seed(1)
    if main == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
        return {"pixel_values": torch.randn(1, getattr(vision, "num_channels", 3), size, size,
                                            generator=generator)}
    embed = model.get_input_embeddings()  # type: ignore[operator]
    vocab = int(getattr(embed, "num_embeddings", 0) or config.vocab_size)
    ids = torch.randint(min(5, vocab - 1), vocab, (1, PROMPT), generator=generator)
    feed: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        feed["decoder_input_ids"] = ids[:, :4]
    return feed


def _plain_forward(model: nn.Module, feed: dict[str, Any]) -> tuple[Any, dict[str, list[Any]]]:
    """The model's output (with hidden states) and every module's outputs and inputs, by plain
    torch forward hooks: ``{path: [(first input tensor, first output tensor) per call]}``."""
    seen: dict[str, list[Any]] = {}
    handles = []
    for path, module in model.named_modules():
        def hook(m: nn.Module, args: Any, out: Any, path: str = path) -> None:
            first_in, first_out = _first(args), _first(out)  # copies: later in-place writes
            seen.setdefault(path, []).append((None if first_in is None else first_in.clone(),
                                              None if first_out is None else first_out.clone()))
        handles.append(module.register_forward_hook(hook))  # the oracle: not hookscope's door
    try:
        with torch.no_grad():
            output = model(**feed, output_hidden_states=True, return_dict=True)
    except Exception as exc:  # noqa: BLE001
        raise NotApplicable(f"the model's own forward raised {type(exc).__name__}") from exc
    finally:
        for handle in handles:
            handle.remove()
    return output, seen


def _first(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            if (found := _first(item)) is not None:
                return found
    return None


def _same(a: Any, b: Any) -> bool:
    a, b = _first(a), _first(b)
    if a is None or b is None or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    scale = max(float(b.abs().max()), 1.0) if b.numel() else 1.0
    return bool(((a.float() - b.float()).abs() <= TOLERANCE * scale).all())


# ----------------------------------------------------------------------------- the verbs


def _names(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
    output, seen = _plain_forward(model, feed)
    sequences = [list(s) for name in ("hidden_states", "decoder_hidden_states", "encoder_hidden_states")
                 if isinstance(s := getattr(output, name, None), (tuple, list)) and s]
    if not sequences:
        raise NotApplicable("the model returns no hidden_states")
    with hookscope.capture(model, "resid_pre.0", "resid_post.*", "embed", on_unfired="error") as acts:
        with torch.no_grad():
            model(**feed)
    posts = [acts[f"resid_post.{i}"] for i in range(len(hookscope.select(model, "resid_post.*")))]
    # the model's own input embedding (get_input_embeddings()), as the forward called it (an
    # encoder-decoder's may be the decoder's, called on the decoder's ids)
    own = model.get_input_embeddings()  # type: ignore[operator]
    called = [calls for path, module in model.named_modules() if module is own
              for calls in [seen.get(path)] if calls]
    with torch.no_grad():
        embedded = called[0][0][1] if called else own(next(iter(feed.values())))
    embed_ok = _same(acts.calls("embed")[0], embedded)
    return embed_ok and any(_residuals_equal(acts["resid_pre.0"], posts, states, seen)
                            for states in sequences if len(states) == len(posts) + 1)


def _residuals_equal(pre: Any, posts: list[Any], states: list[torch.Tensor],
                     seen: dict[str, list[Any]]) -> bool:
    last = _first(posts[-1])

    def once(given: Any, gives: Any) -> bool:  # a module that ran once took `given`, gave `gives`
        return any(len(calls) == 1 and _same(calls[0][0], given) and _same(calls[0][1], gives)
                   for calls in seen.values())
    if all(_same(post, state) for post, state in zip(posts, states)):
        # Mamba, RWKV: hidden_states[i] is block i's output, the last one the final norm's;
        # resid_pre.0 is then what entered the module whose output is hidden_states[0]
        return once(last, states[-1]) and once(pre, states[0])
    if not _same(pre, states[0]):
        return False
    if not all(_same(post, state) for post, state in zip(posts[:-1], states[1:-1])):
        return False
    # the last hidden state is the last block's output, or a module's output whose input it is
    return _same(last, states[-1]) or once(last, states[-1])


def _capture(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
    _, seen = _plain_forward(model, feed)
    with hookscope.capture(model, "**", on_unfired="ignore") as acts:
        with torch.no_grad():
            model(**feed, output_hidden_states=True, return_dict=True)
    names = hookscope.engine.index(model)
    for path, calls in seen.items():
        key = names.path_of(path)
        if key is None or key not in acts.counts or path == "":
            continue
        got = acts.calls(key)
        if len(got) != len(calls) or not all(_same(g, c[1]) for g, c in zip(got, calls)
                                             if c[1] is not None and c[1].is_floating_point()):
            return False
    return True


def _lens(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
    if "input_ids" not in feed:
        raise NotApplicable("not a language model (no input_ids)")
    with torch.no_grad():
        try:
            logits = model(**feed).logits
        except AttributeError as exc:
            raise NotApplicable("the model returns no logits") from exc
        except Exception as exc:  # noqa: BLE001
            raise NotApplicable(f"the model's own forward raised {type(exc).__name__}") from exc
    decoder = {"decoder_input_ids": feed["decoder_input_ids"]} if "decoder_input_ids" in feed else {}
    lens = hookscope.logit_lens(model, feed["input_ids"], attention_mask=feed["attention_mask"],
                                **decoder)
    want = torch.log_softmax(logits.float(), dim=-1)
    return lens.log_probs[-1].shape == want.shape and \
        float((lens.log_probs[-1] - want).abs().max()) <= TOLERANCE


def _decoder_block(model: nn.Module, seq2seq: bool) -> str:
    """The first block of the decoder's block list (plain ``named_modules()``), with ``[0]``
    when it returns a tuple."""
    lists = [(path, m) for path, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) > 0 and (not seq2seq or "decoder" in path)]
    if not lists:
        raise NotApplicable("no block list")
    return min(lists, key=lambda item: (item[0].count("."), -len(item[1])))[0] + ".0"


def _generation(options: dict[str, Any]) -> Callable[[nn.Module, str, dict[str, Any]], bool]:
    def check(model: nn.Module, kind: str, feed: dict[str, Any]) -> bool:
        if kind not in ("causal", "seq2seq") or "input_ids" not in feed:
            raise NotApplicable("not a generative language model")
        block = _decoder_block(model, kind == "seq2seq")
        prompt = {"input_ids": feed["input_ids"], "attention_mask": feed["attention_mask"]}
        fed_once = {**prompt, "decoder_input_ids": feed["input_ids"][:, :2]} if kind == "seq2seq" else prompt
        outputs: list[Any] = []
        handle = dict(model.named_modules())[block].register_forward_hook(
            lambda m, a, out: outputs.append(out))
        try:
            with torch.no_grad():
                model(**fed_once)
        except Exception as exc:  # noqa: BLE001
            raise NotApplicable(f"the model's own forward raised {type(exc).__name__}") from exc
        finally:
            handle.remove()
        block = hookscope.engine.index(model).path_of(block) or block  # wrapper segments dropped
        target = block + "[0]" if outputs and isinstance(outputs[0], tuple) else block
        settings = dict(max_new_tokens=3, min_new_tokens=3, pad_token_id=0, **options)
        try:
            torch.manual_seed(0)
            with torch.no_grad():
                plain = model.generate(**prompt, **settings)  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001
            raise NotApplicable(f"generate() raised {type(exc).__name__} without hookscope") from exc
        torch.manual_seed(0)
        with hookscope.capture_generation(model, target) as gen, torch.no_grad():
            sequences = model.generate(**prompt, **settings)  # type: ignore[operator]
        if not torch.equal(sequences, plain):
            return False  # hookscope changed what generate() returned
        ids = gen.token_ids()
        value = gen.aligned(target)
        fed = sequences[:, :-1]
        forced = {"decoder_input_ids": fed, **prompt} if kind == "seq2seq" else {"input_ids": fed}
        if not torch.equal(ids, fed):
            return False
        with hookscope.capture(model, target) as acts, torch.no_grad():
            model(**forced)
        if _same(value, acts[target]):
            return True
        # generate() feeds position_ids 0, 1, ... (from the mask), which RoBERTa-like models
        # compute otherwise in a plain forward (from the ids, after padding_idx): feed them too
        key = "decoder_position_ids" if kind == "seq2seq" else "position_ids"
        forced[key] = torch.arange(fed.shape[1]).unsqueeze(0).expand_as(fed)
        try:
            with hookscope.capture(model, target) as acts, torch.no_grad():
                model(**forced)
        except TypeError:
            return False  # the model takes no position_ids: the first comparison stands
        return _same(value, acts[target])
    return check


CHECKS: dict[str, Callable[[nn.Module, str, dict[str, Any]], bool]] = {
    "names": _names, "capture": _capture, "lens": _lens,
    "greedy": _generation({"do_sample": False}),
    "sample": _generation({"do_sample": True, "top_k": 5}),
    "beam": _generation({"num_beams": 2, "do_sample": False}),
}

from tests.zoo.edit_cells import EDIT_CHECKS  # noqa: E402 - it reads this module's helpers

CHECKS.update(EDIT_CHECKS)
