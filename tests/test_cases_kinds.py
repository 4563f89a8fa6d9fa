"""Cases 49, 50, 52, 58, 59 and 60 of shared/cases/: values of new kinds (nested tensors,
PackedSequence, complex), the never-ran advice of a Mamba mixer, Opacus' wrapper and hooks,
token labels of a padded batch. Each value is checked against plain PyTorch."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import hookscope
from hookscope import EditError, ExtractError, HookNeverFiredWarning, HookscopeError, MisalignedLabelsWarning


# ----------------------------------------------------------------- case 49: nested tensors
def _encoder(nested: bool = True) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                       batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "enable_nested_tensor is True, but ..." / prototype
        return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=nested).eval()


X49 = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
PAD49 = torch.tensor([[False] * 5, [False, False, False, True, True]])


def _plain_outputs(model: nn.Module, names: tuple[str, ...], *args: Any, **kwargs: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, a, out, n=n: seen.__setitem__(n, out.detach())) for n in names]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_49_capture_repr_stats_extract_of_nested_outputs(tmp_path: Path) -> None:
    enc = _encoder()
    want = _plain_outputs(enc, ("layers.0", "layers.0.linear1"), X49, src_key_padding_mask=PAD49)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with hookscope.capture(enc, "layers.0", "layers.0.linear1") as acts:
            enc(X49, src_key_padding_mask=PAD49)
    got = acts["layers.0"]
    assert got.is_nested
    assert [tuple(c.shape) for c in got.unbind()] == [(5, 8), (3, 8)]
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want["layers.0"].unbind()))
    assert "layers.0: nested[5x8, 3x8]" in repr(acts) and "nested[5x16, 3x16]" in repr(acts)
    nested = r"nested tensor.*kind: nested \(strided\).*enable_nested_tensor=False"
    with pytest.raises(HookscopeError, match=nested):
        acts.save(tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()

    batches = [{"src": X49, "src_key_padding_mask": PAD49}]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = hookscope.stats(enc, batches, layers="layers.0")["layers.0"]
        store = hookscope.extract(enc, batches, ["layers.0"], tmp_path / "s", reduce=None, progress=False)
    real = torch.cat(want["layers.0"].unbind())  # (8 real tokens, 8)
    assert int(result.count) == 64
    assert torch.allclose(result.mean, real.double().mean())
    assert float(result.max) == float(real.max()) and float(result.min) == float(real.min())
    rows = store["layers.0"][:]
    assert [tuple(r.shape) for r in rows] == [(5, 8), (3, 8)]
    assert all(torch.equal(r, c) for r, c in zip(rows, want["layers.0"].unbind()))


def test_49_find_nonfinite_compare_and_steer_on_the_nested_path() -> None:
    enc = _encoder()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert hookscope.find_nonfinite(enc, X49, src_key_padding_mask=PAD49) is None
        diff = hookscope.compare(enc, copy.deepcopy(enc), X49, src_key_padding_mask=PAD49,
                                 layers="layers.0")["layers.0"]
        assert diff.max_abs == 0.0 and diff.shape == (8, 8)
        v = torch.linspace(-1, 1, 8)
        with hookscope.steer(enc, {"layers.0": v}):
            steered = enc(X49, src_key_padding_mask=PAD49)
        padded = _encoder(nested=False)  # the same weights, the padded path, a plain hook
        handle = padded.layers[0].register_forward_hook(lambda m, a, out: out + v)
        try:
            want = padded(X49, src_key_padding_mask=PAD49)
        finally:
            handle.remove()
    real = ~PAD49
    assert torch.allclose(steered[real], want[real], atol=1e-5)
    assert not torch.allclose(steered[real], enc(X49, src_key_padding_mask=PAD49)[real], atol=1e-3)


# ----------------------------------------------------------------- case 50: PackedSequence
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return self.head(pad_packed_sequence(out, batch_first=True)[0])


IDS50 = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 10, 0, 0, 0]])
LENGTHS50 = torch.tensor([3, 5, 2])


def test_50_capture_stats_extract_of_a_packed_output(tmp_path: Path) -> None:
    model = Tagger().eval()
    seen: list[Any] = []
    handle = model.lstm.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    with torch.no_grad():
        model(IDS50, LENGTHS50)
    handle.remove()
    want = seen[0]
    padded, lengths = pad_packed_sequence(want, batch_first=True)
    with torch.no_grad(), hookscope.capture(model, "lstm") as acts:
        model(IDS50, LENGTHS50)
    packed = acts["lstm[0]"]
    assert type(packed).__name__ == "PackedSequence" and torch.equal(packed.data, want.data)
    assert packed.sorted_indices.tolist() == [1, 0, 2]

    batches = [{"ids": IDS50, "lengths": LENGTHS50}]
    with torch.no_grad():
        for layer in ("lstm[0]", "lstm[0][0]"):
            result = hookscope.stats(model, batches, layers=layer)[layer]
            assert int(result.count) == 60 and torch.allclose(result.mean, want.data.double().mean())
        with pytest.raises(ExtractError, match=r"'lstm\[0\]'"):  # the proposal must work...
            hookscope.extract(model, batches, ["lstm"], tmp_path / "bad", reduce=None, progress=False)
        store = hookscope.extract(model, batches, ["lstm[0]"], tmp_path / "s", reduce=None,
                                  progress=False)  # ...and does: one row per input, input order
    rows = store["lstm[0]"][:]
    assert [tuple(r.shape) for r in rows] == [(3, 6), (5, 6), (2, 6)]
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(rows[i], padded[i, :n])


def test_50_steer_the_last_real_token_of_each_packed_sequence() -> None:
    model = Tagger().eval()
    v = torch.arange(6.0)

    def plain_steer(module: nn.Module, args: Any, out: Any) -> Any:
        padded, lengths = pad_packed_sequence(out[0], batch_first=True)
        rows = [padded[i, :n].clone() for i, n in enumerate(lengths.tolist())]
        for row in rows:
            row[-1] += v
        return pack_sequence(rows, enforce_sorted=False), out[1]

    handle = model.lstm.register_forward_hook(plain_steer)
    with torch.no_grad():
        want = model(IDS50, LENGTHS50)
    handle.remove()
    with torch.no_grad(), hookscope.steer(model, {"lstm[0]": v}, positions=-1):
        got = model(IDS50, LENGTHS50)
    assert torch.equal(got, want)
    refused = r"inside a PackedSequence.*select the PackedSequence itself \('lstm\[0\]'\)"
    with pytest.raises(EditError, match=refused):
        with torch.no_grad(), hookscope.steer(model, {"lstm[0][0]": v}, positions=-1):
            model(IDS50, LENGTHS50)


# ----------------------------------------------------------------- case 52: complex values
class SpectralConv1d(nn.Module):
    def __init__(self, channels: int = 4, modes: int = 5) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)

    def forward(self, x_hat: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x_hat)
        out[..., :self.modes] = torch.einsum("bim,iom->bom", x_hat[..., :self.modes], self.weight)
        return out


class FNOBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Conv1d(1, 4, 1)
        self.spectral = SpectralConv1d()
        self.proj = nn.Conv1d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        z = self.spectral(torch.fft.rfft(h))
        return self.proj(torch.relu(torch.fft.irfft(z, n=h.shape[-1]) + h))


class ImagNaN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x, torch.full_like(x, float("nan")))


class RealPart(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.real


def test_52_complex_capture_save_stats_extract(tmp_path: Path) -> None:
    model = FNOBlock().eval()
    x = torch.randn(2, 1, 16)
    want = _plain_outputs(model, ("spectral",), x)["spectral"]
    with torch.no_grad(), hookscope.capture(model, "spectral") as acts:
        model(x)
    assert acts["spectral"].dtype == torch.complex64 and torch.equal(acts["spectral"], want)
    acts.save(tmp_path / "a.safetensors")
    assert torch.equal(hookscope.load(tmp_path / "a.safetensors")["spectral"], want)
    refused = r"complex tensor \[kind: complex, torch.complex64\].*\.real or \.abs\(\)"
    with pytest.raises(HookscopeError, match=refused):
        hookscope.stats(model, [x], layers="spectral")
    with pytest.raises(ExtractError, match=r"complex.*view_as_real"):
        hookscope.extract(model, [x], ["spectral"], tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_52_steer_edit_compare_nonfinite_of_complex_outputs() -> None:
    model = FNOBlock().eval()
    x = torch.randn(2, 1, 16)
    want = _plain_outputs(model, ("spectral",), x)["spectral"]
    cv = torch.randn(9, dtype=torch.cfloat)
    with torch.no_grad(), hookscope.steer(model, {"spectral": cv}), \
            hookscope.capture(model, "spectral") as acts:
        model(x)
    assert torch.equal(acts["spectral"], want + cv)
    with torch.no_grad(), hookscope.edit(model, {"spectral": lambda z: z * 1j}), \
            hookscope.capture(model, "spectral") as turned:
        model(x)
    assert torch.equal(turned["spectral"], want * 1j)
    with pytest.raises(EditError, match="complex vector.*real"):  # a true refusal: lift is real
        with torch.no_grad(), hookscope.steer(model, {"lift": torch.ones(4, 1, dtype=torch.cfloat)}):
            model(x)

    rotated = copy.deepcopy(model)
    with torch.no_grad():
        rotated.spectral.weight.mul_(1j)
    result = hookscope.compare(model, rotated, x)
    assert result.first_divergent is not None and result.first_divergent.path == "spectral"
    assert result["lift"].max_abs == 0.0

    chain = nn.Sequential(nn.Linear(4, 4), ImagNaN(), RealPart(), nn.Linear(4, 2))
    out = chain(torch.randn(3, 4))
    assert bool(torch.isfinite(out).all())  # the final output hides it
    origin = hookscope.find_nonfinite(chain, torch.randn(3, 4))
    assert origin is not None and origin.path == "1"
    assert origin.bad_count == 12 and origin.outputs[0].nan == 12


# ----------------------------------------------------------------- case 58: Mamba
def test_58_never_ran_advice_names_the_function_address_tree_lists() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=3, num_hidden_layers=2,
                                      expand=2, conv_kernel=3, pad_token_id=0, bos_token_id=0,
                                      eos_token_id=0)
    model = transformers.MambaForCausalLM(config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mixer = "backbone.layers.0.mixer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = {r.path: r for r in hookscope.tree(model, ids, ops=True)}
    listed = {op.address for op in rows[mixer].ops}
    assert {f"{mixer}::conv1d", f"{mixer}::silu"} <= listed
    with pytest.warns(HookNeverFiredWarning) as record:
        with torch.no_grad(), hookscope.capture(model, f"{mixer}.conv1d", f"{mixer}.act", f"{mixer}.in_proj"):
            model(ids)
    message = "\n".join(str(r.message) for r in record)
    assert f"the address '{mixer}::conv1d' reaches that value" in message
    assert f"the address '{mixer}::silu' reaches that value" in message
    with torch.no_grad(), hookscope.capture(model, f"{mixer}::conv1d") as acts:
        model(ids)
    assert acts[f"{mixer}::conv1d"].shape == (1, 32, 7)


# ----------------------------------------------------------------- case 59: Opacus
def _private() -> tuple[nn.Module, Any, torch.Tensor, torch.Tensor]:
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp_model, dp_opt, dp_loader = opacus.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
    x, y = next(iter(dp_loader))
    return dp_model, dp_opt, x, y


def test_59_opacus_wrapper_names_and_per_sample_gradients_unchanged() -> None:
    dp_model, dp_opt, x, y = _private()
    nn.functional.cross_entropy(dp_model(x), y).backward()
    plain = dp_model._module[0].weight.grad_sample.clone()
    dp_opt.zero_grad()
    with hookscope.capture(dp_model, "0", grads=True) as acts:
        out = dp_model(x)
        nn.functional.cross_entropy(out, y).backward()
    assert acts.paths == ["0"]
    assert torch.equal(acts["0"], dp_model._module[0](x).detach())
    assert acts.grad("0").shape == (4, 8)
    assert torch.equal(dp_model._module[0].weight.grad_sample, plain)
    assert plain.shape == (4, 8, 4)
    with hookscope.capture(dp_model, "_module.0") as raw:
        dp_model(x)
    assert raw.paths == ["0"]


def test_59_opacus_hooks_are_internal_and_remove_hooks_keeps_them() -> None:
    dp_model, dp_opt, x, y = _private()
    found = hookscope.hooks(dp_model)
    assert sorted((h.path, h.kind) for h in found) == [
        ("0", "backward"), ("0", "forward"), ("2", "backward"), ("2", "forward")]
    assert all(h.registered_by == "opacus" and h.internal for h in found)
    leaked = dp_model._module[0].register_forward_hook(lambda m, a, o: None)
    assert hookscope.remove_hooks(dp_model) == 1  # the user's leaked hook only
    del leaked
    dp_opt.zero_grad()
    nn.functional.cross_entropy(dp_model(x), y).backward()
    before = dp_model._module[0].weight.detach().clone()
    dp_opt.step()  # raises "Per sample gradient is not initialized" if the hooks were gone
    assert dp_model._module[0].weight.grad_sample.shape == (4, 8, 4)
    assert not torch.equal(dp_model._module[0].weight, before)


# ----------------------------------------------------------------- case 60: token ids
class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.block = nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.block(self.emb(input_ids))


def test_60_token_ids_line_up_with_unpadded_rows_and_padded_ones_warn(tmp_path: Path) -> None:
    lm = TinyLM().eval()
    ids = torch.cat([torch.zeros(4, 1, dtype=torch.int64), torch.randint(1, 40, (4, 5))], 1)
    with torch.no_grad():
        want = lm(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MisalignedLabelsWarning)  # fixed length: nothing to warn
        store = hookscope.extract(lm, [({"input_ids": ids}, ids)], ["block"], tmp_path / "s",
                                  reduce=None, progress=False)
    assert torch.equal(store["block"][:], want) and torch.equal(store.labels[:], ids)
    bos = store.labels[:] == 0
    assert torch.equal(store["block"][:][bos], want[:, 0])

    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1] * 6, [1] * 6])
    with pytest.warns(MisalignedLabelsWarning, match=r"labels\[i\]\[attention_mask\[i\]\.bool\(\)\]"):
        padded = hookscope.extract(lm, [({"input_ids": ids, "attention_mask": mask}, ids)], ["block"],
                                   tmp_path / "p", reduce=None, progress=False)
    rows = padded["block"][:]
    assert [len(r) for r in rows] == [6, 4, 6, 6]
    assert torch.equal(rows[1], want[1, 2:])
    assert torch.equal(padded.labels[:][1][mask[1].bool()], ids[1, 2:])
