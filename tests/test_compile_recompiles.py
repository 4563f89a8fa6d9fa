"""Issue 25: a capture open at the first compiled call of a torch.compile'd model made dynamo
recompile hookscope's hook ``__call__`` once per hook object (a hook that breaks the graph: a
gradient watch, a dtype conversion, ``clone=False``'s version counter), so 12 hooked Linears hit
dynamo's recompile limit (8) and printed its warning. Hooks now run outside the graph where they
would break it (``engine.door.hooks._untraced``), and the values stay those of the eager forward."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

import hookscope
from hookscope.engine.door.hooks import OwnedHook

Tensor = torch.Tensor
LAYERS = 12  # more than dynamo's default recompile limit (8)


class Block(nn.Module):
    """Linear(8, 8) then ReLU, returning ``(hidden, input)`` as transformer blocks return tuples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.relu(self.lin(x)), x


class Tower(nn.Module):
    """Twelve blocks in a ModuleList loop (the hooked Linears sit one module deep: a graph break
    in their hooks is then a break in a nested frame, which dynamo compiles on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.h:
            x = block(x)[0]
        return x


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _eager_outputs(model: Tower, x: Tensor) -> list[Tensor]:
    out, kept = x, []
    with torch.no_grad():
        for block in model.h:
            kept.append(block.lin(out))
            out = torch.relu(kept[-1])
    return kept


@pytest.mark.parametrize("options", [{"dtype": torch.float64}, {"grads": True}, {"clone": False}, {}],
                         ids=["dtype", "grads", "clone-false", "plain"])
def test_hooks_of_every_layer_make_no_recompile_per_module(
        options: dict[str, object], fresh_dynamo: None, dynamo_warnings: list[str]) -> None:
    torch.manual_seed(0)
    model = Tower()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(2, 8)
    with hookscope.capture(model, "h.*.lin", **options) as acts:  # type: ignore[arg-type]
        out = compiled(x)
    assert [m for m in dynamo_warnings if "recompile" in m] == []
    compiled_hooks = _debug_get_cache_entry_list(OwnedHook.__call__.__code__)
    # (pre or forward hook) x (input requiring grad or not): 4 at most, never one per module
    assert len(compiled_hooks) <= 4
    expected = _eager_outputs(model, x)
    torch.testing.assert_close(out.detach(), torch.relu(expected[-1]))
    for k in range(LAYERS):
        calls = acts.calls(f"h.{k}.lin")
        assert len(calls) == 1
        want = expected[k].to(options.get("dtype", torch.float32))  # type: ignore[arg-type]
        torch.testing.assert_close(calls[0], want)
    if options.get("grads"):
        out.sum().backward()
        for k, want_grad in enumerate(_eager_grads(model, x)):
            torch.testing.assert_close(acts.grad(f"h.{k}.lin"), want_grad)


def _eager_grads(model: Tower, x: Tensor) -> list[Tensor]:
    """d(sum of the output)/d(each layer's output), plain PyTorch."""
    out, kept = x, []
    for block in model.h:
        kept.append(block.lin(out))
        kept[-1].retain_grad()
        out = torch.relu(kept[-1])
    out.sum().backward()
    return [t.grad for t in kept]  # type: ignore[misc]
