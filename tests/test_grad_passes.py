"""Several backward passes through one forward: ``capture(grads=True)`` accumulates them as
``.grad`` does; checked against plain tensor hooks (``register_hook``) that see every pass."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope import NoGrad
from tests.models import MlpStack, Residual, SharedLinear

Tensor = torch.Tensor


def _models() -> dict[str, tuple[Callable[[], nn.Module], list[str], Callable[[], Tensor]]]:
    return {
        "mlp": (MlpStack, ["fc1", "relu", "fc2"], lambda: torch.randn(3, 10)),
        "shared": (SharedLinear, ["lin"], lambda: torch.randn(2, 6)),
        "residual": (lambda: nn.Sequential(Residual(nn.Sequential(nn.Linear(5, 5), nn.Tanh())),
                                           nn.Linear(5, 4)),
                     ["0", "0.inner.0", "1"], lambda: torch.randn(4, 5)),
    }


def _plain_hooks(model: nn.Module, paths: list[str]) -> tuple[dict[str, list[list[Tensor]]], list[object]]:
    """Plain PyTorch: a tensor hook on every call's output, appending each pass's gradient."""
    seen: dict[str, list[list[Tensor]]] = {p: [] for p in paths}
    modules = dict(model.named_modules())

    def forward_hook(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: Tensor) -> None:
            passes: list[Tensor] = []
            seen[path].append(passes)
            output.register_hook(lambda g: passes.append(g.detach().clone()))
        return hook
    handles = [modules[p].register_forward_hook(forward_hook(p)) for p in paths]
    return seen, handles


def _losses(kind: str, out: Tensor, n: int, leaves: list[Tensor]) -> list[Callable[[], object]]:
    """``n`` backward passes through ``out`` down to ``leaves``, each with its own loss."""
    weights = [torch.randn_like(out) for _ in range(n)]
    if kind == "retain":
        return [lambda w=w: (out * w).sum().backward(retain_graph=True) for w in weights]
    if kind == "autograd_grad":
        return [lambda w=w: torch.autograd.grad((out * w).sum(), leaves, retain_graph=True) for w in weights]
    cols = out.shape[1]  # "parts": autograd.grad on the first columns, backward on the rest
    cuts = sorted({0, cols, *[(i * cols) // n for i in range(1, n)]})
    parts = list(zip(cuts, cuts[1:]))
    first = [lambda a=a, b=b: torch.autograd.grad(out[:, a:b].pow(2).sum(), leaves,
                                                      retain_graph=True)
             for a, b in parts[:-1]]
    a, b = parts[-1]
    return [*first, lambda: out[:, a:b].pow(2).sum().backward(retain_graph=True)]


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["mlp", "shared", "residual"]),
       kind=st.sampled_from(["retain", "autograd_grad", "parts"]), n=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_every_backward_pass_is_summed_like_grad(name: str, kind: str, n: int, seed: int) -> None:
    torch.manual_seed(seed)
    make, paths, data = _models()[name]
    model, x = make(), data()
    seen, handles = _plain_hooks(model, paths)
    try:
        with hookscope.capture(model, *paths, grads=True) as acts:
            out = model(x)
        passes = _losses(kind, out, n, list(model.parameters()))
        for run in passes:
            run()
    finally:
        for h in handles:
            h.remove()  # type: ignore[attr-defined]
    for path in paths:
        assert acts.counts[path] == len(seen[path])
        for k, plain in enumerate(seen[path]):
            assert len(plain) == len(passes) and acts.grad_passes(path, k) == len(passes)
            torch.testing.assert_close(acts.grad(path, k), torch.stack(plain).sum(0),
                                       rtol=1e-5, atol=1e-6)


def test_two_losses_then_the_sum_equals_one_backward_of_their_sum() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.capture(model, "fc1", grads=True) as acts:
        out = model(x)
    assert acts.grad_passes("fc1") == 0
    out[:, 0].sum().backward(retain_graph=True)
    first = acts.grad("fc1").clone()
    assert acts.grad_passes("fc1") == 1
    out[:, 1:].pow(2).sum().backward()
    with hookscope.capture(model, "fc1", grads=True) as once:
        again = model(x)
    (again[:, 0].sum() + again[:, 1:].pow(2).sum()).backward()
    torch.testing.assert_close(acts.grad("fc1"), once.grad("fc1"), rtol=1e-5, atol=1e-6)
    assert acts.grad_passes("fc1") == 2 and not torch.allclose(first, acts.grad("fc1"))


def test_input_gradients_accumulate_and_an_unreached_part_stays_nograd() -> None:
    model = nn.LSTM(4, 3, batch_first=True)
    x = torch.randn(2, 5, 4)
    with hookscope.capture(model, "(root)", grads=True, grad_inputs=True) as acts:
        out, (h, c) = model(x)
    out[:, :2].sum().backward(retain_graph=True)
    out[:, 2:].sum().backward(retain_graph=True)
    got_out, (got_h, got_c) = acts.grad("(root)")
    torch.testing.assert_close(got_out, torch.ones_like(out))  # both halves, summed
    assert isinstance(got_h, NoGrad) and isinstance(got_c, NoGrad)
    assert isinstance(acts.grad_input("(root)")[0], NoGrad)  # data: no gradient, the reason kept


def test_grad_inputs_sum_what_flows_through_the_module_over_passes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with hookscope.capture(model, "2", grads=True, grad_inputs=True) as acts:
        out = model(x)
    hidden = model[1](model[0](x))
    (out[:, 0] * 3).sum().backward(retain_graph=True)
    out[:, 1].sum().backward()
    expected = torch.autograd.grad((model[2](hidden) * torch.tensor([3.0, 1.0])).sum(), hidden)[0]
    torch.testing.assert_close(acts.grad_input("2")[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_passes_are_summed_in_the_capture_dtype(dtype: torch.dtype) -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.capture(model, "fc2", grads=True, dtype=dtype) as acts:
        out = model(x)
    for _ in range(3):
        out.sum().backward(retain_graph=True)
    assert acts.grad("fc2").dtype == dtype
    torch.testing.assert_close(acts.grad("fc2"), torch.full((3, 5), 3.0, dtype=dtype))
