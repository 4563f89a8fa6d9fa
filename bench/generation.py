"""The ``generation`` workload: ``hookscope.capture_generation`` against the hand-written loop
of plain forward hooks doing the same work (issue 21: at most 1.10x per generated token).

Every case runs the same greedy ``model.generate(prompt, **generate_kwargs(...))`` with the KV
cache on the bench's GPT-2 (``models.gpt2``): one prompt of ``PROMPT`` tokens, exactly
``new_tokens(size)`` new tokens (``min_new_tokens`` too, so an end-of-sequence token cannot cut
one case short), that is ``new_tokens`` forwards of the model (the prompt, then one token each).
Each capturing case keeps every block's output (``transformer.h.*``) on every step:

- the hand-written loop: ``register_forward_hook`` on each block appending ``output.detach()``;
- hookscope: ``capture_generation(model, "transformer.h.*")`` (it also labels each call with its
  step and positions);
- nnsight 0.8: ``TransformersModel(...).generate`` with ``tracer.iter[:n]`` saving each block's
  ``.output`` (on a deep copy: nnsight wraps every module's forward for good), with a tokenizer
  built here (a word-level vocabulary of the model's size) since the pipeline wants one;
- TransformerLens 3.9: ``HookedTransformer.generate`` under ``model.hooks`` on each block's
  ``hook_resid_post``; its own model, so compared with its own bare ``generate``.

The same number of tokens in every case, so a ratio of times is a ratio per generated token.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bench import models, peers
from bench.peers import Case, Values

Tensor = torch.Tensor
PROMPT = 16
BARE = "bare generate"
HAND = "hand-written loop (plain hooks detach()), every block, every step"
TL_BARE = "TransformerLens bare generate"


def new_tokens(size: models.Size) -> int:
    """Tokens generated per case: 32 at full size, 4 for ``--quick``."""
    return 32 if size == models.FULL else 4


def prompt(size: models.Size) -> Tensor:
    """Prompt token ids ``(1, PROMPT)`` int64, seed 0, never the end-of-sequence id."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, size.vocab - 1, (1, PROMPT), generator=generator)


def generate_kwargs(size: models.Size) -> dict[str, Any]:
    """Greedy, cached, exactly ``new_tokens(size)`` tokens (the same call in every HF case)."""
    n = new_tokens(size)
    return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "use_cache": True,
            "pad_token_id": size.vocab - 1}


def hand_loop(model: nn.Module, ids: Tensor, paths: Sequence[str], kwargs: dict[str, Any], *,
              clone: bool = False) -> dict[str, list[Tensor]]:
    """The loop a user writes: a forward hook per block keeping ``output.detach()`` (or a clone)
    of every call, around one ``generate``; returns ``{path: [output per step]}``."""
    kept: dict[str, list[Tensor]] = {path: [] for path in paths}
    handles = []
    for path in paths:
        store = kept[path]
        if clone:
            def hook(m: nn.Module, args: Any, out: Tensor, store: list[Tensor] = store) -> None:
                store.append(out.detach().clone())
        else:
            def hook(m: nn.Module, args: Any, out: Tensor, store: list[Tensor] = store) -> None:
                store.append(out.detach())
        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        model.generate(ids, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return kept


def _tensors(kept: dict[str, list[Tensor]]) -> list[Tensor]:
    return [t for calls in kept.values() for t in calls]


def _hookscope(model: nn.Module, ids: Tensor, kwargs: dict[str, Any]) -> Case:
    import hookscope

    def run() -> Any:
        with hookscope.capture_generation(model, "transformer.h.*") as gen:
            model.generate(ids, **kwargs)
        return gen

    def values(gen: Any) -> Values:
        return {path: list(gen.capture.calls(path)) for path in gen.capture.paths}

    return Case("hookscope.capture_generation 'transformer.h.*'", "hookscope", run,
                lambda gen: _tensors(values(gen)), values,
                note="also labels every call with its step and positions")


def _tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``vocab`` ids (``t0`` ... ), built here: no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    end = f"t{vocab - 1}"
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), eos_token=end, pad_token=end)


def _nnsight(model: nn.Module, ids: Tensor, paths: Sequence[str], kwargs: dict[str, Any],
             size: models.Size) -> Case:
    try:
        import nnsight
        from nnsight.modeling.transformers import TransformersModel
    except ImportError as err:
        raise peers.PeerMissing(f"nnsight is not installed ({err})") from None
    wrapped = TransformersModel(copy.deepcopy(model), tokenizer=_tokenizer(size.vocab),
                                task="text-generation")
    envoys, steps = [wrapped.get(path) for path in paths], new_tokens(size)

    def run() -> list[Any]:
        with wrapped.generate(ids, **kwargs) as tracer:
            saved = nnsight.save([])
            for _ in tracer.iter[:steps]:
                for envoy in envoys:
                    saved.append(envoy.output)
        return list(saved)

    def values(saved: list[Any]) -> Values:  # step-major: step 0's blocks, then step 1's, ...
        return {path: list(saved[i::len(paths)]) for i, path in enumerate(paths)}

    return Case("nnsight generate, tracer.iter[:n], every block", "nnsight", run,
                lambda saved: [t for t in saved if isinstance(t, Tensor)], values,
                note="on a deep copy of the model (nnsight wraps every forward for good)")


def _transformer_lens(size: models.Size, ids: Tensor) -> list[Case]:
    try:
        model = models.hooked_transformer(size)
    except ImportError as err:
        raise peers.PeerMissing(f"transformer_lens is not installed ({err})") from None
    n = new_tokens(size)
    names = [f"blocks.{i}.hook_resid_post" for i in range(size.n_layer)]

    def bare() -> Tensor:
        return model.generate(ids, max_new_tokens=n, do_sample=False, use_past_kv_cache=True,
                              stop_at_eos=False, verbose=False)

    def hooked() -> list[Tensor]:
        kept: list[Tensor] = []

        def keep(t: Tensor, hook: Any) -> None:
            kept.append(t.detach())
        with model.hooks(fwd_hooks=[(name, keep) for name in names]):
            bare()
        return kept

    return [Case(TL_BARE, "TransformerLens", bare, lambda kept: ()),
            Case("TransformerLens generate, hook_resid_post of every block", "TransformerLens",
                 hooked, lambda kept: kept, floor=TL_BARE,
                 note="its own model; ratio to its own generate")]


def cases(size: models.Size, peers_wanted: bool
          ) -> tuple[list[Case], dict[str, str], dict[str, Any], Any]:
    """The cases (bare ``generate`` first), the peers skipped and why, info for the table, and
    the reference values (the hand loop cloning every output)."""
    model, ids, kwargs = models.gpt2(size), prompt(size), generate_kwargs(size)
    paths = [f"transformer.h.{i}" for i in range(size.n_layer)]
    cases = [Case(BARE, "bare", lambda: model.generate(ids, **kwargs), lambda kept: ()),
             Case(HAND, "plain hooks", lambda: hand_loop(model, ids, paths, kwargs), _tensors,
                  lambda kept: kept),
             _hookscope(model, ids, kwargs)]
    skipped: dict[str, str] = {}
    if peers_wanted:
        try:
            cases.append(_nnsight(model, ids, paths, kwargs, size))
        except (peers.PeerMissing, ImportError) as err:
            skipped["nnsight"] = str(err)
        try:
            cases += _transformer_lens(size, ids)
        except (peers.PeerMissing, ImportError) as err:
            skipped["TransformerLens"] = str(err)
    info = {"prompt": PROMPT, "new_tokens": new_tokens(size), "blocks": len(paths),
            "forwards per generate": new_tokens(size)}
    return cases, skipped, info, lambda: hand_loop(model, ids, paths, kwargs, clone=True)
