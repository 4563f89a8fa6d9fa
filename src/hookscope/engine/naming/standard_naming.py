"""Standard names: the same addresses on every transformer, resolved by the model's structure.

``resid_pre.{i}``, ``resid_post.{i}``, ``attn_out.{i}``, ``mlp_out.{i}``, ``embed``, ``unembed``
and ``final_norm`` (TransformerLens's ``blocks.{i}.hook_resid_post``, nnterp's standard names)
name the same quantity on GPT-2, GPT-NeoX, Llama/Mistral/Qwen2, Gemma, Phi, BERT and ViT, and
on TransformerLens's ``HookedTransformer`` (``blocks.{i}.hook_resid_pre``/``hook_resid_post``/
``hook_attn_out``/``hook_mlp_out``, ``attn.hook_q/k/v/z``, ``embed``, ``ln_final``, ``unembed``). Each
resolves to the output (or an output part) of one module, so every verb that selects modules
takes them: ``capture(model, "resid_post.3")``, ``steer(model, {"resid_post.*": v})``,
``hookscope capture MODEL --layers attn_out.0``. ``{i}`` may be a number or ``*`` (every block).
A module whose real path is one of these names (a model with its own ``embed``) keeps it.

How a name is resolved (the structural names looked for, first found wins; the tables below
are the whole rule, and a model that has none of them is refused with this list):

- the **blocks**: the ``ModuleList`` whose attribute name is one of ``BLOCKS``; when several
  are, those whose blocks' outputs are the model's own hidden states (``engine.naming.residual_check``;
  T5's ``encoder.block``, not ``decoder.block.0.layer``), then the longest, then the first;
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
  ``FINAL_NORM``, ``UNEMBED`` outside the blocks (shortest path);
- ``attn.q.{i}``, ``attn.k.{i}``, ``attn.v.{i}``: block ``i``'s queries, keys and values per
  head, ``(batch, seq, heads, head_dim)`` (TransformerLens's ``hook_q/k/v``: before any rotary
  embedding; under grouped-query attention k and v have the key-value heads): a heads part
  (``util.nested.heads_part``) of the output of the first of ``FUSED`` (GPT-2's ``c_attn``:
  q, k, v one after the other; GPT-NeoX's ``query_key_value``: q, k, v inside each head) or of
  ``SEPARATE`` (``q_proj``, BERT's ``query``) inside block ``i``;
- ``attn.z.{i}``: the per-head attention output before the output projection (TransformerLens's
  ``hook_z``): the value of ``scaled_dot_product_attention`` called by the first of ``CORE``
  inside block ``i``, ``(batch, heads, seq, head_dim)`` (the layout table knows its axes), so
  it needs an attention that calls it (transformers' default ``attn_implementation="sdpa"``;
  another ``config._attn_implementation`` is refused, naming the fix);
  ``attn.hook_z`` (a ``HookedTransformer``) is taken as it is, ``(batch, seq, heads,
  head_dim)``. The head size is the attention module's ``head_dim``/``head_size``/
  ``attention_head_size``, else the config's ``d_head`` or hidden size over heads.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from hookscope.engine.naming.names import ModuleIndex
from hookscope.errors import SelectorError
from hookscope.util import heads_part

__all__ = ["Resolved", "Structure", "blocks_of", "branch_norms", "from_transformer_lens",
           "is_standard", "known_standard_names", "resolve_standard", "unresolved_standard",
           "standard_names"]

Part = int | str

BLOCKS = ("h", "layers", "layer", "blocks", "block")
BLOCK_INPUT = ("drop", "emb_dropout", "embed_dropout", "embeddings", "embed_tokens")
# (path inside the block, output parts): attention modules return (output, weights)
ATTENTION: tuple[tuple[str, tuple[Part, ...]], ...] = (
    ("hook_attn_out", ()), ("attention.output.dense", ()), ("attn", (0,)), ("self_attn", (0,)),
    ("attention", (0,)))
MLP: tuple[tuple[str, tuple[Part, ...]], ...] = (("hook_mlp_out", ()), ("output.dense", ()),
                                                 ("mlp", ()))
# a HookedTransformer's block has its residual stream's hook points: they are taken first
RESIDUAL = {"resid_pre": "hook_resid_pre", "resid_post": "hook_resid_post"}
EMBED = ("wte", "embed_tokens", "embed_in", "word_embeddings", "patch_embeddings")
FINAL_NORM = ("ln_f", "ln_final", "norm", "final_layer_norm", "final_layernorm", "layernorm")
UNEMBED = ("lm_head", "embed_out", "unembed")
# (path inside the block, interleaved): one projection making q, k and v, in this order
FUSED = (("attn.c_attn", False), ("attention.query_key_value", True))
# a projection each: the path inside the block, with {} its letter's name
SEPARATE: tuple[tuple[str, tuple[str, str, str]], ...] = (
    ("attn.hook_{}", ("q", "k", "v")), ("self_attn.{}_proj", ("q", "k", "v")),
    ("attention.{}_proj", ("q", "k", "v")), ("attention.self.{}", ("query", "key", "value")),
    ("attn.{}_proj", ("q", "k", "v")))
# the attention module whose own forward calls scaled_dot_product_attention
CORE = ("attn", "self_attn", "attention.self", "attention")
SDPA = "scaled_dot_product_attention"
# the norm in front of the attention / the MLP of a pre-norm block: its input is what the
# branch reads from the residual stream (edge attribution's downstream nodes)
ATTENTION_NORM = ("ln_1", "ln1", "input_layernorm")
MLP_NORM = ("ln_2", "ln2", "post_attention_layernorm")

# the checks against the model's own values (``engine.naming.residual_check`` registers them when it is
# imported, with the engine): the selection language itself stands on no hook code
CHECKS: dict[str, Callable[..., Any]] = {}
_SUGGESTING = contextvars.ContextVar("suggesting", default=False)  # did-you-mean: no probe forward

_NAME = re.compile(r"(resid_pre|resid_post|attn_out|mlp_out|attn\.[qkvz])\.(\d+|\*)"
                   r"|embed|unembed|final_norm")


def is_standard(name: str) -> bool:
    """True when ``name`` has the form of a standard name (``resid_post.3``, ``attn_out.*``,
    ``embed``)."""
    return _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class Structure:
    """Where a model keeps its blocks: ``blocks`` (the ModuleList's path) and ``count``."""

    blocks: str
    count: int


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
    token = _SUGGESTING.set(True)
    try:
        found = [name.split("::")[0].split("[")[0] for named in standard_names(names).values()
                 for name in named]
    finally:
        _SUGGESTING.reset(token)
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


Resolved = tuple[str, str, tuple[Part, ...], "str | None"]


def resolve_standard(names: ModuleIndex, name: str) -> list[Resolved]:
    """``[(standard name, module path, output parts, function)]`` that ``name`` means in the
    model of ``names``: one, or one per block for ``resid_post.*`` (``"resid_post.0"``, ...), in
    block order; ``function`` is ``None`` (the module's output) or the function whose value it
    is (``attn.z.{i}``: ``"scaled_dot_product_attention"``).

    Raises:
        SelectorError: the model has no structure this name needs (the message lists the
            structural names looked for), or the block index is out of range.
    """
    match = _NAME.fullmatch(name)
    assert match is not None
    kind, which = match.group(1), match.group(2)
    if kind is None:
        return [(name, _outside(names, name), (), None)]
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


def _block_lookup(names: ModuleIndex, block: str, inner: str) -> str | None:
    path = f"{block}.{inner}"
    return path if path in names.modules else None


def standard_names(names: ModuleIndex) -> dict[str, list[str]]:
    """``{module path: [standard names]}`` for every standard name the model has (for ``tree``);
    ``{}`` for a model without blocks."""
    try:
        structure = blocks_of(names, "")
    except SelectorError:
        return {}
    found: dict[str, list[str]] = {}
    candidates = [f"{kind}.{i}" for i in range(structure.count)
                  for kind in ("resid_post", "attn_out", "mlp_out", "attn.q", "attn.k", "attn.v",
                               "attn.z")]
    for name in ["embed", "resid_pre.0", *candidates, "final_norm", "unembed"]:
        try:
            ((_, path, parts, op),) = resolve_standard(names, name)
        except SelectorError:
            continue
        found.setdefault(path, []).append(name + (f"::{op}" if op else "")
                                          + "".join(f"[{p}]" for p in parts))
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
    if len(lists) > 1 and "lists" in CHECKS and not _SUGGESTING.get():
        lists = CHECKS["lists"](names, lists)
    path, module = max(lists, key=lambda item: len(item[1]))
    return Structure(path, len(module))


def _in_block(names: ModuleIndex, structure: Structure, kind: str,
              i: int) -> tuple[str, tuple[Part, ...], str | None]:
    block = f"{structure.blocks}.{i}"
    if kind in RESIDUAL and (path := _block_lookup(names, block, RESIDUAL[kind])) is not None:
        return path, (), None
    if kind in ("resid_post", "resid_pre"):
        path, _, op = _checked_residual(names, structure, kind, i).partition("::")
        return path, (), op or None
    if kind.startswith("attn."):
        return _per_head(names, block, kind[-1], f"{kind}.{i}")
    table = ATTENTION if kind == "attn_out" else MLP
    for inner, parts in table:
        if f"{block}.{inner}" in names.modules:
            return f"{block}.{inner}", parts, None
    raise SelectorError(f"'{kind}.{i}': block '{block}' ({type(names.modules[block]).__name__}) "
                        f"has none of the modules looked for: "
                        f"{', '.join(inner for inner, _ in table)}; select it by its own path")


def _checked_residual(names: ModuleIndex, structure: Structure, kind: str, i: int) -> str:
    """The path of ``{kind}.{i}`` by structure, checked against the model's own hidden states
    (``engine.naming.residual_check``: the module whose output holds them, a function call
    ``path::op#N`` of the model's own code where no module's does, or a refusal)."""
    try:
        block_input: str | None = _block_input(names, structure)
        missing = None
    except SelectorError as err:
        block_input, missing = None, err
    try:
        final_norm: str | None = _outside(names, "final_norm")
    except SelectorError:
        final_norm = None
    name = f"{kind}.{i}"
    if "residuals" in CHECKS and not _SUGGESTING.get():
        checked = CHECKS["residuals"](names, structure.blocks, structure.count, block_input, final_norm)
        if name in checked.refused:
            raise SelectorError(checked.refused[name])
        if name in checked.paths:
            return str(checked.paths[name])
    if kind == "resid_post":
        return f"{structure.blocks}.{i}"
    if i > 0:
        return f"{structure.blocks}.{i - 1}"
    if block_input is None:
        assert missing is not None
        raise missing
    return block_input


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
    if name == "embed" and "embedding" in CHECKS and not _SUGGESTING.get():
        if (path := CHECKS["embedding"](names)) is not None:
            return str(path)  # the model's own answer (get_input_embeddings()) before the table
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


def _per_head(names: ModuleIndex, block: str, letter: str,
              name: str) -> tuple[str, tuple[Part, ...], str | None]:
    """Where block ``block`` keeps ``attn.{letter}`` (module docstring): (path, parts, op)."""
    if letter == "z":
        if (path := _block_lookup(names, block, "attn.hook_z")) is not None:
            return path, (heads_part(None),), None
        core = next((p for inner in CORE if (p := _block_lookup(names, block, inner))), None)
        implementation = getattr(getattr(names.root, "config", None), "_attn_implementation", None)
        if core is not None and implementation not in (None, "sdpa"):
            raise SelectorError(
                f"'{name}' is the value of {SDPA} called by '{core}', but the model's attention "
                f"is {implementation!r} (config._attn_implementation), which never calls it: load "
                f"the model with attn_implementation='sdpa' (or model.set_attn_implementation("
                f"'sdpa')), or capture the output projection's input with inputs=True")
        if core is not None:
            return core, (), SDPA
        looked = ", ".join(CORE)
    else:
        piece = "qkv".index(letter)
        for template, words in SEPARATE:
            if (path := _block_lookup(names, block, template.format(words[piece]))) is not None:
                split = template.startswith("attn.hook_")
                return path, (heads_part(None if split else _head_dim(names, block)),), None
        for inner, interleaved in FUSED:
            if (path := _block_lookup(names, block, inner)) is not None:
                return path, (heads_part(_head_dim(names, block), piece, 3,
                                         interleaved=interleaved),), None
        looked = ", ".join([inner for inner, _ in FUSED] + [t.format(w[piece]) for t, w in SEPARATE])
    raise SelectorError(f"'{name}': block '{block}' ({type(names.modules[block]).__name__}) has "
                        f"none of the modules looked for: {looked}; select it by its own path")


def _head_dim(names: ModuleIndex, block: str) -> int:
    """The head size of block ``block``'s attention (module docstring)."""
    for inner in CORE:
        module = names.modules.get(f"{block}.{inner}")
        for attribute in ("head_dim", "head_size", "attention_head_size"):
            value = getattr(module, attribute, None)
            if isinstance(value, int) and value > 0:
                return value
    config = getattr(names.root, "config", None) or getattr(names.root, "cfg", None)
    given = getattr(config, "d_head", None) or getattr(config, "head_dim", None)
    if isinstance(given, int) and given > 0:
        return given
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if isinstance(width, int) and isinstance(heads, int) and heads > 0:
        return width // heads
    raise SelectorError(f"'{block}': the attention's head size was not found (an attribute "
                        f"head_dim, head_size or attention_head_size of {', '.join(CORE)}, or "
                        "config.head_dim / hidden_size over num_attention_heads); select the "
                        "projection by its own path")


def branch_norms(names: ModuleIndex, i: int, structure: Structure) -> tuple[str, str]:
    """The paths of the norms in front of block ``i``'s attention and MLP (``ATTENTION_NORM``,
    ``MLP_NORM``): the input of each is what that branch reads from the residual stream, in a
    sequential pre-norm block (``x + attn(ln_1(x))``, then ``+ mlp(ln_2(.))``).

    Raises:
        SelectorError: the block has no such norms, or the model runs attention and MLP in
            parallel (``config.use_parallel_residual``, GPT-J, Phi), where the MLP reads the
            block's input and not the attention's output.
    """
    block = f"{structure.blocks}.{i}"
    config = getattr(names.root, "config", None)
    found = [next((p for inner in table if (p := _block_lookup(names, block, inner))), None)
             for table in (ATTENTION_NORM, MLP_NORM)]
    if getattr(config, "use_parallel_residual", False) or None in found:
        raise SelectorError(
            f"block '{block}' ({type(names.modules[block]).__name__}) is not a sequential pre-norm "
            f"block: looked for a norm before the attention ({', '.join(ATTENTION_NORM)}) and one "
            f"before the MLP ({', '.join(MLP_NORM)})"
            + (" and found attention and MLP run in parallel (config.use_parallel_residual)"
               if getattr(config, "use_parallel_residual", False) else "")
            + "; edge attribution needs blocks of the GPT-2 / Llama form")
    return found[0], found[1]  # type: ignore[return-value]
