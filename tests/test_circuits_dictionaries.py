"""SAEs and transcoders (issue 50 item 3): SAELens's folder and circuit-tracer's file read as
those libraries define them, spliced in with ``edit`` (equal to plain forward hooks doing the same
by hand; with the error kept, equal to the plain forward), trained from a store's token stream
and from forwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import hookscope
from hookscope import CircuitError, Training

BENCH = Path(__file__).resolve().parents[1] / "bench"
D, F = 16, 24


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=50, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def weights(d_in: int = D, d_out: int = D, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(d_in, F, generator=g) / d_in ** 0.5,
            "b_enc": torch.randn(F, generator=g) * 0.1,
            "W_dec": torch.randn(F, d_out, generator=g) / F ** 0.5,
            "b_dec": torch.randn(d_out, generator=g) * 0.1}


def saelens_folder(path: Path, architecture: str, **extra: object) -> dict[str, torch.Tensor]:
    """A folder as SAELens 6's ``SAE.save_model`` writes it (cfg fields of ``SAEConfig.to_dict``)."""
    w = weights()
    if architecture == "jumprelu":
        w["threshold"] = torch.rand(F) * 0.3
    path.mkdir()
    save_file(w, str(path / "sae_weights.safetensors"))
    cfg = {"d_in": D, "d_sae": F, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
           "normalize_activations": "none", "reshape_activations": "none", "architecture": architecture,
           "meta": {"model_name": "tiny", "hook_name": "blocks.0.hook_resid_post"}, **extra}
    (path / "cfg.json").write_text(json.dumps(cfg))
    return w


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk"])
def test_load_sae_encodes_as_saelens(tmp_path: Path, architecture: str) -> None:
    w = saelens_folder(tmp_path / "sae", architecture, **({"k": 5} if architecture == "topk" else {}))
    sae = hookscope.load_sae(tmp_path / "sae")
    x = torch.randn(3, 7, D)
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]          # SAELens: process_sae_in, then the encoder
    if architecture == "standard":
        expected = torch.relu(pre)
    elif architecture == "jumprelu":
        expected = torch.relu(pre) * (pre > w["threshold"])
    else:
        top = pre.topk(5, dim=-1)
        expected = torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
        assert ((expected > 0).sum(-1) <= 5).all()
    torch.testing.assert_close(sae.encode(x), expected)
    torch.testing.assert_close(sae(x), expected @ w["W_dec"] + w["b_dec"])
    assert sae.hook_name == "blocks.0.hook_resid_post"


def test_load_sae_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(CircuitError, match="SAE.save_model writes both"):
        hookscope.load_sae(tmp_path)
    saelens_folder(tmp_path / "norm", "standard", normalize_activations="expected_average_only_in")
    with pytest.raises(CircuitError, match="fold_activation_norm_scaling_factor"):
        hookscope.load_sae(tmp_path / "norm")
    saelens_folder(tmp_path / "gated", "gated")
    with pytest.raises(CircuitError, match="not one hookscope reads"):
        hookscope.load_sae(tmp_path / "gated")
    for missing in ("W_enc", "b_enc", "W_dec", "b_dec"):  # a bare KeyError for a bias, before
        folder = tmp_path / f"no-{missing}"
        w = saelens_folder(folder, "standard")
        save_file({k: v for k, v in w.items() if k != missing}, str(folder / "sae_weights.safetensors"))
        with pytest.raises(CircuitError, match="not SAELens's W_enc, b_enc, W_dec, b_dec"):
            hookscope.load_sae(folder)


def test_load_transcoder_reads_circuit_tracers_file() -> None:
    """The file circuit-tracer's ``SingleLayerTranscoder.to_safetensors`` wrote (bench/), and the
    weights it was built from, in hookscope's layout."""
    tc = hookscope.load_transcoder(BENCH / "circuit_tracer_transcoder0.safetensors")
    peer = load_file(str(BENCH / "circuit_tracer_graph.safetensors"))
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(tc, name).detach(), peer[f"tc0.{name}"]), name
    assert tc.activation == "relu"


def test_transcoder_file_round_trip_with_threshold(tmp_path: Path) -> None:
    tc = hookscope.Transcoder(**weights(), activation="jumprelu", threshold=torch.rand(F))
    tc.save_circuit_tracer(tmp_path / "t.safetensors")
    raw = load_file(str(tmp_path / "t.safetensors"))
    assert raw["W_enc"].shape == (F, D) and "activation_function.threshold" in raw  # circuit-tracer's layout
    back = hookscope.load_transcoder(tmp_path / "t.safetensors")
    x = torch.randn(5, D)
    torch.testing.assert_close(back(x), tc(x))
    save_file({**raw, "W_skip": torch.eye(D)}, str(tmp_path / "skip.safetensors"))
    with pytest.raises(CircuitError, match="skip connection"):
        hookscope.load_transcoder(tmp_path / "skip.safetensors")


def test_dictionary_shapes_are_checked() -> None:
    w = weights()
    with pytest.raises(CircuitError, match=r"pass W_dec\.T"):
        hookscope.Transcoder(**{**w, "W_dec": w["W_dec"].T.contiguous()})
    with pytest.raises(CircuitError, match="activation='jumprelu'"):
        hookscope.Transcoder(**w, threshold=0.1)
    with pytest.raises(CircuitError, match="use Transcoder"):
        hookscope.SAE(**weights(D, 8))


def _by_hand(model: torch.nn.Module, path: str, replace) -> torch.Tensor:
    """The same replacement with a plain forward hook."""
    handle = model.get_submodule(path).register_forward_hook(lambda m, args, out: replace(args[0], out))
    try:
        with torch.no_grad():
            return model(IDS).logits
    finally:
        handle.remove()


IDS = torch.tensor([[0, 5, 9, 13, 2, 7, 31, 4]])


def test_splice_transcoder_equals_a_plain_hook(gpt2: torch.nn.Module) -> None:
    w = weights()
    tc = hookscope.Transcoder(**w)
    expected = _by_hand(gpt2, "transformer.h.1.mlp",
                        lambda x, out: torch.relu(x @ w["W_enc"] + w["b_enc"]) @ w["W_dec"] + w["b_dec"])
    with torch.no_grad(), hookscope.splice(gpt2, {"transformer.h.1.mlp": tc}) as spliced:
        logits = gpt2(IDS).logits
    torch.testing.assert_close(logits, expected)
    with torch.no_grad():
        plain = gpt2(IDS).logits
    assert not torch.allclose(logits, plain)                     # the splice changed something
    (features,) = spliced.features["transformer.h.1.mlp"]
    assert features.shape == (1, 8, F) and (features >= 0).all() and (features > 0).any()


def test_splice_sae_equals_a_plain_hook(gpt2: torch.nn.Module) -> None:
    w = weights()
    sae = hookscope.SAE(**w)
    expected = _by_hand(gpt2, "transformer.h.0.mlp",
                        lambda x, out: torch.relu((out - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) @ w["W_dec"]
                        + w["b_dec"])
    with torch.no_grad(), hookscope.splice(gpt2, {"transformer.h.0.mlp": sae}):
        torch.testing.assert_close(gpt2(IDS).logits, expected)


@pytest.mark.parametrize("kind", ["sae", "transcoder"])
def test_keep_error_gives_the_plain_forward_and_gradients_through_features(gpt2: torch.nn.Module,
                                                                          kind: str) -> None:
    dictionary = hookscope.SAE(**weights()) if kind == "sae" else hookscope.Transcoder(**weights())
    with torch.no_grad():
        plain = gpt2(IDS).logits
    with hookscope.splice(gpt2, {"transformer.h.*.mlp": dictionary}, keep_error=True) as spliced:
        logits = gpt2(IDS).logits
        logits[0, -1, 3].backward()
    assert torch.equal(logits.detach(), plain)                   # exactly, not to a tolerance
    assert len(spliced.features["transformer.h.*.mlp"]) == 2     # both layers, in call order
    assert dictionary.W_dec.grad is not None and dictionary.W_dec.grad.abs().sum() > 0
    gpt2.zero_grad()
    assert hookscope.hooks(gpt2) == []


def test_splice_refuses_what_is_not_a_dictionary(gpt2: torch.nn.Module) -> None:
    with pytest.raises(CircuitError, match=r"hookscope\.Transcoder"):
        hookscope.splice(gpt2, {"transformer.h.0.mlp": torch.nn.Linear(D, D)})  # type: ignore[dict-item]


# ------------------------------------------------------------------------------------ training
def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(6):
        ids = torch.randint(1, 50, (4, 12), generator=g)
        ids[:, 0] = 0
        mask = (torch.arange(12) < torch.randint(5, 13, (4, 1), generator=g)).long()
        out.append({"input_ids": ids * mask + 49 * (1 - mask), "attention_mask": mask})
    return out


def test_store_stream_pairs_are_aligned_tokens(gpt2: torch.nn.Module, tmp_path: Path) -> None:
    """The transcoder's pairs from a store: the MLP applied to each streamed input gives the
    streamed output, so the two layers' streams are read in the same order."""
    from hookscope.circuits.training import _store_pairs

    data = batches()
    store = hookscope.extract(gpt2, data, ["transformer.h.0.ln_2", "transformer.h.0.mlp"], tmp_path / "s",
                              progress=False)
    options = Training(d_features=F, batch_size=32, buffer_tokens=64, exclude=(0,))
    pairs = list(_store_pairs(store, "transformer.h.0.ln_2", "transformer.h.0.mlp", options))
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    real = sum(int(b["attention_mask"].sum()) for b in data) - 4 * len(data)   # less one BOS a row
    assert len(x) == real
    with torch.no_grad():
        torch.testing.assert_close(gpt2.transformer.h[0].mlp(x), y, rtol=1e-4, atol=1e-5)


def test_training_from_forwards_equals_a_plain_loop(gpt2: torch.nn.Module) -> None:
    """Forward mode, against the same objective written with plain hooks and plain Adam."""
    data = batches()
    options = Training(d_features=F, batch_size=40, lr=3e-3, l1=1e-3, exclude=(0,))
    tc = hookscope.train_transcoder(data, "transformer.h.1.mlp", "transformer.h.1.mlp", options, model=gpt2)
    xs, ys = [], []
    module = gpt2.transformer.h[1].mlp

    def keep(m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        xs.append(args[0])
        ys.append(out)
    handle = module.register_forward_hook(keep)
    try:
        with torch.no_grad():
            for b in data:
                gpt2(**b)
    finally:
        handle.remove()
    keep = [b["attention_mask"].bool() & (b["input_ids"] != 0) for b in data]
    x = torch.cat([a[k] for a, k in zip(xs, keep)])
    y = torch.cat([a[k] for a, k in zip(ys, keep)])
    g = torch.Generator().manual_seed(0)
    w_dec = torch.randn(F, D, generator=g)
    params = {"W_dec": w_dec / w_dec.norm(dim=1, keepdim=True) * 0.1}
    params["W_enc"] = params["W_dec"].T.clone()
    params.update(b_enc=torch.zeros(F), b_dec=torch.zeros(D))
    params = {k: v.requires_grad_() for k, v in params.items()}
    adam = torch.optim.Adam([params["W_enc"], params["b_enc"], params["W_dec"], params["b_dec"]], lr=3e-3)
    losses = []
    for start in range(0, len(x), 40):
        xb, yb = x[start:start + 40], y[start:start + 40]
        f = torch.relu(xb @ params["W_enc"] + params["b_enc"])
        loss = ((f @ params["W_dec"] + params["b_dec"] - yb).pow(2).sum(-1)
                + 1e-3 * (f * params["W_dec"].norm(dim=1)).sum(-1)).mean()
        adam.zero_grad()
        loss.backward()
        adam.step()
        losses.append(float(loss.detach()))
    assert tc.losses == pytest.approx(losses, rel=1e-4)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        torch.testing.assert_close(getattr(tc, name).detach(), params[name].detach(), rtol=1e-4, atol=1e-5)


def test_training_from_a_store_learns(gpt2: torch.nn.Module, tmp_path: Path) -> None:
    data = batches()
    store = hookscope.extract(gpt2, data, "transformer.h.0", tmp_path / "s", progress=False)
    options = Training(d_features=64, batch_size=32, buffer_tokens=64, lr=1e-2, l1=1e-4, epochs=30,
                       exclude=(0,))
    sae = hookscope.train_sae(store, "transformer.h.0", options)
    x = store.tokens("transformer.h.0", exclude=[0])[:]
    unexplained = (sae(x) - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    assert float(unexplained) < 0.2 and sae.losses[-1] < sae.losses[0] / 3
    with pytest.raises(CircuitError, match="pass model=None"):
        hookscope.train_sae(store, "transformer.h.0", options, model=gpt2)
    with pytest.raises(CircuitError, match="pass model="):
        hookscope.train_sae(data, "transformer.h.0", options)


def test_the_kept_rows_are_on_the_batchs_device() -> None:
    """Which tokens train a dictionary, decided on the batch's device (a CPU mask &= a GPU
    mask raised; the meta device stands in for a GPU here), padding and excluded ids dropped."""
    from hookscope.circuits.training import _keep

    for device in ("cpu", "meta"):
        batch = {"input_ids": torch.tensor([[5, 2, 7], [2, 9, 0]], device=device),
                 "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)}
        keep = _keep(batch, torch.Size([2, 3]), [2])
        assert keep.device.type == device
        if device == "cpu":
            assert keep.tolist() == [[True, False, True], [False, True, False]]
