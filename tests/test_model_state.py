"""Case 38: a verb that runs forwards of its own leaves the model as it found it.

Buffers (BatchNorm statistics, ``num_batches_tracked``, spectral norm's ``_u``/``_v``), the
train/eval flag of every module, ``requires_grad`` and ``.grad`` of every parameter and the
global RNG state are the same after ``tree``, ``find_nonfinite``, ``stats``, ``compare``,
``attention``, ``gradcam``, ``patching_sweep`` and ``extract`` as before: when the verb
returns, when it raises after a forward ran, and on a KeyboardInterrupt mid-forward.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.nn.utils.parametrizations import spectral_norm

import hookscope
from hookscope.engine.run import untouched
from tests.models import MlpStack


# ------------------------------------------------------------------------------- case 38
def _case38_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), spectral_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(2.0)
    return model


CASE38_VERBS: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "tree": lambda m, x: hookscope.tree(m, x),
    "find_nonfinite": lambda m, x: hookscope.find_nonfinite(m, x, backward=True),
    "stats": lambda m, x: hookscope.stats(m, [x, x]),
    "compare": lambda m, x: hookscope.compare(m, m, x),
}


@pytest.mark.parametrize("verb", list(CASE38_VERBS))
def test_case38_summary_forward_leaves_batchnorm_and_spectral_norm(verb: str) -> None:
    model, x_val = _case38_model(), torch.randn(4, 3, 16, 16)
    model.eval()
    before = model(x_val).detach()
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    CASE38_VERBS[verb](model, torch.rand(2, 3, 16, 16))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, state_before[k])]
    assert changed == []  # plain torch changed 5: 1.running_mean/var/num_batches_tracked, 5.._u/_v
    assert int(model[1].num_batches_tracked) == 0
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    assert torch.equal(model(x_val).detach(), before)


def test_case38_plain_forward_does_change_the_state() -> None:
    """The premise, so the test above can fail: a train-mode forward changes those 5 entries."""
    model = _case38_model()
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.rand(2, 3, 16, 16))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, state_before[k])]
    assert changed == ["1.running_mean", "1.running_var", "1.num_batches_tracked",
                       "5.parametrizations.weight.0._u", "5.parametrizations.weight.0._v"]


# ------------------------------------------------------------------------------- generated models
class Trap(nn.Module):
    """Passes its input through, or raises ``armed`` (after the layers before it ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed is not None:
            raise self.armed
        return x


class Tokens(nn.Module):
    """``(batch, c, h, w)`` -> ``(batch, h * w, c)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)


class Attn(nn.Module):
    """One head of eager attention with dropout on its probabilities."""

    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.qk, self.drop = nn.Linear(d, 2 * d), nn.Dropout(p)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(t).chunk(2, dim=-1)
        probs = torch.softmax(q[:, None] @ k[:, None].transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return (self.drop(probs) @ t[:, None])[:, 0] + t


@dataclass(frozen=True)
class Spec:
    channels: int
    bn2d: bool
    bn1d: bool
    sn_conv: bool
    sn_head: bool
    p: float
    classes: int
    eval_modules: tuple[int, ...]  # modules put in eval mode inside the train-mode model
    frozen: tuple[int, ...]  # parameters with requires_grad=False
    with_grad: tuple[int, ...]  # parameters holding a .grad before the verb


class Net(nn.Module):
    def __init__(self, s: Spec) -> None:
        super().__init__()
        c = s.channels
        conv = nn.Conv2d(3, c, 3, padding=1)
        self.stem = nn.Sequential(spectral_norm(conv) if s.sn_conv else conv,
                                  nn.BatchNorm2d(c) if s.bn2d else nn.Identity(), nn.ReLU(),
                                  nn.Dropout(s.p))
        self.trap = Trap()
        self.feat = nn.Conv2d(c, c, 3, padding=1)
        self.tok = Tokens()
        self.attn = Attn(c, s.p)
        self.norm = nn.BatchNorm1d(c) if s.bn1d else nn.Identity()
        head = nn.Linear(c, s.classes)
        self.head = spectral_norm(head) if s.sn_head else head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.attn(self.tok(self.feat(self.trap(self.stem(x)))))
        return self.head(self.norm(t.mean(dim=1)))


SPECS = st.builds(
    Spec, channels=st.sampled_from([2, 4]), bn2d=st.booleans(), bn1d=st.booleans(),
    sn_conv=st.booleans(), sn_head=st.booleans(), p=st.sampled_from([0.0, 0.5]),
    classes=st.sampled_from([3, 5]),
    eval_modules=st.lists(st.integers(0, 12), max_size=3).map(tuple),
    frozen=st.lists(st.integers(0, 12), max_size=4).map(tuple),
    with_grad=st.lists(st.integers(0, 12), max_size=4).map(tuple))


def _build(s: Spec) -> Net:
    model = Net(s).train()
    model(torch.randn(3, 3, 6, 6))  # a "trained" state: BatchNorm statistics, power iterations
    modules, params = list(model.modules()), list(model.parameters())
    for i in s.eval_modules:
        modules[i % len(modules)].eval()
    for i in s.frozen:
        params[i % len(params)].requires_grad_(False)
    for i in s.with_grad:
        params[i % len(params)].grad = torch.randn_like(params[i % len(params)])
    return model


def _extract(m: nn.Module, x: torch.Tensor, **options: Any) -> Any:
    with tempfile.TemporaryDirectory() as folder:
        return hookscope.extract(m, [x, x], "feat", f"{folder}/store", progress=False, **options)


VERBS: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "tree": lambda m, x: hookscope.tree(m, x),
    "find_nonfinite": lambda m, x: hookscope.find_nonfinite(m, x),
    "find_nonfinite backward": lambda m, x: hookscope.find_nonfinite(m, x, backward=True),
    "stats": lambda m, x: hookscope.stats(m, [x, x * 2]),
    "compare": lambda m, x: hookscope.compare(m, m, x),
    "attention": lambda m, x: hookscope.attention(m, x, layers="attn"),
    "gradcam": lambda m, x: hookscope.gradcam(m, x, "feat"),
    "rollout(gradient=True)": lambda m, x: hookscope.rollout(m, x, layers="attn", gradient=True),
    "patching_sweep": lambda m, x: hookscope.patching_sweep(
        m, x, x.flip(0), layers="tok", metric=lambda out: out[:, 0].mean(), positions=[0, 3],
        progress=False),
    "extract": _extract,
}


@dataclass
class Snapshot:
    state: dict[str, torch.Tensor]
    flags: list[bool]
    requires_grad: list[bool]
    grads: list[tuple[torch.Tensor | None, torch.Tensor | None]]  # (object, values)
    rng: torch.Tensor

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        return cls({k: v.clone() for k, v in model.state_dict().items()},
                   [m.training for m in model.modules()],
                   [p.requires_grad for p in model.parameters()],
                   [(p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()],
                   torch.get_rng_state())

    def assert_same(self, model: nn.Module) -> None:
        state = model.state_dict()
        assert list(state) == list(self.state)
        assert [k for k, v in state.items() if not torch.equal(v, self.state[k])] == []
        assert [m.training for m in model.modules()] == self.flags
        assert [p.requires_grad for p in model.parameters()] == self.requires_grad
        for p, (grad, values) in zip(model.parameters(), self.grads, strict=True):
            assert p.grad is grad
            assert values is None or torch.equal(p.grad, values)
        assert torch.equal(torch.get_rng_state(), self.rng)


@pytest.mark.parametrize("verb", list(VERBS))
@settings(max_examples=3, deadline=None)
@given(spec=SPECS)
# a train-mode BatchNorm after the attention: a backward after its buffers were restored in place
# failed autograd's version check (rollout(gradient=True) restored them between forward and backward)
@example(spec=Spec(2, False, True, False, False, 0.0, 3, (), (), ()))
def test_every_verb_leaves_a_train_mode_model_as_it_was(verb: str, spec: Spec) -> None:
    model, x = _build(spec), torch.randn(3, 3, 6, 6)
    before = Snapshot.of(model)
    VERBS[verb](model, x)
    before.assert_same(model)


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("raised", [RuntimeError("boom mid-forward"), KeyboardInterrupt()])
def test_a_verb_that_raises_mid_forward_still_restores(verb: str, raised: BaseException) -> None:
    """The trap fires after the stem's BatchNorm, spectral norm and dropout already ran."""
    model, x = _build(Spec(4, True, True, True, True, 0.5, 3, (), (1,), (0, 2))), torch.randn(3, 3, 6, 6)
    before = Snapshot.of(model)
    model.trap.armed = raised
    with pytest.raises(type(raised)):
        VERBS[verb](model, x)
    model.trap.armed = None
    before.assert_same(model)


AFTER_FORWARD: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "gradcam: target out of range": lambda m, x: hookscope.gradcam(m, x, "feat", target=99),
    "rollout: target out of range": lambda m, x: hookscope.rollout(m, x, layers="attn",
                                                                    target=99),
    "gradcam: tokens that fit no grid": lambda m, x: hookscope.gradcam(m, x, "tok", grid=(7, 7)),
    "patching_sweep: metric raises": lambda m, x: hookscope.patching_sweep(
        m, x, x, layers="tok", metric=lambda out: out.sum(dim=1), positions=[0], progress=False),
    "attention: no attention in the module": lambda m, x: hookscope.attention(m, x, layers="feat"),
    "extract: reduce='first' of a feature map": lambda m, x: _extract(m, x, reduce="first"),
}


@pytest.mark.parametrize("case", list(AFTER_FORWARD))
def test_a_verb_that_raises_after_its_forward_still_restores(case: str) -> None:
    model, x = _build(Spec(4, True, True, True, True, 0.5, 3, (2,), (), (0,))), torch.randn(3, 3, 6, 6)
    before = Snapshot.of(model)
    with pytest.raises(hookscope.HookscopeError):
        AFTER_FORWARD[case](model, x)
    before.assert_same(model)


def test_untouched_never_writes_grad_and_leaves_weight_writes() -> None:
    """``untouched`` neither sets ``.grad`` aside nor puts it back (a thread training the model
    meanwhile owns it: issue 35's segfault); a verb's backward is ``torch.autograd.grad``, which
    writes none. A weight written in place stays written (documented: no copy of every weight)."""
    model, x = MlpStack(), torch.randn(3, 10)
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    users = model.fc1.weight.grad
    bias = model.fc2.bias.detach().clone()
    with untouched(model):
        assert model.fc1.weight.grad is users  # left where it is
        torch.autograd.grad(model(x).sum(), list(model.parameters()))
        model.fc1.weight.grad = None  # a training thread's zero_grad(set_to_none=True)
        with torch.no_grad():
            model.fc2.bias.add_(1.0)
    assert model.fc1.weight.grad is None  # not put back over the other thread's change
    torch.testing.assert_close(model.fc2.bias, bias + 1.0, rtol=0, atol=0)


def test_user_blocks_keep_their_effects() -> None:
    """``capture`` and ``edit`` blocks run the user's own forwards: nothing is rolled back."""
    model = _build(Spec(4, True, False, False, True, 0.0, 3, (), (), ()))
    before = Snapshot.of(model)
    with hookscope.capture(model, "feat"):
        model(torch.randn(3, 3, 6, 6))
    assert int(model.stem[1].num_batches_tracked) == int(before.state["stem.1.num_batches_tracked"]) + 1
    with hookscope.edit(model, {"feat": lambda out: out * 2}):
        model(torch.randn(3, 3, 6, 6))
    assert int(model.stem[1].num_batches_tracked) == int(before.state["stem.1.num_batches_tracked"]) + 2


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_gradcam_under_a_grad_mode_still_restores(mode: Callable[[], Any]) -> None:
    """Its own pass runs with gradients (and outside inference mode); the snapshot is taken in the
    caller's mode and restored into the ordinary buffers."""
    model, x = _build(Spec(4, True, True, True, True, 0.5, 3, (), (0,), (1,))), torch.randn(3, 3, 6, 6)
    before = Snapshot.of(model)
    with mode():
        cam = hookscope.gradcam(model, x.clone(), "feat")
    assert cam.shape == (3, 6, 6)
    before.assert_same(model)
    assert not any(t.is_inference() for t in model.state_dict().values())
