"""Issue 46: a model compiled and warmed up before the first hookscope block (as a server warms
up) is edited and captured by every later block, for the inductor and eager backends, request
after request; an edit whose hooks a wrapper bypasses raises instead of returning the unedited
output. The warm-up must come before hookscope first registers a hook in the process, so each
backend runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.errors import EditError

_SERVER = r'''
import sys, warnings
import torch
from torch import nn
import hookscope

backend = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
compiled = torch.compile(model, backend=backend)
requests = [torch.randn(3, 8) for _ in range(3)]
clean = torch.randn(3, 8)
vector = torch.linspace(-1, 1, 16)
if backend == "eager":  # a training warm-up too (the monitor's steps run with gradients)
    compiled(requests[0]).square().mean().backward()
with torch.no_grad():
    compiled(requests[0])  # the warm-up: compiled before any hookscope block
    source = model[1](model[0](clean))  # plain PyTorch: what patch copies in

    def rest(hidden):  # the model after module "1", plain PyTorch
        return model[4](model[3](model[2](hidden)))

    def hidden(x):
        return model[1](model[0](x))

    expected = {"steer": lambda x: rest(hidden(x) + vector), "edit": lambda x: rest(hidden(x) * -2),
                "ablate": lambda x: rest(hidden(x) * 0), "patch": lambda x: rest(source)}
    with hookscope.capture(model, "1") as clean_acts:
        model(clean)
    verbs = {"steer": lambda: hookscope.steer(compiled, {"1": vector}),
             "edit": lambda: hookscope.edit(compiled, {"1": lambda out: out * -2}),
             "ablate": lambda: hookscope.ablate(compiled, "1"),
             "patch": lambda: hookscope.patch(compiled, source=clean_acts, layers="1")}
    warnings.simplefilter("error", hookscope.errors.HookscopeWarning)  # a warning was all users got
    worst = 0.0
    for verb, block in verbs.items():
        for x in requests:
            with block():
                out = compiled(x)
            worst = max(worst, float((out - expected[verb](x)).abs().max()))
    for x in requests:
        with hookscope.capture(compiled, "1", "3") as acts:
            compiled(x)
        worst = max(worst, float((acts["1"] - hidden(x)).abs().max()),
                    float((acts["3"] - model[3](model[2](hidden(x)))).abs().max()))
    plain = max(float((compiled(x) - model(x)).abs().max()) for x in requests)
if backend == "eager":  # the monitor's hooks are seen too: its statistics equal plain autograd's
    references = []  # plain autograd, outside the monitor (whose hooks would see these calls)
    for x in requests:
        hidden0 = model[0](x)
        hidden0.retain_grad()
        model[4](model[3](model[2](model[1](hidden0)))).square().mean().backward()
        references.append((float(hidden0.mean()), float(hidden0.grad.mean())))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with hookscope.monitor(compiled, "0", every=1, optimizer=optimizer) as monitor:
        for x, (activation, gradient) in zip(requests, references):
            optimizer.zero_grad()
            compiled(x).square().mean().backward()
            optimizer.step()
            latest = monitor.latest["0"]
            worst = max(worst, abs(latest["activation"]["mean"] - activation),
                        abs(latest["gradient"]["mean"] - gradient))
print(f"{worst:.3g} {plain:.3g}")
'''


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_model_warmed_up_before_the_first_block_is_edited_by_every_later_one(backend: str) -> None:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _SERVER, backend], capture_output=True, text=True,
                          timeout=600, cwd=root, env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"})
    assert done.returncode == 0, done.stderr[-3000:]
    worst, plain = (float(v) for v in done.stdout.split())
    assert worst < 1e-5 and plain < 1e-5


class _Bypass(nn.Module):
    """A wrapper whose forward calls its inner block's ``forward`` directly (hooks bypassed)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner.forward(x))


@pytest.mark.parametrize("verb", ["steer", "ablate", "edit"])
def test_an_edit_a_wrapper_bypasses_raises_naming_the_cause_and_fix(verb: str) -> None:
    torch.manual_seed(0)
    model, x = _Bypass(), torch.randn(2, 4)
    blocks = {"steer": lambda **kw: hookscope.steer(model, {"inner": torch.ones(4)}, **kw),
              "ablate": lambda **kw: hookscope.ablate(model, "inner", **kw),
              "edit": lambda **kw: hookscope.edit(model, {"inner": lambda out: out + 1}, **kw)}
    with pytest.raises(EditError, match=r"(?s)ran without its hooks, so the edit was never applied.*"
                                        r"calls inner\.forward\(\.\.\.\) directly.*Call the module "
                                        r"itself \(module\(x\)\)"):
        with blocks[verb]():
            model(x)
    with blocks[verb](on_unfired="ignore"):  # asked for: the unedited output, no error
        out = model(x)
    torch.testing.assert_close(out, model.head(model.inner(x)))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
