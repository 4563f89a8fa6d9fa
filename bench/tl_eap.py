"""Edge attribution patching on TransformerLens's own ``HookedTransformer`` against the same
weights run as a Hugging Face GPT-2 (issue 46 item 3): ``python -m bench.tl_eap`` in the peer
environment (``.venv-bench``, or any venv with ``bench/requirements-peers.txt``'s
transformer-lens 3.9 and transformers), hookscope on ``PYTHONPATH``. Writes
``bench/tl_eap.json``: the versions, the logits' largest difference, and for EAP and EAP-IG the
edges compared, the largest absolute difference of their scores and Spearman's rank correlation.

TL's ``TransformerBlock.forward`` calls ``ln1`` once for each of q, k and v; hookscope's edge
attribution reads each head's q (k, v) input through the call that projection reads (found from
the autograd graph), so the two models give the same edges. tests/test_transformer_lens_eap.py
asserts the same where transformer_lens is installed, and on a stand-in with TL's blocks always.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor
LAYERS, D_MODEL, HEADS, VOCAB, CTX = 2, 32, 4, 50, 16
OUT = Path(__file__).resolve().parent / "tl_eap.json"


def hf_gpt2(seed: int = 0) -> nn.Module:
    """A tiny GPT-2 with random weights (no downloads), no dropout; eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=LAYERS, n_embd=D_MODEL, n_head=HEADS, vocab_size=VOCAB,
                        n_positions=CTX, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def tl_hooked_transformer(gpt2: nn.Module) -> nn.Module:
    """TL's own ``HookedTransformer`` holding ``gpt2``'s weights (TL's ``convert_gpt2_weights``,
    no LayerNorm folding or centring: the same function as ``gpt2``).

    Raises:
        ImportError: transformer_lens is not installed.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3.x: "HookedTransformer is deprecated"
        from transformer_lens import HookedTransformer, HookedTransformerConfig
        from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
        config = HookedTransformerConfig(
            n_layers=LAYERS, d_model=D_MODEL, n_heads=HEADS, d_head=D_MODEL // HEADS,
            d_mlp=4 * D_MODEL, d_vocab=VOCAB, n_ctx=CTX, act_fn="gelu_new", eps=1e-5,
            normalization_type="LN", positional_embedding_type="standard",
            original_architecture="GPT2LMHeadModel", default_prepend_bos=False)
        model = HookedTransformer(config)
    model.load_state_dict(convert_gpt2_weights(gpt2, config), strict=False)  # + the causal masks
    return model.eval()


def logits_of(out: Any) -> Tensor:
    return out.logits if hasattr(out, "logits") else out  # type: ignore[no-any-return]


def logit_difference(out: Any) -> Tensor:
    """The metric: logit of token 3 minus token 7 at the last position, batch mean."""
    logits = logits_of(out)[:, -1]
    return (logits[:, 3] - logits[:, 7]).mean()


def inputs() -> tuple[Tensor, Tensor]:
    """Clean and corrupted token ids, ``(2, 6)`` each, from a fixed generator."""
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (2, 6), generator=generator),
            torch.randint(0, VOCAB, (2, 6), generator=generator))


def _spearman(a: Tensor, b: Tensor) -> float:
    ranks = [x.argsort().argsort().double() for x in (a, b)]
    return float(torch.corrcoef(torch.stack(ranks))[0, 1])


def compare() -> dict[str, Any]:
    """Run EAP and EAP-IG (5 steps) on both models; return the record written to ``OUT``."""
    import transformer_lens  # noqa: F401  (fails first, naming the missing peer)
    import transformers

    import hookscope
    gpt2 = hf_gpt2()
    tl = tl_hooked_transformer(gpt2)
    clean, corrupted = inputs()
    with torch.no_grad():
        logits = float((logits_of(tl(clean)) - logits_of(gpt2(clean))).abs().max())
    from importlib.metadata import version
    record: dict[str, Any] = {"torch": torch.__version__, "transformer_lens": version("transformer-lens"),
                              "transformers": transformers.__version__,
                              "model": f"GPT-2, {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, "
                                       f"random weights (seed 0)",
                              "logits_max_abs_diff": logits}
    for label, steps in (("eap", None), ("eap_ig_5", 5)):
        ours = hookscope.edge_attribution_patching(tl, clean, corrupted, logit_difference, steps=steps)
        theirs = hookscope.edge_attribution_patching(gpt2, clean, corrupted, logit_difference, steps=steps)
        assert ours.upstream == theirs.upstream and ours.downstream == theirs.downstream
        real = ~theirs.scores.isnan()
        a, b = ours.scores[real], theirs.scores[real]
        record[label] = {"edges": int(real.sum()), "max_abs_diff": float((a - b).abs().max()),
                         "largest_score": float(b.abs().max()), "spearman": _spearman(a, b),
                         "same_nan_pattern": bool(torch.equal(ours.scores.isnan(), theirs.scores.isnan()))}
    return record


def main() -> int:
    try:
        record = compare()
    except ImportError as err:
        print(f"bench.tl_eap needs the peer environment (bench/requirements-peers.txt): {err}",
              file=sys.stderr)
        return 1
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
