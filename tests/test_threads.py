"""Every verb acts only for the thread that entered it: another thread calling the same model
while a block is open computes exactly what plain PyTorch computes, never sees an exception (no
early stop), never runs inside hookscope's TorchFunctionMode, and is never recorded or edited.

The other thread's calls are made *inside* the block's own forwards, at the worst moments: at
the start of the root's forward (after the block's root pre-hooks ran: the attention mask of
``positions=`` is known, an early stop's pass has begun) and inside ``block``'s forward (its
``::relu`` watch has entered the mode and pushed a frame). Each meeting runs one whole forward in
the other thread and waits for it, so the counts are exact.
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
    return {key: (s.count, s.mean, s.m2, s.min, s.max) for key, s in found.items()}


def run_compare(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    result = hookscope.compare(model, copy.deepcopy(model), x, layers=["emb", "block"])
    assert [d.call_index for d in result.diffs[:2]] == [0, 0] and not result.unmatched
    return repr(result.diffs)


def run_nonfinite(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    origin = hookscope.find_nonfinite(model, x * 1e3)  # finite, but block's exp overflows
    assert origin is not None and (origin.path, origin.call_index, origin.op) == ("block", 0, "exp")
    return repr(origin)


def run_nonfinite_backward(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    origin = hookscope.find_nonfinite(model, x, backward=True, loss_fn=lambda out: (out - out).sqrt().sum())
    assert origin is not None and origin.phase == "backward"
    return repr(origin)


def run_tree(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    rows = hookscope.tree(model, x, ops=True)
    assert {row.path: row.calls for row in rows}["block"] == 1
    return rows


def run_attention(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    found = hookscope.attention(model, x, layers="attn")
    assert list(found) == ["attn"] and found["attn"].shape == (B, 2, T, T)
    return found


def run_gradcam(model: nn.Module, x: torch.Tensor, tmp: Path) -> Any:
    return hookscope.gradcam(model, x, "conv", target=1)


def run_sweep(model: Net, x: torch.Tensor, tmp: Path) -> Any:
    sweep = hookscope.patching_sweep(model, x, x.flip(1), layers="emb",
                                     metric=lambda out: out[:, 0].mean(), progress=False)
    return sweep.values


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
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
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
