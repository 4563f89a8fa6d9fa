"""Every verb acts only for the thread that entered it: another thread calling the same model
while a block is open computes exactly what plain PyTorch computes, never sees an exception (no
early stop), never runs inside hookscope's TorchFunctionMode, and is never recorded or edited.

The other thread's calls are made *inside* the block's own forwards, at the worst moments: at
the start of the root's forward (after the block's root pre-hooks ran: the attention mask of
``positions=`` is known, an early stop's pass has begun) and inside ``block``'s forward (its
``::relu`` watch has entered the mode and pushed a frame). Each meeting runs one whole forward in
the other thread and waits for it, so the counts are exact. Each verb's own result, with and
without the other thread, is the value plain PyTorch computes (``PLAIN``: bare hooks and the
forward written out by hand, edited by hand).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope
from tests.models import tiny_gpt2
from tests.reference import clean_values, hand_patched, plain_capture

B, T, D, N = 2, 5, 8, 3  # batch, sequence, width, forwards of the block's own thread


class Meeting:
    """Runs ``forward()`` (one forward of the model) in a second thread each time the block's
    thread meets it, and checks it returns ``expected``."""

    def __init__(self, forward: Callable[[], torch.Tensor], expected: torch.Tensor):
        self.forward, self.expected = forward, expected
        self.owner = threading.get_ident()
        self.requests: queue.Queue[bool] = queue.Queue()
        self.done = threading.Semaphore(0)
        self.calls = 0
        self.problems: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def __call__(self) -> None:
        if threading.get_ident() == self.owner:  # the other thread's own forward does not meet
            self.requests.put(True)
            assert self.done.acquire(timeout=30), "the other thread never answered"

    def close(self) -> None:
        self.requests.put(False)
        self.thread.join(timeout=30)

    def _serve(self) -> None:
        while self.requests.get():
            try:
                depth = torch._C._len_torch_function_stack()
                with torch.no_grad():
                    out = self.forward()
                if depth or torch._C._len_torch_function_stack():
                    self.problems.append(f"a torch function mode was entered: depth {depth}")
                if not torch.equal(out, self.expected):
                    self.problems.append("the output differs from plain PyTorch's")
            except BaseException as exc:  # noqa: BLE001 - any exception here is the finding
                self.problems.append(f"{type(exc).__name__}: {exc}")
            self.calls += 1
            self.done.release()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.meet: Callable[[], None] = lambda: None
        self.depths: list[int] = []  # function-mode depth at the relu, in the block's thread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.meet()
        if threading.get_ident() == threading.main_thread().ident:
            self.depths.append(torch._C._len_torch_function_stack())
        return F.relu(h).exp()


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        heads = [f(x).view(rows, T, 2, D // 2).transpose(1, 2) for f in (self.q, self.k, self.v)]
        return F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(rows, T, D)


class Net(nn.Module):
    """``(batch, seq, D)`` and an ``attention_mask`` ``(batch, seq)`` -> logits ``(batch, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(D, D)
        self.block = Block()
        self.attn = SelfAttention()
        self.head = nn.Linear(D, 3)
        self.meet: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.meet()
        h = self.block(self.emb(x))
        return self.head(self.attn(h)).mean(1)


class ConvNet(nn.Module):
    """``(batch, 1, 6, 6)`` -> logits ``(batch, 3)``; the extra argument is ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(4, 3)
        self.meet: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.meet()
        return self.head(F.relu(self.conv(x)).mean((2, 3)))


def records(acts: Any, *keys: str) -> dict[str, list[torch.Tensor]]:
    return {key: acts.calls(key) for key in keys}


def run_capture(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    model.block.depths.clear()
    with hookscope.capture(model, "emb", "block", "block::relu") as acts:
        for _ in range(N):
            model(x)
    found = records(acts, "emb", "block", "block::relu")
    assert [len(calls) for calls in found.values()] == [N, N, N]  # its own calls only
    assert model.block.depths == [1] * N  # the mode was entered in the block's own thread
    return found


def run_early_stop(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    with hookscope.capture(model, "emb", early_stop=True) as acts:
        model(x)
        raise AssertionError("the early stop ends the block")
    assert len(acts.calls("emb")) == 1
    return records(acts, "emb")


def run_edit(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    with hookscope.edit(model, {"block::relu": lambda t: t * 0.5}) as edits:
        outs = [model(x) for _ in range(N)]
    assert edits.counts == {"block::relu": N}
    return outs


def run_ablate(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    with hookscope.ablate(model, "block") as edits:
        outs = [model(x) for _ in range(N)]
    assert edits.counts == {"block": N}
    return outs


def run_steer(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # the other thread passes all ones
    with hookscope.steer(model, {"emb": torch.ones(D)}, positions=-1) as edits:
        outs = [model(x, attention_mask=mask) for _ in range(N)]
    assert edits.counts == {"emb": N}
    return outs


def run_stats(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    found = hookscope.stats(model, [x] * N, ["emb", "block"])
    assert [int(s.count) for s in found.values()] == [N * B * T * D] * 2
    return {key: [float(v) for v in (s.count, s.mean, s.m2, s.min, s.max)]
            for key, s in found.items()}


def run_compare(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    result = hookscope.compare(model, copy.deepcopy(model), x, layers=["emb", "block"])
    assert not result.unmatched
    return [(d.path, d.call_index, d.shape, d.max_abs, d.close) for d in result.diffs]


def run_nonfinite(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    origin = hookscope.find_nonfinite(model, x * 1e3)  # finite, but block's exp overflows
    assert origin is not None
    return (origin.path, origin.call_index, origin.op, origin.bad_count, origin.outputs[0].posinf)


def run_nonfinite_backward(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    origin = hookscope.find_nonfinite(model, x, backward=True, loss_fn=lambda out: (out - out).sqrt().sum())
    assert origin is not None
    return (origin.path, origin.phase, origin.op, origin.bad_count)


def run_tree(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    return {row.path: row.calls for row in hookscope.tree(model, x, ops=True)}


def run_attention(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    found = hookscope.attention(model, x, layers="attn")
    assert list(found) == ["attn"] and found["attn"].shape == (B, 2, T, T)
    return found


def run_gradcam(model: nn.Module, x: torch.Tensor, tmp: Path) -> Any:
    return hookscope.gradcam(model, x, "conv", target=1)


def run_sweep(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    sweep = hookscope.patching_sweep(model, x, x.flip(1), layers="emb",
                                     metric=lambda out: out[:, 0].mean(), progress=False)
    return sweep.values.float()


def run_extract(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    store = hookscope.extract(model, [x] * N, "block", tmp / f"store{len(list(tmp.iterdir()))}",
                              progress=False)
    assert len(store["block"]) == N * B
    return store["block"][:]


VERBS: dict[str, Callable[..., Any]] = {
    "capture": run_capture, "capture-early-stop": run_early_stop, "edit-relu": run_edit,
    "ablate": run_ablate, "steer-positions": run_steer, "stats": run_stats, "compare": run_compare,
    "find_nonfinite": run_nonfinite, "find_nonfinite-backward": run_nonfinite_backward,
    "tree": run_tree, "attention": run_attention, "gradcam": run_gradcam,
    "patching_sweep": run_sweep, "extract": run_extract,
}


# ------------------------------------------------------------- plain PyTorch, the same values
def by_hand(model: Net, x: torch.Tensor, *, emb: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
            relu: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
            block: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """``Net``'s forward written out, with an edit of ``emb``'s output, of ``block``'s relu
    or of ``block``'s output."""
    h = emb(model.emb(x))
    out = block(relu(F.relu(model.block.fc(h))).exp())
    return model.head(model.attn(out)).mean(1)


def plain_capture_relu(model: Net, x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    found = plain_capture(model, ["emb", "block"], x, grad_enabled=True)
    found["block::relu"] = [F.relu(model.block.fc(found["emb"][0]))]
    return {key: values * N for key, values in found.items()}


def plain_steer(model: Net, x: torch.Tensor) -> list[torch.Tensor]:
    def last_real_token(h: torch.Tensor) -> torch.Tensor:  # the mask's last 1: 4 and 2
        h = h.clone()
        h[0, 4] += 1
        h[1, 2] += 1
        return h
    return [by_hand(model, x, emb=last_real_token)] * N


def plain_stats(model: Net, x: torch.Tensor) -> dict[str, list[float]]:
    found = plain_capture(model, ["emb", "block"], x, grad_enabled=False)
    out = {}
    for key, (value,) in found.items():
        v = torch.cat([value.flatten().double()] * N)
        out[key] = [float(v.numel()), float(v.mean()), float(((v - v.mean()) ** 2).sum()),
                    float(v.min()), float(v.max())]
    return out


def plain_compare(model: Net, x: torch.Tensor) -> list[tuple[Any, ...]]:
    twin = copy.deepcopy(model)
    a, b = (plain_capture(m, ["emb", "block", ""], x, grad_enabled=False) for m in (model, twin))
    return [(p, 0, tuple(a[p][0].shape), float((a[p][0] - b[p][0]).abs().max()), True)
            for p in a]


def plain_nonfinite(model: Net, x: torch.Tensor) -> tuple[Any, ...]:
    with torch.no_grad():
        relu = F.relu(model.block.fc(model.emb(x * 1e3)))
        assert bool(relu.isfinite().all())  # finite up to block's exp
        bad = int(relu.exp().isinf().sum())
    return ("block", 0, "exp", bad, bad)


def plain_nonfinite_backward(model: Net, x: torch.Tensor) -> tuple[Any, ...]:
    out = model(x)
    loss = (out - out).sqrt()
    (grad,) = torch.autograd.grad(loss.sum(), out)
    return ("<loss>", "backward", loss.grad_fn.name(), int((~grad.isfinite()).sum()))


def plain_tree(model: Net, x: torch.Tensor) -> dict[str, int]:
    calls = dict.fromkeys((p for p, _ in model.named_modules()), 0)
    handles = [m.register_forward_pre_hook(lambda m, a, p=p: calls.__setitem__(p, calls[p] + 1))
               for p, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return calls


def plain_attention(model: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    h = model.block(model.emb(x))
    q, k = (f(h).view(B, T, 2, D // 2).transpose(1, 2) for f in (model.attn.q, model.attn.k))
    return {"attn": torch.softmax(q @ k.transpose(-1, -2) / (D // 2) ** 0.5, dim=-1)}


def plain_gradcam(model: ConvNet, x: torch.Tensor) -> torch.Tensor:
    features = model.conv(x)
    logits = model.head(F.relu(features).mean((2, 3)))
    (grads,) = torch.autograd.grad(logits[:, 1].sum(), features)
    cam = F.relu((grads.mean(dim=(2, 3), keepdim=True) * features).sum(dim=1, keepdim=True))
    cam = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    low, high = cam.amin(dim=(1, 2), keepdim=True), cam.amax(dim=(1, 2), keepdim=True)
    return (cam - low) / (high - low)


def plain_sweep(model: Net, x: torch.Tensor) -> torch.Tensor:
    (clean,) = clean_values(model, [model.emb], {"x": x})
    metric = lambda out: out[:, 0].mean()  # noqa: E731
    return torch.tensor([[hand_patched(model, model.emb, clean, p, {"x": x.flip(1)}, metric)
                          for p in range(T)]])


PLAIN: dict[str, Callable[[Any, torch.Tensor], Any]] = {
    "capture": plain_capture_relu,
    "capture-early-stop": lambda m, x: {"emb": plain_capture(m, ["emb"], x, grad_enabled=True)["emb"]},
    "edit-relu": lambda m, x: [by_hand(m, x, relu=lambda t: t * 0.5)] * N,
    "ablate": lambda m, x: [by_hand(m, x, block=torch.zeros_like)] * N,
    "steer-positions": plain_steer, "stats": plain_stats, "compare": plain_compare,
    "find_nonfinite": plain_nonfinite, "find_nonfinite-backward": plain_nonfinite_backward,
    "tree": plain_tree, "attention": plain_attention, "gradcam": plain_gradcam,
    "patching_sweep": plain_sweep,
    "extract": lambda m, x: torch.cat(plain_capture(m, ["block"], x, grad_enabled=False)["block"] * N),
}


def close(a: Any, b: Any) -> None:
    """``a`` equals the plain value ``b``: tensors and floats within float32 tolerances (another
    kernel may compute them), other leaves exactly."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-5)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            close(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            close(x, y)
    else:
        assert a == b


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("verb", list(VERBS))
def test_another_thread_is_never_seen_nor_changed(verb: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model: nn.Module = ConvNet() if verb == "gradcam" else Net()
    x = torch.randn(B, 1, 6, 6) if verb == "gradcam" else torch.randn(B, T, D)
    other = x.flip(0) + 1
    with torch.no_grad():
        expected = model(other, attention_mask=torch.ones(B, T))
    alone = VERBS[verb](model, x, tmp_path)  # the verb's result without a second thread
    close(alone, PLAIN[verb](model, x))

    meeting = Meeting(lambda: model(other, attention_mask=torch.ones(B, T)), expected)
    meets = [0]

    def meet() -> None:
        meets[0] += threading.get_ident() == meeting.owner
        meeting()
    model.meet = meet
    if isinstance(model, Net):
        model.block.meet = meet
    try:
        together = VERBS[verb](model, x, tmp_path)
    finally:
        meeting.close()
    assert meeting.problems == []
    assert meeting.calls == meets[0] > 0  # every meeting ran one forward in the other thread
    assert same(together, alone)


def test_generation_in_another_thread_is_never_labelled() -> None:
    pytest.importorskip("transformers")
    model = tiny_gpt2()
    ids, other = torch.tensor([[3, 4, 5]]), torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        expected = model(other).logits

    def generate() -> tuple[torch.Tensor, torch.Tensor]:
        with hookscope.capture_generation(model, "transformer.h.1") as gen:
            sequence = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert [s.start for s in gen.steps] == [0, 3, 4]  # the block's own three steps only
        return sequence, gen.aligned("transformer.h.1")

    alone = generate()
    meeting = Meeting(lambda: model(other).logits, expected)
    handle = model.transformer.h[0].register_forward_pre_hook(lambda module, args: meeting())
    try:
        together = generate()
    finally:
        handle.remove()
        meeting.close()
    assert meeting.problems == [] and meeting.calls == 3  # one forward inside each step
    assert same(together, alone)


def test_blocks_opened_at_once_on_one_module_get_distinct_compiled_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: ``engine.compile.graph.open_sink`` picks a module's first free key; two threads
    picking at once must not get the same key (one block's compiled captures would go to the
    other's sink). 4 threads x 200 openings, each free-key lookup yielding to the others (the
    race made certain, not left to timing)."""
    import time

    from hookscope.engine.compile import graph as compiled

    class Yielding(dict):  # type: ignore[type-arg]
        def __contains__(self, key: object) -> bool:
            found = super().__contains__(key)
            time.sleep(0)  # another thread runs here, between the lookup and the claim
            return found

    monkeypatch.setattr(compiled, "_sinks", Yielding())
    module, threads, rounds = nn.Linear(2, 2), 4, 200
    clashes: list[int] = []
    done: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def open_and_close() -> None:
        start.wait()
        try:
            for _ in range(rounds):
                sink = [].append
                key = compiled.open_sink(module, sink)
                time.sleep(0)
                if compiled._sinks.get(key) is not sink:  # another thread took the same key
                    clashes.append(key)
                compiled.close_sink(key)
        except BaseException as err:  # a thread's error is only a warning to pytest: keep it
            errors.append(err)
            raise
        done.append(rounds)

    workers = [threading.Thread(target=open_and_close) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert errors == [] and not any(worker.is_alive() for worker in workers)
    assert sum(done) == threads * rounds and clashes == []
    assert max(map(len, compiled._places[module].values())) <= threads  # keys are reused, never leaked


class Dropping(nn.Module):
    """``(batch, 16)`` -> the same, through dropout (train mode draws from the global RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


@pytest.mark.parametrize("verb", ["stats", "tree", "compare", "replay"])
def test_a_verb_never_rewinds_the_rng_of_a_thread_training_meanwhile(verb: str) -> None:
    """Issue 35: a verb puts the global RNG back when it ends (its own dropout draws leave no
    trace), but a trainer thread that drew from it meanwhile would then draw the same numbers
    again: the same dropout masks twice. The trainer runs one training forward inside the
    verb's forward (a pre-hook meeting, so the interleaving is exact) and one after it: its
    masks must differ, and the verb's result is what it is without the trainer."""
    torch.manual_seed(0)
    model, other, x = Dropping().train(), Dropping().train(), torch.ones(64, 16)
    masks: list[torch.Tensor] = []

    def train_step() -> None:
        with torch.no_grad():
            masks.append(model(x) == 0)

    def meet(module: nn.Module, args: Any) -> None:
        if threading.current_thread() is threading.main_thread() and not masks:
            worker = threading.Thread(target=train_step)
            worker.start()
            worker.join(30)

    def run_verb() -> Any:
        if verb == "stats":
            return hookscope.stats(model, [x], ["fc"])
        if verb == "tree":
            return [row.calls for row in hookscope.tree(model, x)]
        if verb == "compare":
            return hookscope.compare(model, other, x, layers=["fc"])
        from hookscope.engine.run import state_snapshot
        from hookscope.train.guard import StepInputs
        bundle = hookscope.ReplayBundle(0, 0, StepInputs.now((x,), {}, "cpu"), [torch.ones(64, 16)],
                                        state_snapshot(model))
        return hookscope.replay(bundle, model)

    handle = model.fc.register_forward_pre_hook(meet)
    try:
        run_verb()
    finally:
        handle.remove()
    train_step()  # the trainer's next step, after the verb
    assert len(masks) == 2
    assert not torch.equal(masks[0], masks[1]), "the verb rewound the trainer's RNG"


def test_a_compiled_backwards_gradient_reaches_only_its_sessions_thread() -> None:
    """A review found the compiled gradient sink (``hookscope::gradient``) calling the monitor's
    ``on_gradient`` for any thread's backward, where the eager tensor hook, registered by an
    owned forward only, never sees another thread's: now ``OwnedHook.gradient_kept`` checks
    the thread, as ``kept`` does for forward values, and counts the other thread's call."""
    from hookscope.engine import OwnedHook, output_of

    got: list[torch.Tensor] = []
    module = nn.Linear(2, 2)
    hook = OwnedHook(lambda *args: None, module, pick=output_of, on_gradient=got.append)
    other = threading.Thread(target=hook.gradient_kept, args=(torch.ones(2),))
    other.start()
    other.join()
    assert got == [] and hook.foreign_calls == 1
    hook.gradient_kept(torch.full((2,), 3.0))
    assert len(got) == 1 and torch.equal(got[0], torch.full((2,), 3.0)) and hook.foreign_calls == 1
