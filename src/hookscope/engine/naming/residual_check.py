"""Standard names checked against the model's own hidden states.

``resid_pre.{i}`` and ``resid_post.{i}`` are found by structure (``engine.naming.standard_naming``);
``embed`` too. A Hugging Face model also says what its residual stream is:
``output_hidden_states=True`` returns ``hidden_states[0]`` (what enters the first block) and
``hidden_states[i + 1]`` (what block ``i`` gives on). Once per model (``engine.ground_truth``:
one probe forward, kept), each name is compared with the hidden state it stands for:

- a structural module whose output holds the hidden state's values keeps the name;
- else the module whose output holds them is taken instead (for ``resid_pre.0``: one outside
  the blocks, the last to finish; for ``resid_post.{i}``: the outermost); the name then means
  that module, as the model computed it;
- the last hidden state is, on most models (GPT-2, Llama, Gemma, Mistral ...), the final norm's
  output, not the last block's: it checks ``resid_post.{L-1}`` when a module that ran once took
  the last block's output as its input and gave the last hidden state (the final norm, whatever
  its name); the name stays the last block's output, which is the residual stream there;
- no module's output holds ``hidden_states[0]`` because the model's own forward computes it
  (OPT, BioGPT, Pegasus, Whisper: embeddings scaled, positions added, ``F.dropout`` inline):
  ``resid_pre.0`` is the last torch function call, made by the own forward of a module that
  owns the block list before the first block began, whose value it is (the probe watches those
  forwards: ``engine.ground_truth``), as a function-level address (``"model.decoder::add#0"``),
  which capture, patch and steer take as any name;
- hidden states that are each block's output, the last one the final norm's (Mamba, RWKV:
  no embeddings among them): ``resid_post.{i}`` is block ``i``, checked equal to
  ``hidden_states[i]``, and ``resid_pre.0`` is checked against the first block's input as the
  probe saw it (the structural module, else the module or inline call that gives it);
- no module's output and no such call holds the hidden state: the name is refused
  (``SelectorError``) with the largest difference found and the fix, never resolved to a
  value that differs;
- the hidden states do not line up with the blocks (not one per block plus the embeddings):
  the residual names are refused, naming both counts.

``embed`` is the module ``get_input_embeddings()`` returns, when the model has one and the
probe saw it run (T5's ``shared`` lends its weight to ``encoder.embed_tokens`` and never runs:
the structural rule then finds ``encoder.embed_tokens``). A model that
returns no hidden states (a plain ``nn.Module``, a TransformerLens ``HookedTransformer`` whose
hook points are the residual stream by construction) keeps the structural rule unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hookscope.engine.ground_truth import Probe, first_tensor, probe_of, same_values
from hookscope.engine.naming import standard_naming
from hookscope.engine.naming.names import ModuleIndex

__all__ = ["Residuals", "checked_residuals", "decoder_blocks", "input_embedding", "residual_lists"]

Tensor = torch.Tensor
HIDDEN = ("hidden_states", "decoder_hidden_states", "encoder_hidden_states")


@dataclass(frozen=True)
class Residuals:
    """What the check found: ``paths`` (standard name -> module path, where the hidden states
    chose another module than the structural rule), ``refused`` (standard name -> the
    sentence of the error), ``unchecked`` (why nothing was checked, else "")."""

    paths: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    unchecked: str = ""


def input_embedding(names: ModuleIndex) -> str | None:
    """The path of the module ``get_input_embeddings()`` returns, when it is one of the model's."""
    get_embed = getattr(names.root, "get_input_embeddings", None)
    try:
        embed = get_embed() if callable(get_embed) else None
    except (NotImplementedError, AttributeError):
        return None
    if not isinstance(embed, nn.Module):
        return None
    path = next((path for path, module in names.modules.items() if module is embed), None)
    probe = probe_of(names) if path is not None else None
    if isinstance(probe, Probe) and path not in probe.outputs:
        return None  # never called (T5's `shared`, whose weight encoder.embed_tokens uses)
    return path


def residual_lists(names: ModuleIndex,
                   lists: list[tuple[str, nn.ModuleList]]) -> list[tuple[str, nn.ModuleList]]:
    """Of several candidate block lists ``[(path, ModuleList)]``, those whose blocks each ran
    once and gave the model's own hidden states ``1 ... L`` (one sequence of
    ``hidden_states``/``decoder_hidden_states``/``encoder_hidden_states``); all of them when
    none does or the model has no probe."""
    probe = probe_of(names)
    if isinstance(probe, str):
        return lists
    sequences = [[first_tensor(state) for state in value] for name in HIDDEN
                 if isinstance(value := getattr(probe.output, name, None), (tuple, list)) and value]
    fitting = [(path, blocks) for path, blocks in lists if any(
        len(states) == len(blocks) + 1 and all(
            same_values(probe.once(f"{path}.{i}"), state) for i, state in enumerate(states[1:-1]))
        for states in sequences)]
    return fitting or lists


def decoder_blocks(names: ModuleIndex) -> tuple[str, int] | None:
    """``(path, count)`` of the block list whose blocks each ran once in the probe forward and
    gave the model's own ``decoder_hidden_states`` (an encoder-decoder's decoder: the last block's
    output, or a module's output computed from it, is the last state); None when no list does
    or the model has no probe or no decoder hidden states."""
    probe = probe_of(names)
    if isinstance(probe, str):
        return None
    value = getattr(probe.output, "decoder_hidden_states", None)
    states = [first_tensor(state) for state in value] if isinstance(value, (tuple, list)) else []
    if len(states) < 2 or None in states:
        return None
    count = len(states) - 1
    for path, module in names.modules.items():
        if not isinstance(module, nn.ModuleList) or len(module) != count:
            continue
        outputs = [probe.once(f"{path}.{i}") for i in range(count)]
        last = outputs[-1]
        if all(same_values(o, s) for o, s in zip(outputs[:-1], states[1:-1])) and last is not None \
                and (same_values(last, states[-1]) or _applied_after(probe, last, states[-1])):  # type: ignore[arg-type]
            return path, count
    return None


def checked_residuals(names: ModuleIndex, blocks: str, count: int, block_input: str | None,
                      final_norm: str | None) -> Residuals:
    """The residual names of the model of ``names`` checked against its hidden states (module
    docstring); ``blocks`` is the block list's path, ``count`` its length, ``block_input`` and
    ``final_norm`` the structural modules (None when the structure has none)."""
    probe = probe_of(names)
    if isinstance(probe, str):
        return Residuals(unchecked=probe)
    key = f"residuals:{blocks}"
    if key not in probe.memo:
        probe.memo[key] = _check(probe, blocks, count, block_input, final_norm)
    result: Residuals = probe.memo[key]
    return result


def _check(probe: Probe, blocks: str, count: int, block_input: str | None,
           final_norm: str | None) -> Residuals:
    # an entry may be a tuple (PegasusX: tokens, then its global tokens): its first tensor
    sequences = [(name, [first_tensor(state) for state in value]) for name in HIDDEN
                 if isinstance(value := getattr(probe.output, name, None), (tuple, list)) and value]
    sequences = [(name, states) for name, states in sequences if None not in states]
    tensors = [(name, [s for s in states if s is not None]) for name, states in sequences]
    if not sequences:
        return Residuals(unchecked="the model returned no hidden_states")
    block_paths = [f"{blocks}.{i}" for i in range(count)]
    fitting = [(name, states) for name, states in tensors if len(states) == count + 1]
    if not fitting:
        shown = ", ".join(f"{name} has {len(states)}" for name, states in sequences)
        sentence = (f"the model's own hidden states do not line up with its {count} blocks "
                    f"('{blocks}'): {shown} entries, not {count + 1} (the embeddings and one per "
                    f"block), so which module's output is the residual stream cannot be checked; "
                    f"select the module by its own path (hookscope tree MODEL)")
        return Residuals(refused={f"{kind}.{i}": sentence for kind in ("resid_pre", "resid_post")
                                  for i in range(count)})
    name, states = max(fitting, key=lambda item: sum(
        same_values(probe.once(p), s) for p, s in zip(block_paths, item[1][1:])))
    if all(same_values(probe.once(p), s) for p, s in zip(block_paths, states)):
        return _after_each_block(probe, states, blocks, block_paths, block_input, name)
    paths: dict[str, str] = {}
    refused: dict[str, str] = {}
    first = _first_state(probe, states[0], blocks, block_input, name)
    (paths if first[0] else refused)["resid_pre.0"] = first[1]
    for i, path in enumerate(block_paths):
        found = _block_state(probe, states[i + 1], path, blocks, name, i, last=i == count - 1)
        if not found[0]:
            refused[f"resid_post.{i}"] = found[1]
            if i + 1 < count:
                refused[f"resid_pre.{i + 1}"] = found[1].replace(f"resid_post.{i}", f"resid_pre.{i + 1}", 1)
        elif found[1] != path:
            paths[f"resid_post.{i}"] = found[1]
            if i + 1 < count:
                paths[f"resid_pre.{i + 1}"] = found[1]
    if "resid_pre.0" in paths and paths["resid_pre.0"] == block_input:
        del paths["resid_pre.0"]
    return Residuals(paths, refused)


def _after_each_block(probe: Probe, states: list[Tensor], blocks: str, block_paths: list[str],
                      block_input: str | None, name: str) -> Residuals:
    """Hidden states that are each block's output, then the final norm's (Mamba, RWKV:
    ``hidden_states[i]`` is block ``i``'s output, ``hidden_states[L]`` the norm of the last):
    ``resid_post.{i}`` is block ``i`` (each checked equal), and ``resid_pre.0`` is what the
    first block took in, read from its call (no hidden state holds it)."""
    if not _applied_after(probe, states[-2], states[-1]):
        sentence = (f"the model's own hidden states are the outputs of its blocks ('{blocks}'), "
                    f"but {name}[-1] is no module's output computed from the last block's: "
                    f"which value the residual stream ends with cannot be checked; select the "
                    f"module by its own path (hookscope tree MODEL)")
        return Residuals(refused={f"{kind}.{i}": sentence for kind in ("resid_pre", "resid_post")
                                  for i in range(len(block_paths))})
    entering = probe.inputs.get(block_paths[0], [])
    if len(entering) != 1:
        sentence = (f"'resid_pre.0': the model's own {name} are its blocks' outputs ({name}[0] is "
                    f"'{block_paths[0]}''s), and the first block's input, which this name "
                    f"reads, is no tensor argument of one call; capture(model, "
                    f"'{block_paths[0]}', inputs=True) reads it")
        return Residuals(refused={"resid_pre.0": sentence})
    first = _first_state(probe, entering[0], blocks, block_input, f"'{block_paths[0]}' input")
    return Residuals({"resid_pre.0": first[1]} if first[0] and first[1] != block_input else {},
                     {} if first[0] else {"resid_pre.0": first[1]})


def _holding(probe: Probe, state: Tensor) -> list[tuple[str, int, int]]:
    """The calls of modules that ran once and whose output holds ``state``'s values."""
    return [(path, begin, end) for path, begin, end in probe.calls
            if same_values(probe.once(path), state)]


def _first_state(probe: Probe, state: Tensor, blocks: str, structural: str | None,
                 name: str) -> tuple[bool, str]:
    """(True, address) of what gives ``state``, the value that enters the first block: a
    module's output, else a function call of the model's own code before the first block
    (``"model::dropout#0"``), or (False, why)."""
    if structural is not None and same_values(probe.once(structural), state):
        return True, structural
    first_block = next((begin for path, begin, _ in probe.calls if path == f"{blocks}.0"), None)
    found = [(path, end) for path, _, end in _holding(probe, state)
             if not path.startswith(blocks + ".") and path != blocks
             and (first_block is None or end < first_block)]
    if found:
        return True, max(found, key=lambda item: item[1])[0]
    inline = _computed_inline(probe, state, blocks, first_block)
    if inline is not None:
        return True, inline
    return False, _differs("resid_pre.0", f"{name}[0]", structural, probe, state,
                           f"capture(model, '{blocks}.0', inputs=True) reads the first block's "
                           f"input")


def _computed_inline(probe: Probe, state: Tensor, blocks: str, first_block: int | None) -> str | None:
    """The address ``owner::op#N`` of the last function call that the own forward of a module
    owning ``blocks`` (its parent, or further up) made before the first block began and whose
    value is ``state`` (BioGPT, OPT, Pegasus: embeddings scaled and positions added inline,
    then ``F.dropout``); None when there is none."""
    owners = {blocks.rsplit(".", 1)[0] if "." in blocks else ""}
    owners |= {p for p in probe.outputs if p and blocks.startswith(p + ".")}
    calls = [(rank, f"{path}::{op}") for path, op, rank, value in probe.functions
             if path in owners | {""} and (first_block is None or rank < first_block)
             and same_values(value, state)]
    return max(calls)[1] if calls else None


def _block_state(probe: Probe, state: Tensor, block: str, blocks: str, name: str, i: int,
                 *, last: bool) -> tuple[bool, str]:
    """(True, path) of the module whose output is block ``i``'s hidden state, or (False, why)."""
    output = probe.once(block)
    if same_values(output, state):
        return True, block
    if last and output is not None and _applied_after(probe, output, state):
        return True, block  # the final norm's output is the last hidden state (module docstring)
    found = [(path, begin) for path, begin, _ in _holding(probe, state)
             if path.startswith(block + ".") or not path.startswith(blocks + ".")]
    if found and not last:
        return True, min(found, key=lambda item: (item[0].count("."), -item[1]))[0]
    return False, _differs(f"resid_post.{i}", f"{name}[{i + 1}]", block, probe, state,
                           f"select the module by its own path, or capture(model, "
                           f"'{blocks}.{i + 1}', inputs=True) for the next block's input"
                           if not last else "select the module by its own path")


def _applied_after(probe: Probe, output: Tensor, state: Tensor) -> bool:
    """Whether a module that ran once took ``output`` in and gave ``state`` out."""
    return any(same_values(values[0], output) and same_values(probe.once(path), state)
               for path, values in probe.inputs.items() if len(values) == 1)


def _differs(standard: str, hidden: str, structural: str | None, probe: Probe, state: Tensor,
             fix: str) -> str:
    """The sentence of a refusal: which hidden state, how far the structural module is from it."""
    value = probe.once(structural) if structural is not None else None
    if structural is None:
        gap = "the structure names no module for it"
    elif value is None:
        gap = f"'{structural}' ran {len(probe.outputs.get(structural, []))} times, not once"
    elif value.shape != state.shape:
        gap = f"'{structural}' gives {tuple(value.shape)}, the hidden state is {tuple(state.shape)}"
    else:
        diff = float((value.float() - state.float().to(value.device)).abs().max())
        gap = f"'{structural}''s output differs from it by up to {diff:.3g}"
    holders = [path for path, _, _ in _holding(probe, state)]
    if holders:  # the values are some module's, in the wrong place for this name (offset states)
        return (f"'{standard}' is the model's own {hidden} (output_hidden_states), but those "
                f"values are the output of '{holders[0]}', which is not where this name reads "
                f"({gap}): the model's hidden_states are not the residual stream before and "
                f"after each block; {fix}")
    return (f"'{standard}' is the model's own {hidden} (output_hidden_states), but no module's "
            f"output holds those values ({gap}): the model computes it outside its modules; {fix}")


standard_naming.CHECKS.update(residuals=checked_residuals, embedding=input_embedding,
                              lists=residual_lists)
