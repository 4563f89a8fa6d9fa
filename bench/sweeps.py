"""The ``sweep`` workload: ``hookscope.patching_sweep`` against the hand-written loop of plain
hooks doing the same work with the same batching (issue 21: at most 1.10x).

Both run on the bench's GPT-2 (``models.gpt2``), one prompt of ``SEQ`` tokens, every block's
MLP patched at each of the last ``POSITIONS`` positions: a clean forward keeping the MLP
outputs, a corrupted forward (its metric), then per layer one forward of ``POSITIONS`` copies of
the corrupted prompt, copy ``j`` patched at position ``j`` (``batch_size=POSITIONS``), and the
metric of each copy. Everything under ``torch.no_grad()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bench import models
from bench.peers import Case

Tensor = torch.Tensor
SEQ, POSITIONS = 8, 4
HAND = "hand-written patching loop (plain hooks)"


def prompts(size: models.Size) -> tuple[Tensor, Tensor]:
    """``(clean, corrupted)`` token ids ``(1, SEQ)``, seed 0; they differ at the first token."""
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(0, size.vocab - 1, (1, SEQ), generator=generator)
    corrupted = clean.clone()
    corrupted[0, 0] = (clean[0, 0] + 1) % (size.vocab - 1)
    return clean, corrupted


def metric(output: Any) -> Tensor:
    """Logit difference of tokens 5 and 7 at the last position, mean over rows."""
    return (output.logits[:, -1, 5] - output.logits[:, -1, 7]).mean()


def hand_sweep(model: nn.Module, clean: Tensor, corrupted: Tensor, modules: list[nn.Module],
               positions: list[int]) -> Tensor:
    """The loop a user writes with ``register_forward_hook``: ``(layers, positions)`` float64."""
    sources: list[Tensor] = []
    handles = [m.register_forward_hook(lambda mod, a, out: sources.append(out.detach().clone()))
               for m in modules]
    with torch.no_grad():
        try:
            model(clean)
        finally:
            for handle in handles:
                handle.remove()
        float(metric(model(corrupted)))
        batch = corrupted.repeat(len(positions), 1)
        values = torch.empty(len(modules), len(positions), dtype=torch.float64)
        for i, (module, source) in enumerate(zip(modules, sources)):
            def patch(mod: nn.Module, args: Any, out: Tensor, source: Tensor = source) -> Tensor:
                out = out.clone()
                for j, p in enumerate(positions):
                    out[j, p] = source[0, p]
                return out
            handle = module.register_forward_hook(patch)
            try:
                logits = model(batch).logits
            finally:
                handle.remove()
            values[i] = (logits[:, -1, 5] - logits[:, -1, 7]).double()
    return values


def cases(size: models.Size) -> tuple[list[Case], dict[str, Any]]:
    """The hand-written loop (the floor) and ``patching_sweep``; info for the table."""
    import hookscope

    model = models.gpt2(size)
    clean, corrupted = prompts(size)
    layers = [f"transformer.h.{i}.mlp" for i in range(size.n_layer)]
    modules = [model.get_submodule(path) for path in layers]
    positions = list(range(SEQ - POSITIONS, SEQ))

    def ours() -> Any:
        return hookscope.patching_sweep(model, clean, corrupted, layers="transformer.h.*.mlp",
                                        metric=metric, positions=positions,
                                        batch_size=len(positions), progress=False)

    return ([Case(HAND, "plain hooks", lambda: hand_sweep(model, clean, corrupted, modules, positions),
                  lambda kept: ()),
             Case("hookscope.patching_sweep", "hookscope", ours, lambda kept: (), floor=HAND)],
            {"layers": len(layers), "positions": len(positions), "batch_size": len(positions)})
