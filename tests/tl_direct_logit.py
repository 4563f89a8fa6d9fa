"""A peer script, run by tests/test_direct_logit_peer.py in an environment with transformer_lens
(its own venv, as the bench runs its peers): TL's ``get_full_resid_decomposition(apply_ln=True)``
dotted with the logit-difference direction, against ``hookscope.direct_logit_attribution`` on the
same real ``HookedTransformer`` (every weight redrawn). Prints one JSON line."""
import importlib.metadata
import json

import torch
import transformer_lens as tl

import hookscope

torch.manual_seed(0)
cfg = tl.HookedTransformerConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=60,
                                 n_ctx=16, act_fn="gelu", normalization_type="LN", seed=0)
model = tl.HookedTransformer(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():  # every parameter drawn (LN gains, biases, b_U)
        p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5)
                + (1.0 if name.endswith(".w") else 0.0))
tokens = torch.randint(0, 60, (3, 7), generator=torch.Generator().manual_seed(1))
a, b = 5, 11
logits, cache = model.run_with_cache(tokens)
stack, labels = cache.get_full_resid_decomposition(apply_ln=True, expand_neurons=False, return_labels=True)
direction = (model.W_U[:, a] - model.W_U[:, b]).detach()
# apply_ln_to_stack centres and divides by the run's scale; TL folds ln_final.w into W_U
# (fold_ln), so the gain goes into the direction here
tl_values = (stack @ (model.ln_final.w * direction)).detach().double()  # (components, batch, pos)
dla = hookscope.direct_logit_attribution(model, tokens, tokens=(a, b))
rename = {f"L{layer}H{h}": f"a{layer}.h{h}" for layer in range(2) for h in range(4)}
rename.update({f"{layer}_mlp_out": f"m{layer}" for layer in range(2)})
extra = float((model.ln_final.b.detach() * direction).sum() + (model.b_U[a] - model.b_U[b]).detach())
worst = 0.0
for i, label in enumerate(labels):
    ours = dla[rename.get(label, label)] - (extra if label == "bias" else 0.0)
    worst = max(worst, float((ours - tl_values[i]).abs().max()))
total = float((dla.values.sum(0) - (logits[..., a] - logits[..., b]).double()).abs().max())
print(json.dumps({"transformer_lens": importlib.metadata.version("transformer_lens"), "labels": labels,
                  "components": dla.components, "max_diff": worst, "sum_vs_logits": total,
                  "scale": float(tl_values.abs().max())}))
