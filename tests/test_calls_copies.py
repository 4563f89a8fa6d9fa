"""One real call is one record: activation checkpointing, threads, copies and pickling, inputs
written in place (issue 10 "Calls" and "Values")."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookscope
from tests.models import ReluMlp


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Checkpointed(nn.Module):
    """Two blocks, the first run under torch.utils.checkpoint (re-run during backward)."""

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 1)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reentrant is None:
            return self.head(self.block(x))
        return self.head(checkpoint(self.block, x, use_reentrant=self.use_reentrant))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_is_not_a_new_call(use_reentrant: bool) -> None:
    model = Checkpointed(use_reentrant)
    x = torch.randn(3, 4, requires_grad=True)
    with hookscope.capture(model, "block", "block.fc", "block.act", grads=True) as acts:
        model(x).sum().backward()
    assert acts.counts == {"block": 1, "block.fc": 1, "block.act": 1}
    plain = Checkpointed(None)
    plain.load_state_dict(model.state_dict())
    hidden = plain.block.fc(x)
    out = plain.block.act(hidden)
    grad_hidden, = torch.autograd.grad(plain.head(out).sum(), hidden)
    torch.testing.assert_close(acts["block.fc"], hidden.detach())
    torch.testing.assert_close(acts.grad("block.fc"), grad_hidden)
    # reentrant checkpointing re-runs the whole block; non-reentrant stops once the tensors
    # backward needs are recomputed (block.fc's output, saved by tanh)
    assert acts.recomputes == ({"block": 1, "block.fc": 1, "block.act": 1} if use_reentrant
                               else {"block": 0, "block.fc": 1, "block.act": 0})


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_an_edit_also_applies_to_the_recompute_so_gradients_are_those_of_the_edited_model(
        use_reentrant: bool) -> None:
    model = Checkpointed(use_reentrant)
    plain = Checkpointed(None)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, requires_grad=True)  # reentrant checkpoint needs an input that does
    for m in (model, plain):
        with hookscope.edit(m, {"block.fc": lambda output: output * 3}):
            m(x).sum().backward()
    assert model.block.fc.weight.grad is not None and plain.block.fc.weight.grad is not None
    torch.testing.assert_close(model.block.fc.weight.grad, plain.block.fc.weight.grad)


def test_hf_gradient_checkpointing_counts_one_call_per_layer() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32)
    model = transformers.BertModel(config)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 50, (2, 5))
    with hookscope.capture(model, "encoder.layer.*.intermediate") as acts:
        model(input_ids=ids).last_hidden_state.sum().backward()
    assert acts.counts == {"encoder.layer.0.intermediate": 1, "encoder.layer.1.intermediate": 1}
    assert acts.recomputes == {"encoder.layer.0.intermediate": 1, "encoder.layer.1.intermediate": 1}


def test_two_threads_capturing_one_model_each_get_exactly_their_own_calls() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    inputs = {name: [torch.full((1, 4), float(i + 10 * k)) for i in range(20)]
              for k, name in enumerate(("a", "b"))}
    barrier = threading.Barrier(2)
    results: dict[str, hookscope.Capture] = {}
    errors: list[BaseException] = []

    def serve(name: str) -> None:
        try:
            with hookscope.capture(model, "0") as acts:
                for x in inputs[name]:
                    barrier.wait(timeout=10)  # both threads inside their blocks, calls interleaved
                    model(x)
            results[name] = acts
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=serve, args=(name,)) for name in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name, xs in inputs.items():
        got = results[name].calls("0")
        assert len(got) == 20
        for value, x in zip(got, xs):
            assert torch.equal(value, model[0](x).detach())


@pytest.mark.parametrize("address", ["0", "0::relu", "*::relu"])
def test_a_module_run_only_by_another_thread_is_reported_with_that_cause(address: str) -> None:
    model = nn.Sequential(ReluMlp(4))
    with pytest.warns(hookscope.HookNeverFiredWarning,
                      match=r"0 ran 2 times, all in other threads: a hookscope block records only "
                            r"the calls made by the thread that entered it"):
        with hookscope.capture(model, address) as acts:
            worker = threading.Thread(target=lambda: [model(torch.randn(1, 4)) for _ in range(2)])
            worker.start()
            worker.join()
    key = address.replace("*", "0")
    assert acts.counts == {key: 0}
    assert list(acts.unfired) == [key]
    assert acts.unfired[key].startswith("0 ran 2 times, all in other threads")


def test_a_function_its_module_made_in_this_thread_too_is_recorded_only_for_this_thread() -> None:
    model = nn.Sequential(ReluMlp(4))
    x = torch.randn(1, 4)
    with hookscope.capture(model, "0::relu") as acts:
        worker = threading.Thread(target=lambda: model(torch.randn(1, 4)))
        worker.start()
        worker.join()
        model(x)
    assert acts.unfired == {}
    assert len(acts.calls("0::relu")) == 1
    torch.testing.assert_close(acts.calls("0::relu")[0], torch.relu(model[0].up(x)).detach())


def test_deepcopy_inside_a_block_does_not_carry_hooks_into_the_copy() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    with hookscope.capture(model, "0") as acts:
        ema = copy.deepcopy(model)  # EMA / teacher copy taken while capturing
        with torch.no_grad():
            ema[0].weight.mul_(0.5)
        copied_out = ema(x)
        model(x)
    assert acts.counts == {"0": 1}
    assert torch.equal(acts["0"], model[0](x).detach())  # the original's call, not the copy's
    assert torch.equal(copied_out, ema[1](ema[0](x)))
    assert not ema[0]._forward_hooks and not ema[0]._forward_pre_hooks  # never copied
    assert not model[0]._forward_hooks


def test_pickling_a_model_inside_a_block_works_and_the_loaded_copy_runs_clean() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    buffer = io.BytesIO()
    with hookscope.capture(model, "0", inputs=True) as acts:
        torch.save(model, buffer)
        model(x)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), model(x))
    assert not loaded[0]._forward_hooks and acts.counts == {"0": 1}


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.ReLU(inplace=True)
        self.after = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        return self.after(self.scale(x))


def test_inputs_are_the_values_at_the_moment_of_the_call() -> None:
    model = WritesItsInput()
    x = torch.randn(3, 4)
    with hookscope.capture(model, "scale", "after", inputs=True) as acts:
        model(x)
    assert torch.equal(acts.inputs("scale")[0], x)  # before ReLU(inplace=True) wrote it
    assert bool((acts.inputs("scale")[0] < 0).any())
    assert torch.equal(acts.inputs("after")[0], torch.relu(x))
