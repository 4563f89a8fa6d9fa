"""The workloads: a model, its input, and the cases that run on it, built in the worker process.

Every workload's first case is its bare forward; each case's time is reported as a ratio to the
bare forward measured in the same process run. Peer cases whose library is missing are listed in
``skipped`` with the reason, and the run goes on without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench import models, peers
from bench.peers import Case

#: workload -> title in RESULTS.md
WORKLOADS: dict[str, str] = {
    "gpt2": "GPT-2-small-sized (12x768, 124M) HF GPT2LMHeadModel, tokens",
    "gpt2-torchlens": "same GPT-2, torchlens (own process: it leaves torch wrapped)",
    "resnet": "ResNet-50-sized CNN, plain torch, in-place ReLU, images",
    "resnet-torchlens": "same CNN, torchlens (own process)",
    "efficientnet": "efficientnet-lite0 (real weights), scikit-image photos",
    "functional": "function-level addresses: the SDPA call of every attention module, GPT-2-sized "
                  "and MiniLM (real weights), tokens",
    "early-stop": "efficientnet-lite0, one early block (_blocks.1), with and without early_stop",
    "sweep": "patching_sweep over (GPT-2 MLPs x 4 positions), against the hand-written loop",
    "generation": "capture_generation of every GPT-2 block over greedy generate(), against the "
                  "hand-written loop of plain hooks",
    "extraction": "extract (efficientnet-lite0 layer mean-pooled; LeNet maps) against the bare "
                  "loop over the same batches",
}


TORCHLENS_FLOOR = "bare forward, torch wrapped by torchlens"


@dataclass
class Workload:
    """What a worker runs: the cases, the reference values, and what was left out and why."""

    name: str
    shape: str
    cases: list[Case]
    reference: Callable[[], peers.Values] | None
    skipped: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    #: time the bare forward alone first (torchlens slows torch for good once it has run)
    floor_first: bool = False


def _add(cases: list[Case], skipped: dict[str, str], name: str, build: Callable[[], Case]) -> None:
    try:
        cases.append(build())
    except (peers.PeerMissing, ImportError) as err:
        skipped[name] = str(err)


def build(name: str, size: models.Size, *, peers_wanted: bool = True) -> Workload:
    """Build workload ``name`` at ``size``.

    Raises:
        KeyError: ``name`` is not one of ``WORKLOADS``.
    """
    return {"gpt2": _gpt2, "gpt2-torchlens": _gpt2_torchlens, "resnet": _resnet,
            "resnet-torchlens": _resnet_torchlens,
            "efficientnet": _efficientnet, "functional": _functional,
            "early-stop": _early_stop, "sweep": _sweep, "generation": _generation,
            "extraction": _extraction}[name](size, peers_wanted)


def _block_cases(cases: list[Case], model: torch.nn.Module, example: tuple[Any, ...],
                 blocks: list[str], pattern: str) -> None:
    """Plain hooks and hookscope on the block outputs only (``pattern`` selects ``blocks``)."""
    name = f"{len(blocks)} blocks"
    cases.append(peers.plain_hooks(model, example, blocks, name=f"plain hooks detach(), {name}"))
    cases.append(peers.hookscope_capture(model, example, [pattern],
                                         name=f"hookscope '{pattern}' ({name})"))


def _every_module_cases(cases: list[Case], model: torch.nn.Module, example: tuple[Any, ...],
                        paths: list[str]) -> None:
    """Plain hooks (detach, clone) and hookscope (steady, first capture) on every module."""
    every = f"every module ({len(paths)})"
    cases.append(peers.plain_hooks(model, example, paths, name=f"plain hooks detach(), {every}"))
    cases.append(peers.plain_hooks(model, example, paths, clone=True,
                                   name=f"plain hooks clone(), {every}"))
    cases.append(peers.hookscope_capture(model, example, paths, name=f"hookscope, {every}"))
    cases.append(peers.hookscope_capture(model, example, paths, first=True,
                                         name="hookscope, every module, first capture of the model"))


def _capture_variants(cases: list[Case], model: torch.nn.Module, example: tuple[Any, ...],
                      paths: list[str], *, fp16: bool, to_cpu: bool) -> None:
    _every_module_cases(cases, model, example, paths)
    cases.append(peers.hookscope_capture(model, example, paths, clone=True,
                                         name="hookscope clone=True, every module"))
    cases.append(peers.hookscope_capture(model, example, paths, clone=False,
                                         name="hookscope clone=False, every module"))
    if fp16:
        cases.append(peers.hookscope_capture(model, example, paths, dtype=torch.float16,
                                             name="hookscope dtype=float16, every module"))
    if to_cpu:
        cases.append(peers.hookscope_capture(model, example, paths, to="cpu",
                                             name="hookscope to='cpu', every module"))


def _gpt2(size: models.Size, peers_wanted: bool) -> Workload:
    model, example = models.gpt2(size), (models.tokens(size),)
    paths = models.computing_modules(model, *example)
    blocks = [f"transformer.h.{i}" for i in range(size.n_layer)]
    cases = [peers.bare(model, *example)]
    _capture_variants(cases, model, example, paths, fp16=True, to_cpu=True)
    _block_cases(cases, model, example, blocks, "transformer.h.*")
    skipped: dict[str, str] = {}
    if peers_wanted:
        _add(cases, skipped, "nnsight", lambda: peers.nnsight_trace(
            model, example, paths, name="nnsight, every module"))
        _add(cases, skipped, "nnsight blocks", lambda: peers.nnsight_trace(
            model, example, blocks, name=f"nnsight, {len(blocks)} blocks"))
        _add_transformer_lens(cases, skipped, size, example)
    return Workload("gpt2", f"tokens ({size.batch}, {size.seq})", cases,
                    _reference(model, example, paths + blocks), skipped,
                    {"modules": len(paths), "attn_implementation":
                     getattr(model.config, "_attn_implementation", "?"),
                     "parameters": sum(p.numel() for p in model.parameters())})


def _add_transformer_lens(cases: list[Case], skipped: dict[str, str], size: models.Size,
                          example: tuple[Any, ...]) -> None:
    try:
        hooked = models.hooked_transformer(size)
    except ImportError as err:
        skipped["TransformerLens"] = f"transformer_lens with HookedTransformer is missing ({err})"
        return
    floor = "TransformerLens HookedTransformer bare forward"
    cases.append(peers.bare(hooked, *example, name=floor))
    cases.append(peers.transformer_lens_cache(
        hooked, example, None, floor=floor,
        name=f"TransformerLens run_with_cache, all {len(hooked.hook_dict)} hook points"))
    resid = [f"blocks.{i}.hook_resid_post" for i in range(size.n_layer)]
    cases.append(peers.transformer_lens_cache(
        hooked, example, resid, floor=floor,
        name=f"TransformerLens run_with_cache, {len(resid)} resid_post"))


def _gpt2_torchlens(size: models.Size, peers_wanted: bool) -> Workload:
    model, example = models.gpt2(size), (models.tokens(size),)
    paths = models.computing_modules(model, *example)
    blocks = [f"transformer.h.{i}" for i in range(size.n_layer)]
    cases = _torchlens_floors(model, example)
    skipped: dict[str, str] = {}
    if peers_wanted:
        _add(cases, skipped, "torchlens", lambda: peers.torchlens_trace(
            model, example, "all", name="torchlens, every tensor op", floor=TORCHLENS_FLOOR))
        _add(cases, skipped, "torchlens modules", lambda: peers.torchlens_trace(
            model, example, paths, name=f"torchlens, every module ({len(paths)})", floor=TORCHLENS_FLOOR))
        _add(cases, skipped, "torchlens blocks", lambda: peers.torchlens_trace(
            model, example, blocks, name=f"torchlens, {len(blocks)} blocks", floor=TORCHLENS_FLOOR))
    return Workload("gpt2-torchlens", f"tokens ({size.batch}, {size.seq})", cases, None, skipped,
                    floor_first=True)


def _torchlens_floors(model: torch.nn.Module, example: tuple[Any, ...]) -> list[Case]:
    """The bare forward timed alone before torchlens first runs, and again interleaved with
    torchlens, once torch is wrapped: the floor of torchlens's cases (its ratios are then lower
    bounds, compared with a floor that torchlens itself slowed)."""
    return [peers.bare(model, *example),
            peers.bare(model, *example, name=TORCHLENS_FLOOR)]


def _resnet(size: models.Size, peers_wanted: bool) -> Workload:
    model, example = models.resnet(size), (models.images(size),)
    paths = models.computing_modules(model, *example)
    blocks = [f"layer{s + 1}.{i}" for s, n in enumerate(size.cnn_blocks) for i in range(n)]
    cases = [peers.bare(model, *example)]
    _capture_variants(cases, model, example, paths, fp16=True, to_cpu=False)
    _block_cases(cases, model, example, blocks, "layer*.*")
    skipped: dict[str, str] = {}
    if peers_wanted:
        _add(cases, skipped, "nnsight", lambda: peers.nnsight_trace(
            model, example, paths, name="nnsight, every module",
            note="first call only of each ReLU (called 3 times per block)"))
    return Workload("resnet", f"images {tuple(example[0].shape)}", cases,
                    _reference(model, example, paths + blocks), skipped,
                    {"modules": len(paths), "parameters": sum(p.numel() for p in model.parameters())})


def _resnet_torchlens(size: models.Size, peers_wanted: bool) -> Workload:
    model, example = models.resnet(size), (models.images(size),)
    cases = _torchlens_floors(model, example)
    skipped: dict[str, str] = {}
    if peers_wanted:
        _add(cases, skipped, "torchlens", lambda: peers.torchlens_trace(
            model, example, "all", name="torchlens, every tensor op", floor=TORCHLENS_FLOOR))
    return Workload("resnet-torchlens", f"images {tuple(example[0].shape)}", cases, None, skipped,
                    floor_first=True)


def _efficientnet(size: models.Size, peers_wanted: bool) -> Workload:
    model, example = models.efficientnet(), (models.photos(size),)
    paths = models.computing_modules(model, *example)
    blocks = [f"_blocks.{i}" for i in range(len(model._blocks))]
    cases = [peers.bare(model, *example)]
    _every_module_cases(cases, model, example, paths)
    _block_cases(cases, model, example, blocks, "_blocks.*")
    return Workload("efficientnet", f"photos {tuple(example[0].shape)}", cases,
                    _reference(model, example, paths + blocks), {},
                    {"modules": len(paths), "photos": list(models.PHOTOS[:size.photos])})


def _functional(size: models.Size, peers_wanted: bool) -> Workload:
    """Each model's bare forward, then its attention modules captured by module hooks (what a
    module address costs, unchanged by function addresses) and by the function address of their
    SDPA call, and hookscope.attention (which also recomputes the probabilities)."""
    gpt2, gpt2_tokens = models.gpt2(size), (models.tokens(size),)
    minilm, minilm_tokens = models.minilm(), (models.minilm_tokens(size),)
    cases = [peers.bare(gpt2, *gpt2_tokens)]
    _function_cases(cases, gpt2, gpt2_tokens, "transformer.h.*.attn", size.n_layer, "GPT-2")
    cases.append(peers.bare(minilm, *minilm_tokens, name="MiniLM bare forward"))
    _function_cases(cases, minilm, minilm_tokens, "encoder.layer.*.attention.self", 6, "MiniLM",
                    floor="MiniLM bare forward")
    return Workload("functional", f"tokens ({size.batch}, {size.seq}) for both", cases, None, {},
                    {"gpt2_attn_implementation": getattr(gpt2.config, "_attn_implementation", "?"),
                     "minilm_attn_implementation": getattr(minilm.config, "_attn_implementation",
                                                           "?")})


def _function_cases(cases: list[Case], model: torch.nn.Module, example: tuple[Any, ...],
                    pattern: str, layers: int, label: str, floor: str | None = None) -> None:
    import hookscope

    paths = list(hookscope.select(model, pattern))
    address = f"{pattern}::scaled_dot_product_attention"
    for case in (
            peers.plain_hooks(model, example, paths,
                              name=f"{label}: plain hooks detach(), {layers} attention modules"),
            peers.hookscope_capture(model, example, [pattern],
                                    name=f"{label}: hookscope '{pattern}' (module outputs)"),
            peers.hookscope_capture(model, example, [address],
                                    name=f"{label}: hookscope '{address}'"),
            peers.hookscope_attention(model, example, pattern,
                                      name=f"{label}: hookscope.attention, {layers} modules")):
        case.floor = floor
        cases.append(case)


def _reference(model: torch.nn.Module, example: tuple[Any, ...],
               paths: list[str]) -> Callable[[], peers.Values]:
    """Values to check every case against: plain hooks that clone every output."""
    case = peers.plain_hooks(model, example, list(dict.fromkeys(paths)), clone=True,
                             name="reference")
    return lambda: case.values(case.run())  # type: ignore[misc]


def _early_stop(size: models.Size, peers_wanted: bool) -> Workload:
    """Capture and extraction of ``_blocks.1`` (2 of 16 blocks, after the stem): the whole
    forward, against ``early_stop=True``, which skips the 14 blocks and the head after it."""
    model, example = models.efficientnet(), (models.photos(size),)
    layer = "_blocks.1"
    cases = [peers.bare(model, *example),
             peers.plain_hooks(model, example, [layer], name=f"plain hook detach(), {layer}"),
             peers.hookscope_capture(model, example, [layer], name=f"hookscope capture {layer}"),
             peers.hookscope_capture(model, example, [layer], early_stop=True,
                                     name=f"hookscope capture {layer}, early_stop=True"),
             peers.hookscope_extract(model, example, layer, name=f"hookscope extract {layer} (mean)"),
             peers.hookscope_extract(model, example, layer, early_stop=True,
                                     name=f"hookscope extract {layer} (mean), early_stop=True")]
    return Workload("early-stop", f"photos {tuple(example[0].shape)}", cases,
                    _reference(model, example, [layer]), {},
                    {"layer": layer, "blocks": len(model._blocks)})


def _sweep(size: models.Size, peers_wanted: bool) -> Workload:
    """``patching_sweep`` against the plain-hook loop doing the same forwards (``bench.sweeps``)."""
    from bench import sweeps

    cases, info = sweeps.cases(size)
    return Workload("sweep", f"tokens (1, {sweeps.SEQ}), clean and corrupted", cases, None, {}, info)


def _generation(size: models.Size, peers_wanted: bool) -> Workload:
    """``capture_generation`` against the plain-hook loop around the same ``generate``
    (``bench.generation``), with nnsight's and TransformerLens's equivalents."""
    from bench import generation

    cases, skipped, info, reference = generation.cases(size, peers_wanted)
    return Workload("generation", f"prompt (1, {generation.PROMPT}), "
                    f"{generation.new_tokens(size)} new tokens", cases, reference, skipped, info)


def _extraction(size: models.Size, peers_wanted: bool) -> Workload:
    """``extract`` against the bare loop over the same batches (``bench.extraction``)."""
    from bench import extraction

    cases, info = extraction.cases(size)
    return Workload("extraction", "DataLoaders of photos and of LeNet rows", cases, None, {}, info)
