"""Path patching (issue 50 item 2; Wang et al. 2022, arXiv:2211.00593) against a hand
implementation with plain torch hooks, on a tiny GPT-2 and a tiny Llama (grouped-query attention)
from configs: senders set to the corrupted run in the output projection's input, every other
head frozen there to the clean run, MLPs recomputed (or frozen with direct=True), the receivers'
q, k or v columns (or MLP input) recorded, then set alone in a clean run. Senders, receivers,
letters and inputs drawn by hypothesis."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import ArgumentTypeError, ArgumentValueError, EditError

transformers = pytest.importorskip("transformers")
Tensor = torch.Tensor
LAYERS, HEADS, HEAD_DIM, WIDTH = 3, 4, 8, 32


def metric(output: object) -> Tensor:
    logits = output.logits  # type: ignore[attr-defined]
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean()


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], nn.ModuleList]
    projection: str                  # the output projection: its input is z, heads merged
    letters: dict[str, tuple[str, int]]  # q, k, v -> (module, column offset of the letter)
    kv_heads: int


FAMILIES = {
    "gpt2": Family(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=60, n_positions=32, bos_token_id=0,
        eos_token_id=0, initializer_range=0.2)), lambda m: m.transformer.h, "attn.c_proj",
        {"q": ("attn.c_attn", 0), "k": ("attn.c_attn", WIDTH), "v": ("attn.c_attn", 2 * WIDTH)}, HEADS),
    "llama": Family(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
        intermediate_size=64, vocab_size=60, max_position_embeddings=32, initializer_range=0.2)),
        lambda m: m.model.layers, "self_attn.o_proj",
        {"q": ("self_attn.q_proj", 0), "k": ("self_attn.k_proj", 0), "v": ("self_attn.v_proj", 0)}, 2),
}


class Hooks:
    """Plain hooks, removed on exit."""

    def __init__(self) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


def _columns(head: int) -> slice:
    return slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)


def _record(model: nn.Module, family: Family, ids: Tensor) -> tuple[float, dict[str, Tensor]]:
    """The metric, each block's z (the projection's input) and MLP output."""
    seen: dict[str, Tensor] = {}
    with Hooks() as hooks, torch.no_grad():
        for layer, block in enumerate(family.blocks(model)):
            hooks.handles.append(block.get_submodule(family.projection).register_forward_pre_hook(
                lambda m, a, layer=layer: seen.__setitem__(f"z{layer}", a[0].clone())))
            hooks.handles.append(block.mlp.register_forward_hook(
                lambda m, a, out, layer=layer: seen.__setitem__(f"m{layer}", out.clone())))
        value = float(metric(model(ids)))
    return value, seen


def hand_path_patching(model: nn.Module, family: Family, clean: Tensor, corrupted: Tensor,
                       senders: list[str], receivers: list[str], through: str,
                       direct: bool) -> float:
    """Wang et al.'s three steps with plain hooks (module docstring)."""
    _, clean_acts = _record(model, family, clean)
    _, corrupted_acts = _record(model, family, corrupted)
    blocks = family.blocks(model)
    got: dict[str, Tensor] = {}
    with Hooks() as hooks, torch.no_grad():  # step 2: senders corrupted, other heads frozen clean
        for layer, block in enumerate(blocks):
            z = clean_acts[f"z{layer}"].clone()
            for node in senders:
                if node.startswith(f"a{layer}.h"):
                    h = _columns(int(node.split(".h")[1]))
                    z[..., h] = corrupted_acts[f"z{layer}"][..., h]
            hooks.handles.append(block.get_submodule(family.projection).register_forward_pre_hook(
                lambda m, a, z=z: (z,)))
            if f"m{layer}" in senders or direct:
                source = corrupted_acts if f"m{layer}" in senders else clean_acts
                hooks.handles.append(block.mlp.register_forward_hook(
                    lambda m, a, out, v=source[f"m{layer}"]: v))
            for letter, (path, _) in family.letters.items():
                hooks.handles.append(block.get_submodule(path).register_forward_hook(
                    lambda m, a, out, key=f"{letter}{layer}": got.__setitem__(key, out.clone())))
            hooks.handles.append(block.mlp.register_forward_pre_hook(
                lambda m, a, layer=layer: got.__setitem__(f"in{layer}", a[0].clone())))
        step2 = float(metric(model(clean)))
    if receivers == ["logits"]:
        return step2
    with Hooks() as hooks, torch.no_grad():  # step 3: only the receivers' inputs set
        for node in receivers:
            layer = int(node[1:].split(".")[0])
            block = blocks[layer]
            if node.startswith("m"):
                hooks.handles.append(block.mlp.register_forward_pre_hook(
                    lambda m, a, v=got[f"in{layer}"]: (v,)))
                continue
            head = int(node.split(".h")[1])
            for letter in through:
                path, offset = family.letters[letter]
                kv = head if letter == "q" else head // (HEADS // family.kv_heads)
                columns = slice(offset + kv * HEAD_DIM, offset + (kv + 1) * HEAD_DIM)

                def set_columns(m: nn.Module, a: object, out: Tensor, v: Tensor = got[f"{letter}{layer}"],
                                columns: slice = columns) -> Tensor:
                    new = out.clone()
                    new[..., columns] = v[..., columns]
                    return new
                hooks.handles.append(block.get_submodule(path).register_forward_hook(set_columns))
        return float(metric(model(clean)))


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[name].build().eval()


def _inputs(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, 60, (3, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 1:4] = torch.randint(0, 60, (3, 3), generator=g)
    return clean, corrupted


@st.composite
def paths(draw: st.DrawFn, family: str) -> tuple[list[str], list[str], str, bool]:
    """Senders in blocks 0-1, receivers after the first sender; k/v receivers as whole groups
    under grouped-query attention."""
    sender_layer = draw(st.integers(0, 1))
    heads = draw(st.lists(st.integers(0, HEADS - 1), min_size=1, max_size=2, unique=True))
    senders = [f"a{sender_layer}.h{h}" for h in heads] + (
        [f"m{sender_layer}"] if draw(st.booleans()) else [])
    kind = draw(st.sampled_from(["heads", "mlp", "logits"]))
    through = draw(st.sampled_from(["q", "k", "v", "qk", "qkv"]))
    direct = draw(st.booleans())
    layer = draw(st.integers(sender_layer + 1, LAYERS - 1))
    if kind == "logits":
        return senders, ["logits"], through, direct
    if kind == "mlp":
        return senders, [f"m{draw(st.integers(sender_layer, LAYERS - 1))}"], through, direct
    group = HEADS // FAMILIES[family].kv_heads if through != "q" else 1
    first = draw(st.integers(0, HEADS // group - 1)) * group
    return senders, [f"a{layer}.h{h}" for h in range(first, first + group)], through, direct


@pytest.mark.parametrize("name", list(FAMILIES))
@settings(max_examples=8, deadline=None)
@given(data=st.data(), seed=st.integers(0, 100))
def test_equals_the_hand_implementation(name: str, data: st.DataObject, seed: int) -> None:
    model = _model(name)
    clean, corrupted = _inputs(seed)
    senders, receivers, through, direct = data.draw(paths(name))
    expected = hand_path_patching(model, FAMILIES[name], clean, corrupted, senders, receivers,
                                  through, direct)
    found = hookscope.path_patching(model, clean, corrupted, senders=senders, receivers=receivers,
                                    through=through, direct=direct, metric=metric)
    assert found.value == pytest.approx(expected, abs=1e-6), (senders, receivers, through, direct)
    with torch.no_grad():
        assert found.clean == pytest.approx(float(metric(model(clean))), abs=1e-7)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_path_moves_the_metric_and_its_letters_differ(name: str) -> None:
    """The premise of the property test: paths carry something, and q, k, v carry different
    amounts (a test where every path gave the clean metric could not tell)."""
    model = _model(name)
    clean, corrupted = _inputs(3)
    kwargs = dict(senders=["a0.h0", "a0.h1", "m0"], receivers=["a2.h0", "a2.h1", "a2.h2", "a2.h3"],
                  metric=metric)
    by_letter = {x: hookscope.path_patching(model, clean, corrupted, through=x, **kwargs).value
                 for x in "qkv"}
    with torch.no_grad():
        clean_value = float(metric(model(clean)))
    assert all(abs(v - clean_value) > 1e-6 for v in by_letter.values()), by_letter
    assert len({round(v, 9) for v in by_letter.values()}) == 3
    found = hookscope.path_patching(model, clean, corrupted, senders=["a0.h0"], receivers=["logits"],
                                    metric=metric)
    assert found.normalized() == pytest.approx((found.value - found.clean) / (found.corrupted - found.clean))


def test_refusals() -> None:
    model = _model("llama")
    clean, corrupted = _inputs(0)
    with pytest.raises(ArgumentValueError, match=r"name all of a1\.h2, a1\.h3 as receivers"):
        hookscope.path_patching(model, clean, corrupted, senders=["a0.h0"], receivers=["a1.h2"],
                                through="k", metric=metric)
    with pytest.raises(ArgumentValueError, match="name receivers in later blocks"):
        hookscope.path_patching(model, clean, corrupted, senders=["a1.h0"], receivers=["a0.h2"],
                                through="q", metric=metric)
    with pytest.raises(ArgumentValueError, match="letters of 'qkv'"):
        hookscope.path_patching(model, clean, corrupted, senders=["a0.h0"], receivers=["a1.h2"],
                                through="x", metric=metric)
    with pytest.raises(ArgumentValueError, match=r"is not a node; name 'a\{l\}\.h\{h\}'"):
        hookscope.path_patching(model, clean, corrupted, senders=["logits"], receivers=["a1.h2"],
                                metric=metric)
    with pytest.raises(ArgumentValueError, match="the model has 3 blocks"):
        hookscope.path_patching(model, clean, corrupted, senders=["a7.h0"], receivers=["logits"],
                                metric=metric)
    with pytest.raises(ArgumentValueError, match=r"block 0 has 4 heads"):
        hookscope.path_patching(model, clean, corrupted, senders=["a0.h9"], receivers=["logits"],
                                metric=metric)
    with pytest.raises(ArgumentTypeError, match="non-empty list of node names"):
        hookscope.path_patching(model, clean, corrupted, senders="a0.h0", receivers=["logits"],
                                metric=metric)
    padded = torch.ones_like(clean)
    padded[:, 0] = 0
    with pytest.raises(EditError, match="attention masks differ.*pad both inputs the same way"):
        hookscope.path_patching(model, {"input_ids": clean, "attention_mask": padded},
                                {"input_ids": corrupted, "attention_mask": torch.ones_like(clean)},
                                senders=["a0.h0"], receivers=["logits"], metric=metric)
    with pytest.raises(EditError, match="give two inputs of the same shape"):
        hookscope.path_patching(model, clean, corrupted[:, :4], senders=["a0.h0"],
                                receivers=["logits"], metric=metric)
