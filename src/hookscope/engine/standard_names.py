"""Standard names: the same addresses on every transformer, resolved by the model's structure.

``resid_pre.{i}``, ``resid_post.{i}``, ``attn_out.{i}``, ``mlp_out.{i}``, ``embed``, ``unembed``
and ``final_norm`` (TransformerLens's ``blocks.{i}.hook_resid_post``, nnterp's standard names)
name the same quantity on GPT-2, GPT-NeoX, Llama/Mistral/Qwen2, Gemma, Phi, BERT and ViT. Each
resolves to the output (or an output part) of one module, so every verb that selects modules
takes them: ``capture(model, "resid_post.3")``, ``steer(model, {"resid_post.*": v})``,
``hookscope capture MODEL --layer attn_out.0``. ``{i}`` may be a number or ``*`` (every block).
A module whose real path is one of these names (a model with its own ``embed``) keeps it.

How a name is resolved (the structural names looked for, first found wins; the tables below
are the whole rule, and a model that has none of them is refused with this list):

- the **blocks**: the ``ModuleList`` whose attribute name is one of ``BLOCKS`` (the longest one
  when several are);
- ``resid_post.{i}``: block ``i``'s output. ``resid_pre.{i}``: its input, which is
  ``resid_post.{i-1}`` for ``i >= 1`` and, for ``i = 0``, the output of the module that feeds the
  blocks, the first of ``BLOCK_INPUT`` among the children of the blocks' parent or grandparent
  (GPT-2's ``drop`` after ``wte + wpe``; Gemma's scaled ``embed_tokens``; BERT's ``embeddings``);
  these equal Hugging Face's ``output_hidden_states[i]`` (``tests/test_standard_names.py``), except
  that GPT-2, GPT-NeoX, Llama, Gemma and Phi apply ``final_norm`` to the last hidden state:
  there ``output_hidden_states[-1]`` is ``final_norm``'s output, not ``resid_post.{L-1}``;
- ``attn_out.{i}`` / ``mlp_out.{i}``: what the attention / MLP adds to the residual stream
  (before any dropout), the first of ``ATTENTION`` / ``MLP`` inside block ``i``. A BERT layer
  is post-norm (``LayerNorm(x + dense(...))``): its ``attention.output.dense`` and
  ``output.dense`` are named, not the modules that add the residual and normalise;
- ``embed`` (token embedding), ``final_norm``, ``unembed``: the first of ``EMBED``,
  ``FINAL_NORM``, ``UNEMBED`` outside the blocks (shortest path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from hookscope.engine.names import ModuleIndex
from hookscope.errors import SelectorError

Part = int | str

BLOCKS = ("h", "layers", "layer", "blocks")
BLOCK_INPUT = ("drop", "emb_dropout", "embed_dropout", "embeddings", "embed_tokens")
# (path inside the block, output parts): attention modules return (output, weights)
ATTENTION: tuple[tuple[str, tuple[Part, ...]], ...] = (
    ("attention.output.dense", ()), ("attn", (0,)), ("self_attn", (0,)), ("attention", (0,)))
MLP: tuple[tuple[str, tuple[Part, ...]], ...] = (("output.dense", ()), ("mlp", ()))
EMBED = ("wte", "embed_tokens", "embed_in", "word_embeddings", "patch_embeddings")
FINAL_NORM = ("ln_f", "norm", "final_layer_norm", "final_layernorm", "layernorm")
UNEMBED = ("lm_head", "embed_out", "unembed")

_NAME = re.compile(r"(resid_pre|resid_post|attn_out|mlp_out)\.(\d+|\*)|embed|unembed|final_norm")


def is_standard(name: str) -> bool:
    """True when ``name`` has the form of a standard name (``resid_post.3``, ``attn_out.*``,
    ``embed``)."""
    return _NAME.fullmatch(name) is not None


_TRANSFORMER_LENS = re.compile(
    r"blocks\.(\d+)\.hook_(resid_pre|resid_post|attn_out|mlp_out)|hook_embed|ln_final\.hook_normalized")


def from_transformer_lens(name: str) -> str | None:
    """The standard name of a TransformerLens hook name (``blocks.3.hook_resid_post`` ->
    ``resid_post.3``, ``hook_embed`` -> ``embed``, ``ln_final.hook_normalized`` ->
    ``final_norm``); None for any other name."""
    match = _TRANSFORMER_LENS.fullmatch(name)
    if match is None:
        return None
    if match.group(1) is not None:
        return f"{match.group(2)}.{match.group(1)}"
    return "embed" if name == "hook_embed" else "final_norm"


def known_standard_names(names: ModuleIndex) -> list[str]:
    """Every standard name the model has, bare (``resid_post.0``, ``attn_out.0``, ...,
    ``resid_pre.{i}`` included): the candidates of a did-you-mean."""
    found = [name.split("[")[0] for named in standard_names(names).values() for name in named]
    blocks = sum(name.startswith("resid_post.") for name in found)
    return found + [f"resid_pre.{i}" for i in range(1, blocks)]


def unresolved_standard(name: str, held: str) -> str:
    """The sentence an error adds when ``name``, looked up in ``held`` (what holds recorded
    values: "this file", "this store"), is a standard name that was not recorded as one (a
    file or store written before standard names were kept, or selected by module path); ""
    for any other name."""
    if not is_standard(name):
        return ""
    return (f" {name!r} is a standard name, which {held} does not map to a module: read the "
            f"module path it resolves to on the model, shown by `hookscope tree MODEL`, or "
            f"record again selecting {name!r} so that the name is kept")


@dataclass(frozen=True)
class Structure:
    """Where a model keeps its blocks: ``blocks`` (the ModuleList's path) and ``count``."""

    blocks: str
    count: int


def resolve_standard(names: ModuleIndex, name: str) -> list[tuple[str, str, tuple[Part, ...]]]:
    """``[(standard name, module path, output parts)]`` that ``name`` means in the model of
    ``names``: one, or one per block for ``resid_post.*`` (``"resid_post.0"``, ...), in block
    order.

    Raises:
        SelectorError: the model has no structure this name needs (the message lists the
            structural names looked for), or the block index is out of range.
    """
    match = _NAME.fullmatch(name)
    assert match is not None
    kind, which = match.group(1), match.group(2)
    if kind is None:
        return [(name, _outside(names, name), ())]
    structure = blocks_of(names, name)
    if which == "*":
        indices = list(range(structure.count))
    else:
        indices = [int(which)]
        if indices[0] >= structure.count:
            raise SelectorError(f"'{name}': the model has {structure.count} blocks "
                                f"('{structure.blocks}.0' ... '{structure.blocks}."
                                f"{structure.count - 1}'): pass an index 0 ... {structure.count - 1}")
    return [(f"{kind}.{i}", *_in_block(names, structure, kind, i)) for i in indices]


def standard_names(names: ModuleIndex) -> dict[str, list[str]]:
    """``{module path: [standard names]}`` for every standard name the model has (for ``tree``);
    ``{}`` for a model without blocks."""
    try:
        structure = blocks_of(names, "")
    except SelectorError:
        return {}
    found: dict[str, list[str]] = {}
    candidates = [f"{kind}.{i}" for i in range(structure.count)
                  for kind in ("resid_post", "attn_out", "mlp_out")]
    for name in ["embed", "resid_pre.0", *candidates, "final_norm", "unembed"]:
        try:
            ((_, path, parts),) = resolve_standard(names, name)
        except SelectorError:
            continue
        found.setdefault(path, []).append(name + "".join(f"[{p}]" for p in parts))
    return found


def blocks_of(names: ModuleIndex, name: str) -> Structure:
    """The model's block list (see the module docstring).

    Raises:
        SelectorError: no ``ModuleList`` named as in ``BLOCKS``.
    """
    lists = [(path, module) for path, module in names.modules.items()
             if isinstance(module, nn.ModuleList) and path.rsplit(".", 1)[-1] in BLOCKS
             and len(module) > 0]
    if not lists:
        raise SelectorError(
            f"'{name}' is a standard name, but {type(names.root).__name__} has no block list this "
            f"resolver knows: it looked for a ModuleList named {', '.join(BLOCKS)} (GPT-2 "
            "'transformer.h', Llama 'model.layers', BERT 'encoder.layer'); select the module by "
            "its own path (hookscope tree MODEL lists them)")
    path, module = max(lists, key=lambda item: len(item[1]))
    return Structure(path, len(module))


def _in_block(names: ModuleIndex, structure: Structure, kind: str,
              i: int) -> tuple[str, tuple[Part, ...]]:
    block = f"{structure.blocks}.{i}"
    if kind == "resid_post":
        return block, ()
    if kind == "resid_pre":
        if i > 0:
            return f"{structure.blocks}.{i - 1}", ()
        return _block_input(names, structure), ()
    table = ATTENTION if kind == "attn_out" else MLP
    for inner, parts in table:
        if f"{block}.{inner}" in names.modules:
            return f"{block}.{inner}", parts
    raise SelectorError(f"'{kind}.{i}': block '{block}' ({type(names.modules[block]).__name__}) "
                        f"has none of the modules looked for: "
                        f"{', '.join(inner for inner, _ in table)}; select it by its own path")


def _block_input(names: ModuleIndex, structure: Structure) -> str:
    parent = structure.blocks.rsplit(".", 1)[0] if "." in structure.blocks else ""
    scopes = [parent] + ([parent.rsplit(".", 1)[0] if "." in parent else ""] if parent else [])
    for candidate in BLOCK_INPUT:
        for scope in scopes:
            path = f"{scope}.{candidate}" if scope else candidate
            if path in names.modules:
                return path
    raise SelectorError(f"'resid_pre.0': no module feeding '{structure.blocks}.0' was found: "
                        f"looked for {', '.join(BLOCK_INPUT)} next to '{structure.blocks}'; use "
                        "capture(..., inputs=True) on the first block")


def _outside(names: ModuleIndex, name: str) -> str:
    table = {"embed": EMBED, "final_norm": FINAL_NORM, "unembed": UNEMBED}[name]
    try:
        inside = blocks_of(names, name).blocks + "."
    except SelectorError:
        inside = None
    for candidate in table:
        paths = [p for p in names.modules if p.rsplit(".", 1)[-1] == candidate
                 and (inside is None or not p.startswith(inside))]
        if paths:
            return min(paths, key=lambda p: p.count("."))
    raise SelectorError(f"'{name}': {type(names.root).__name__} has none of the modules looked "
                        f"for: {', '.join(table)} (outside its blocks); select it by its own path")
