"""Cases 59, 61, 66, 67, 69 and 72 of ../shared/cases (issue 46 item 5), each asserted against
plain PyTorch: Opacus' ``_module.`` names in ``monitor``, gradients under AMP's GradScaler,
``convert_sync_batchnorm``'s dropped activation, the meta device, eager-mode QAT's observer
hooks and ``torch.func.functional_call``'s fast weights."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope
from hookscope.errors import HookNeverFiredError, HookscopeError


# ----------------------------------------------------------------- case 59: Opacus and monitor
def _private(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opacus' notes on secure RNG
        return opacus.PrivacyEngine().make_private(  # type: ignore[no-any-return]
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)


def _dp_steps(dp_model: nn.Module, dp_opt: Any, loader: Any) -> None:
    for x, y in loader:
        dp_opt.zero_grad()
        F.cross_entropy(dp_model(x), y).backward()
        dp_opt.step()


@pytest.mark.parametrize("name", ["_module.0", "0", "_module.*"])
def test_59_monitor_takes_opacus_wrapper_names_as_capture_does(name: str) -> None:
    plain_model, plain_opt, plain_loader = _private()
    _dp_steps(plain_model, plain_opt, plain_loader)  # the same DP steps, unwatched
    dp_model, dp_opt, loader = _private()
    seen: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:  # plain PyTorch's view
        seen["out"] = out.detach().clone()
        out.register_hook(lambda g: seen.__setitem__("grad", g.detach().clone()))

    handle = dp_model._module[0].register_forward_hook(keep)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hookscope.MonitorFaultWarning)
        with hookscope.monitor(dp_model, [name], every=1, optimizer=dp_opt) as mon:
            _dp_steps(dp_model, dp_opt, loader)
    handle.remove()
    assert mon.step_index == 4 and mon.events == []  # the 4 DP steps over the loader
    assert "0" in mon.latest and mon.latest["0"]["step"] == 3
    activation, gradient = mon.latest["0"]["activation"], mon.latest["0"]["gradient"]
    assert activation["mean"] == pytest.approx(seen["out"].double().mean().item(), abs=1e-6)
    assert activation["absmax"] == pytest.approx(seen["out"].abs().max().item(), abs=1e-6)
    assert gradient["mean"] == pytest.approx(seen["grad"].double().mean().item(), abs=1e-7)
    assert gradient["std"] == pytest.approx(seen["grad"].double().std(correction=0).item(), abs=1e-7)
    for watched, plain in zip(dp_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(watched, plain)  # per-sample clipping and noise untouched
    assert dp_model._module[0].weight.grad_sample is not None


# ----------------------------------------------------------------- case 61: AMP GradScaler
def _amp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_61_monitor_with_a_scaler_reports_the_true_gradient() -> None:
    model = _amp_model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    hidden = reference[0](x)  # the true gradient at model[0]'s output, without a scaler
    true = torch.autograd.grad(F.mse_loss(reference[2](reference[1](hidden)), y), hidden)[0].double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with hookscope.monitor(model, "0", every=1, scaler=scaler) as mon:
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        mon.step()
    record = mon.latest["0"]
    assert record["loss_scale"] == 2.0 ** 16  # the scale it divided out
    assert record["gradient"]["mean"] == pytest.approx(true.mean().item(), rel=1e-5)
    assert record["gradient"]["std"] == pytest.approx(true.std(correction=0).item(), rel=1e-5)
    assert record["gradient"]["absmax"] == pytest.approx(true.abs().max().item(), rel=1e-5)
    assert record["gradient"]["absmax"] < 1.0  # not the 1.5e4 a hook reads under the scale


def test_61_an_overflow_step_of_the_scaler_is_counted_not_an_alarm() -> None:
    model = _amp_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)  # the scaled loss overflows
    x, y = torch.randn(4, 8), torch.randn(4, 1) * 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NonFiniteStepWarning, no fault
        with hookscope.monitor(model, "0", every=1, scaler=scaler) as mon:
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)  # skipped: inf gradients
            scaler.update()
            mon.step()
    assert mon.overflows == 1 and mon.events == []
    assert scaler.get_scale() == 2.0 ** 126  # the scaler halved its scale, as torch does
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


# ----------------------------------------------------------------- case 66: SyncBatchNorm
class BatchNormAct2d(nn.BatchNorm2d):  # timm's BatchNormAct2d: norm and activation in one module
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def _converted() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), BatchNormAct2d(8), nn.Conv2d(8, 4, 3)).eval()
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)).eval()
    return model, synced, torch.randn(2, 3, 12, 12)


def test_66_compare_names_the_converted_norm_first() -> None:
    model, synced, x = _converted()
    result = hookscope.compare(model, synced, x)
    first = result.first_divergent
    assert first is not None and first.path == "1"
    with torch.no_grad():
        expected = (model[1](model[0](x)) - synced[1](synced[0](x))).abs().max().item()
    assert first.max_abs == pytest.approx(expected, rel=1e-6)
    assert result["0"].close and result["0"].max_abs == 0.0  # the conv before is the same


def test_66_a_capture_of_the_dropped_activation_says_it_is_held_but_never_used() -> None:
    _, synced, x = _converted()
    with pytest.raises(HookNeverFiredError, match=r"1\.act \(ReLU\) is held by '1' but never used: "
                                                  r"no method of .*SyncBatchNorm refers to 'act'"):
        with torch.no_grad(), hookscope.capture(synced, "1.act", on_unfired="error"):
            synced(x)
    assert not synced[1].act._forward_hooks  # nothing left behind


def test_66_a_functional_call_in_place_of_the_child_keeps_its_own_advice() -> None:
    class Functional(nn.Module):  # declares act but applies F.relu: the functional hint stays
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(2, 2), nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.fc(x))

    model = Functional()
    with pytest.raises(HookNeverFiredError, match=r"functional form instead.*'::relu' reaches"):
        with hookscope.capture(model, "act", on_unfired="error"):
            model(torch.randn(1, 2))


# ----------------------------------------------------------------- case 67: the meta device
def _feature_net(device: str) -> nn.Module:
    features = nn.Sequential(nn.Conv2d(3, 8, kernel_size=3), nn.ReLU(), nn.MaxPool2d(kernel_size=2),
                             nn.Conv2d(8, 16, kernel_size=4), nn.ReLU(), nn.MaxPool2d(kernel_size=3))
    return nn.Sequential(features, nn.Flatten(), nn.Linear(16 * 3 * 3, 10)).to(device)


def test_67_tree_and_capture_on_meta_give_the_shapes_of_a_real_run() -> None:
    meta, cpu = _feature_net("meta"), _feature_net("cpu")
    x_meta, x_cpu = torch.rand(32, 3, 28, 28, device="meta"), torch.rand(32, 3, 28, 28)
    shapes: dict[str, tuple[int, ...]] = {}
    handles = [m.register_forward_hook(
        lambda m, a, out, name=name: shapes.__setitem__(name, tuple(out.shape)))
        for name, m in cpu.named_modules()]
    cpu(x_cpu)
    for handle in handles:
        handle.remove()
    rows = {row.path: row.outputs for row in hookscope.tree(meta, x_meta)}
    assert rows == {row.path: row.outputs for row in hookscope.tree(cpu, x_cpu)}
    assert rows["0.3"] == ("32x16x10x10 float32",)
    with pytest.warns(RuntimeWarning, match="meta tensor"), hookscope.capture(meta, "**") as acts:
        meta(x_meta)
    assert {p: tuple(acts[p].shape) for p in acts.paths} == {p: s for p, s in shapes.items() if p}
    assert all(acts[p].device.type == "meta" for p in acts.paths)


def test_67_value_verbs_refuse_meta_tensors_naming_the_device() -> None:
    meta, x = _feature_net("meta"), torch.rand(2, 3, 28, 28, device="meta")
    with pytest.raises(HookscopeError, match="meta tensor.*no values"):
        hookscope.stats(meta, [x])
    with pytest.raises(HookscopeError, match="meta tensor.*no values to check for NaN/Inf"):
        hookscope.find_nonfinite(meta, x)
    assert not any(m._forward_hooks for m in meta.modules())


# ----------------------------------------------------------------- case 69: QAT observers
def _qat() -> nn.Module:
    import torch.ao.quantization as tq
    torch.manual_seed(0)
    model = nn.Sequential(tq.QuantStub(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4),
                          tq.DeQuantStub()).train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tq.prepare_qat(model)  # type: ignore[no-any-return]


def test_69_a_capture_of_the_qat_linear_is_what_the_next_module_receives() -> None:
    qat = _qat()
    untouched = copy.deepcopy(qat)
    received: list[torch.Tensor] = []
    handle = qat[2].register_forward_pre_hook(lambda m, a: received.append(a[0].detach().clone()))
    x = torch.randn(4, 8)
    with hookscope.capture(qat, "1") as acts:
        out = qat(x)
    handle.remove()
    assert torch.equal(acts["1"], received[0])  # fake-quantized: the observer hook ran first
    with torch.no_grad():
        raw = F.linear(x, qat[1].weight_fake_quant(qat[1].weight), qat[1].bias)
    assert acts["1"].unique().numel() < raw.unique().numel()  # fewer distinct values than before it
    torch.testing.assert_close(out, untouched(x), rtol=0, atol=0)  # QAT numerics unchanged


def test_69_observer_hooks_are_internal_and_survive_remove_hooks() -> None:
    qat = _qat()
    observers = [h for h in hookscope.hooks(qat) if h.function == "_observer_forward_hook"]
    assert sorted(h.path for h in observers) == ["0", "1", "3"]
    assert all(h.internal and h.registered_by == "torch" for h in observers)
    before = copy.deepcopy(qat)
    qat[1].register_forward_hook(lambda m, a, out: out * 0)  # a leaked user hook
    assert hookscope.remove_hooks(qat) == 1
    x = torch.randn(4, 8)
    torch.testing.assert_close(qat(x), before(x), rtol=0, atol=0)  # fake-quant kept


# ----------------------------------------------------------------- case 72: functional_call
def _fast() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fast = {k: (v.detach() * 2 + 0.1).requires_grad_() for k, v in model.named_parameters()}
    return model, fast, torch.randn(3, 4)


def test_72_capture_and_grads_inside_functional_call_use_the_fast_weights() -> None:
    from torch.func import functional_call
    model, fast, x = _fast()
    with hookscope.capture(model, "0", grads=True) as acts:
        y = functional_call(model, fast, (x,))
        (weight_grad,) = torch.autograd.grad(y.sum(), [fast["0.weight"]])
    with torch.no_grad():
        hidden = F.linear(x, fast["0.weight"], fast["0.bias"])
        by_hand = (1 - torch.tanh(hidden) ** 2) * fast["2.weight"].sum(0)  # d y.sum / d hidden
    torch.testing.assert_close(acts["0"], hidden)
    torch.testing.assert_close(acts.grad("0"), by_hand)
    torch.testing.assert_close(weight_grad, by_hand.T @ x)
    assert model[0].weight.grad is None  # the module's own weights got nothing


def test_72_an_edit_inside_functional_call_changes_that_call() -> None:
    from torch.func import functional_call
    model, fast, x = _fast()
    vector = torch.linspace(-1, 1, 8)
    with torch.no_grad():
        hidden = F.linear(x, fast["0.weight"], fast["0.bias"]) + vector
        expected = F.linear(torch.tanh(hidden), fast["2.weight"], fast["2.bias"])
        with hookscope.steer(model, {"0": vector}):
            got = functional_call(model, fast, (x,))
        plain = functional_call(model, fast, (x,))
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(plain, expected)  # the steer is gone after the block
