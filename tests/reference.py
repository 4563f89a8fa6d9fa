"""Plain PyTorch references that hookscope's results are compared with."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hookscope.util.nested import map_tensors


def plain_capture(model: nn.Module, paths: list[str], *args: Any, grad_enabled: bool,
                  **kwargs: Any) -> dict[str, list[Any]]:
    """Outputs of every call of ``paths`` with bare ``register_forward_hook`` and clones.

    ``grad_enabled`` must be the grad mode of the run it is compared with: some kernels differ
    between modes (oneDNN picks another LSTM kernel under ``no_grad`` on some CPUs), so only a
    reference computed in the same mode may be compared bit for bit.
    """
    modules = dict(model.named_modules())
    seen: dict[str, list[Any]] = {p: [] for p in paths}
    handles = [modules[p].register_forward_hook(
        lambda m, i, o, p=p: seen[p].append(map_tensors(lambda t: t.detach().clone(), o)))
        for p in paths]
    try:
        with torch.set_grad_enabled(grad_enabled):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


def assert_same(a: Any, b: Any) -> None:
    """Exact equality of two nested outputs (tensors bitwise, other leaves ==)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for f in a.__dataclass_fields__:
            assert_same(getattr(a, f), getattr(b, f))
    else:
        assert a == b


def logit_diff(output: Any) -> torch.Tensor:
    return (output.logits[:, -1, 5] - output.logits[:, -1, 7]).mean()


def hand_patched(model: nn.Module, module: nn.Module, clean_value: torch.Tensor, position: int,
                 inputs: dict[str, torch.Tensor], metric: Any = None) -> float:
    """The textbook loop: a forward hook that writes the clean value at one absolute position."""
    def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[:, position] = clean_value[:, position]
        return output
    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return float((metric or logit_diff)(model(**inputs)))
    finally:
        handle.remove()


def clean_values(model: nn.Module, modules: list[nn.Module], inputs: dict[str, torch.Tensor]
                 ) -> list[torch.Tensor]:
    kept: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, a, o: kept.append(o.detach())) for m in modules]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return kept
