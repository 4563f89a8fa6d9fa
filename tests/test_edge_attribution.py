"""Edge attribution patching (issue 36 item 3) on a tiny 2-layer GPT-2 from a config: every edge's
score ranked against exact edge patching computed here with plain PyTorch hooks (the downstream
node's input given the upstream node's clean output, all else corrupted: an MLP's or the logits'
norm input, one head's q, k or v recomputed by hand), the EAP formula against plain autograd,
other families, refusals, the picture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.errors import ArgumentValueError, EditError, SelectorError
from tests.hooked_transformer import build as build_tl

transformers = pytest.importorskip("transformers")
HEAD_DIM = 8
EAP_IG_STEPS = 10


def _gpt2(initializer_range: float = 0.02) -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=60, n_positions=32, bos_token_id=0,
        eos_token_id=0, initializer_range=initializer_range)).eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 60, (4, 6), generator=g)
    corrupted = clean.clone()
    corrupted[:, 1] = torch.randint(0, 60, (4,), generator=g)
    corrupted[:, 3] = torch.randint(0, 60, (4,), generator=g)
    return clean, corrupted


def metric(output: object) -> torch.Tensor:
    logits = output.logits  # type: ignore[attr-defined]
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean()


def _outputs(model: nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """The metric and each upstream node's output by plain hooks: the block input, each MLP's
    output, what each c_proj receives (the heads' z, merged)."""
    seen: dict[str, torch.Tensor] = {}
    handles = [model.transformer.drop.register_forward_hook(
        lambda m, a, o: seen.__setitem__("input", o.detach()))]
    for layer, block in enumerate(model.transformer.h):
        handles.append(block.mlp.register_forward_hook(
            lambda m, a, o, layer=layer: seen.__setitem__(f"m{layer}", o.detach())))
        handles.append(block.attn.c_proj.register_forward_pre_hook(
            lambda m, a, layer=layer: seen.__setitem__(f"z{layer}", a[0].detach())))
    with torch.no_grad():
        value = float(metric(model(ids)))
    for handle in handles:
        handle.remove()
    return value, seen


def _contribution(model: nn.Module, acts: dict[str, torch.Tensor], node: str) -> torch.Tensor:
    """What upstream ``node`` adds to the residual stream: a head is its z slice through its
    rows of c_proj's weight (Conv1D: x @ W), without the bias."""
    if not node.startswith("a"):
        return acts[node]
    layer, h = map(int, node[1:].split(".h"))
    rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
    return acts[f"z{layer}"][..., rows] @ model.transformer.h[layer].attn.c_proj.weight[rows].detach()


def _norm(model: nn.Module, node: str) -> nn.Module:
    if node == "logits":
        return model.transformer.ln_f
    block = model.transformer.h[int(node[1:].split(".")[0])]
    return block.ln_1 if node[0] == "a" else block.ln_2


def _head_input_patch(model: nn.Module, node: str,
                      delta: torch.Tensor) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that give only head h's q (k, v) the residual stream plus ``delta``: ln_1's input
    is kept, and c_attn's output columns of that head and letter are recomputed from it by hand
    (layer norm and x @ W + b), the other columns left as they are."""
    layer, head, letter = node[1:].split(".")
    block = model.transformer.h[int(layer)]
    seen: list[torch.Tensor] = []
    start = "qkv".index(letter) * 32 + int(head[1:]) * HEAD_DIM
    columns = slice(start, start + HEAD_DIM)

    def replace(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        ln = block.ln_1
        x = torch.nn.functional.layer_norm(seen[-1] + delta, (32,), ln.weight, ln.bias, ln.eps)
        new = output.clone()
        new[..., columns] = (x @ module.weight + module.bias)[..., columns]
        return new

    return [block.ln_1.register_forward_pre_hook(lambda m, a: seen.append(a[0])),
            block.attn.c_attn.register_forward_hook(replace)]


def exact_edge_patching(model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor,
                        edges: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """metric(corrupted run, downstream input + clean - corrupted upstream) - metric(corrupted):
    an MLP or the logits read it at their norm's input, a head's q, k or v by hand."""
    base, corrupted_acts = _outputs(model, corrupted)
    _, clean_acts = _outputs(model, clean)
    found = {}
    for up, down in edges:
        delta = _contribution(model, clean_acts, up) - _contribution(model, corrupted_acts, up)
        if down[0] == "a":
            handles = _head_input_patch(model, down, delta)
        else:
            handles = [_norm(model, down).register_forward_pre_hook(lambda m, a, d=delta: (a[0] + d,))]
        with torch.no_grad():
            found[(up, down)] = float(metric(model(corrupted))) - base
        for handle in handles:
            handle.remove()
    return found


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = (torch.tensor(x).argsort().argsort().double() for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _rank_against_exact(steps: int | None, initializer_range: float = 0.02) -> tuple[float, int]:
    model = _gpt2(initializer_range)
    clean, corrupted = _inputs()
    edges = hookscope.edge_attribution_patching(model, clean, corrupted, metric, steps=steps)
    rows = edges.rows()
    exact = exact_edge_patching(model, clean, corrupted, [(u, d) for u, d, _ in rows])
    return spearman([s for _, _, s in rows], [exact[(u, d)] for u, d, _ in rows]), len(rows)


def test_eap_ig_ranks_edges_as_exact_edge_patching() -> None:
    """GPT-2's own initialisation (initializer_range 0.02): EAP-IG 0.951, EAP 0.874."""
    rho, count = _rank_against_exact(EAP_IG_STEPS)
    # input -> 12 + 1 + 12 + 1 + 1; 4 heads of block 0 -> m0, 12 of block 1, m1, logits;
    # m0 -> 14; 4 heads of block 1 -> m1, logits; m1 -> logits
    assert count == 27 + 4 * 15 + 14 + 4 * 2 + 1
    assert rho >= 0.9
    assert rho == pytest.approx(0.951, abs=0.005)
    assert _rank_against_exact(None)[0] == pytest.approx(0.874, abs=0.005)


def test_far_from_linear_eap_ranks_better_than_eap_ig() -> None:
    """Weights 5x larger (initializer_range 0.1): EAP 0.914, EAP-IG 0.857. IG averages gradients
    on the way to the clean run; one edge patched into the corrupted run is EAP's point."""
    assert _rank_against_exact(None, 0.1)[0] == pytest.approx(0.914, abs=0.005)
    assert _rank_against_exact(EAP_IG_STEPS, 0.1)[0] == pytest.approx(0.857, abs=0.005)


def test_eap_equals_plain_autograd() -> None:
    """EAP's score is (clean - corrupted upstream) . d metric / d (downstream norm input), taken
    here with plain hooks and autograd."""
    model = _gpt2()
    clean, corrupted = _inputs()
    edges = hookscope.edge_attribution_patching(model, clean, corrupted, metric)
    _, clean_acts = _outputs(model, clean)
    _, corrupted_acts = _outputs(model, corrupted)
    zeros: dict[str, torch.Tensor] = {}

    def add_zero(node: str):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            zeros[node] = torch.zeros_like(args[0], requires_grad=True)
            return (args[0] + zeros[node],)
        return hook

    blocks = ["a0", "m0", "a1", "m1", "logits"]  # the norms' inputs: a block's heads read one
    handles = [_norm(model, d).register_forward_pre_hook(add_zero(d)) for d in blocks]
    value = metric(model(corrupted))
    for handle in handles:
        handle.remove()
    grads = dict(zip(blocks, torch.autograd.grad(value, [zeros[d] for d in blocks]), strict=True))
    by_block: dict[tuple[str, str], float] = {}
    for up, down, score in edges.rows():
        block = down.split(".")[0]
        by_block[(up, block)] = by_block.get((up, block), 0.0) + score
    for (up, block), score in by_block.items():
        delta = _contribution(model, clean_acts, up) - _contribution(model, corrupted_acts, up)
        # the heads' q, k, v inputs of a block add up to its attention norm's input
        assert score == pytest.approx(float((delta.double() * grads[block].double()).sum()),
                                      rel=1e-5, abs=1e-9), (up, block)
    assert edges.clean == pytest.approx(_outputs(model, clean)[0])
    assert edges.corrupted == pytest.approx(_outputs(model, corrupted)[0])
    assert torch.isnan(edges.scores[edges.upstream.index("m1"), edges.downstream.index("a1.h0.q")])
    assert edges.downstream[:3] == ["a0.h0.q", "a0.h1.q", "a0.h2.q"] and edges.steps is None
    assert not any(p.grad is not None for p in model.parameters())


def test_table_and_picture(tmp_path: Path) -> None:
    model = _gpt2()
    clean, corrupted = _inputs()
    edges = hookscope.edge_attribution_patching(model, clean, corrupted, metric, steps=2,
                                                plot=tmp_path / "edges" / "top.png")
    lines = edges.table(3).splitlines()
    assert lines[0].split() == ["upstream", "downstream", "score"] and len(lines) == 4
    top = edges.rows()[0]
    assert lines[1].split()[:2] == [top[0], top[1]]
    assert (tmp_path / "edges" / "top.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_other_families_run() -> None:
    """A HookedTransformer (z is (batch, seq, heads, head_dim)) and Llama (grouped-query)."""
    tl = build_tl()
    ids = torch.tensor([[3, 14, 15, 9], [35, 8, 9, 7]])
    other = ids.flip(1)
    edges = hookscope.edge_attribution_patching(tl, ids, other, lambda out: out[:, -1, 5].mean())
    assert edges.upstream[:3] == ["input", "a0.h0", "a0.h1"] and edges.downstream[-1] == "logits"
    assert edges.scores.shape == (1 + 2 * 5, 2 * 13 + 1) and len(edges.rows()) == 110
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=60, max_position_embeddings=32)).eval()
    found = hookscope.edge_attribution_patching(llama, ids, other, lambda out: out.logits[:, -1, 5].mean())
    assert found.scores.shape == (11, 2 * (4 + 2 + 2 + 1) + 1)  # k, v: 2 key-value heads
    assert "a1.h1.k" in found.downstream and "a1.h2.k" not in found.downstream
    assert found.scores.nan_to_num().abs().sum() > 0


def test_refusals() -> None:
    model = _gpt2()
    clean, corrupted = _inputs()
    with pytest.raises(ArgumentValueError, match="steps"):
        hookscope.edge_attribution_patching(model, clean, corrupted, metric, steps=0)
    torch.manual_seed(0)
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=60, max_position_embeddings=32)).eval()
    with pytest.raises(SelectorError, match=r"in parallel .*edge attribution needs blocks of the GPT-2"):
        hookscope.edge_attribution_patching(neox, clean, corrupted, metric)


@pytest.mark.parametrize("steps", [None, 2])
def test_runs_whose_real_tokens_sit_at_other_positions_are_refused(steps: int | None) -> None:
    """A review found edges scored position by position with the masks never read: a clean run
    padded on the left set against an unpadded corrupted run compared a real token with
    padding, silently. The two masks must be equal; equal masks score as before."""
    model = _gpt2()
    clean, corrupted = _inputs()
    padded = torch.ones_like(clean)
    padded[:, 0] = 0
    with pytest.raises(EditError, match=r"attention masks differ.*pad both inputs the same way"):
        hookscope.edge_attribution_patching(
            model, {"input_ids": clean, "attention_mask": padded},
            {"input_ids": corrupted, "attention_mask": torch.ones_like(corrupted)}, metric, steps=steps)
    same = hookscope.edge_attribution_patching(
        model, {"input_ids": clean, "attention_mask": padded},
        {"input_ids": corrupted, "attention_mask": padded}, metric, steps=steps)
    assert torch.isfinite(same.scores.nan_to_num(0.0)).all() and same.scores.nan_to_num(0.0).abs().sum() > 0
