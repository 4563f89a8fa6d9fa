"""Edits: exact values against plain PyTorch hooks and by-hand arithmetic."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from hookscope import EditError
from tests.models import DataclassOutput, DictOutput, LeNet, MlpStack, SharedLinear, TupleOutput
from tests.reference import assert_same


def _with_plain_hook(model: nn.Module, path: str, hook: Any, *args: Any) -> Any:
    handle = model.get_submodule(path).register_forward_hook(hook)
    try:
        return model(*args)
    finally:
        handle.remove()


def test_seed_edit_times_two_equals_plain_hook() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    expected = _with_plain_hook(model, "fc1", lambda m, i, o: o * 2, x)
    with hookscope.edit(model, {"fc1": lambda output: output * 2}):
        got = model(x)
    assert torch.equal(got, expected)
    assert not torch.equal(got, model(x))  # and the hook is gone afterwards


def test_edit_gets_path_and_call_of_each_call() -> None:
    model, x = SharedLinear(), torch.randn(2, 6)
    seen: list[tuple[str, int]] = []

    def fn(output: torch.Tensor, path: str, call: int) -> torch.Tensor | None:
        seen.append((path, call))
        return output + 1 if call == 1 else None  # only the second call changes

    with hookscope.edit(model, {"lin": fn}) as edits:
        got = model(x)
    assert seen == [("lin", 0), ("lin", 1)] and edits.counts == {"lin": 2}
    assert torch.equal(got, model.lin(torch.tanh(model.lin(x))) + 1)


def test_returning_none_keeps_the_output() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.edit(model, {"fc1": lambda output: None}):
        got = model(x)
    assert torch.equal(got, model(x))


def test_edit_of_a_tuple_part_changes_only_that_part() -> None:
    model, x = TupleOutput(), torch.randn(2, 5, 4)
    out, (h, c) = model.lstm(x)
    with hookscope.edit(model, {"lstm[1][0]": lambda h: h * 0}):
        got = model(x)
    assert torch.equal(got, model.fc(out[:, -1] + (h * 0)[0]))


def test_edit_of_the_whole_tuple_output() -> None:
    model, x = TupleOutput(), torch.randn(2, 5, 4)
    out, (h, c) = model.lstm(x)
    with hookscope.edit(model, {"lstm": lambda o: (o[0] * 3, o[1])}):
        got = model(x)
    assert torch.equal(got, model.fc(out[:, -1] * 3 + h[0]))


def test_edit_of_dict_and_dataclass_outputs() -> None:
    model, x = DictOutput(), torch.randn(3, 4)
    with hookscope.edit(model, {"block[scale]": torch.ones_like}):
        got = model(x)
    assert torch.equal(got, model.block.a(x))
    model2 = DataclassOutput()
    with hookscope.edit(model2, {"block[first]": lambda t: t - 1}):
        got2 = model2(x)
    assert torch.equal(got2, (model2.block.lin(x) - 1).sum(-1))


def test_input_edit_with_pre_hook_args_and_kwargs() -> None:
    model, x = MlpStack(), torch.randn(3, 20)
    with hookscope.edit(model, {"fc2": lambda args, kwargs: ((args[0] * 0,), kwargs)}, inputs=True):
        got = model(torch.randn(3, 10))
    assert torch.equal(got, model.fc2(x * 0))
    with pytest.raises(EditError, match=r"must return \(args, kwargs\)"):
        with hookscope.edit(model, {"fc2": lambda args, kwargs: args[0]}, inputs=True):
            model(torch.randn(3, 10))


def test_zero_ablation_equals_plain_hook() -> None:
    model, x = LeNet(), torch.randn(2, 3, 32, 32)
    expected = _with_plain_hook(model, "conv2", lambda m, i, o: torch.zeros_like(o), x)
    with hookscope.ablate(model, "conv2"):
        got = model(x)
    assert torch.equal(got, expected)


def test_mean_ablation_uses_reference_mean_over_batch() -> None:
    model = MlpStack()
    reference_x, x = torch.randn(16, 10), torch.randn(3, 10)
    with hookscope.capture(model, "fc1") as reference:
        model(reference_x)
    mean = model.fc1(reference_x).mean(dim=0)  # (20,)
    with hookscope.ablate(model, "fc1", how="mean", reference=reference):
        got = model(x)
    assert torch.allclose(got, model.fc2(model.relu(mean.expand(3, 20))), atol=1e-6)
    assert torch.allclose(got[0], got[1]) and torch.allclose(got[1], got[2])


def test_mean_ablation_from_a_saved_file(tmp_path: Any) -> None:
    model, reference_x, x = MlpStack(), torch.randn(8, 10), torch.randn(2, 10)
    with hookscope.capture(model, "fc1") as reference:
        model(reference_x)
    reference.save(str(tmp_path / "ref.safetensors"))
    with hookscope.ablate(model, ["fc1"], how="mean", reference=reference):
        from_capture = model(x)
    with hookscope.ablate(model, ["fc1"], how="mean", reference=tmp_path / "ref.safetensors"):
        from_file = model(x)
    assert torch.equal(from_capture, from_file)


def test_resample_ablation_draws_reference_rows() -> None:
    model, reference_x = MlpStack(), torch.randn(5, 10)
    with hookscope.capture(model, "fc1") as reference:
        model(reference_x)
    rows = reference["fc1"]
    with hookscope.ablate(model, "fc1", how="resample", reference=reference), \
            hookscope.capture(model, "fc1") as acts:
        model(torch.randn(4, 10))
    for row in acts["fc1"]:
        assert any(torch.equal(row, r) for r in rows)


def test_ablation_needs_a_reference_and_a_known_how() -> None:
    model = MlpStack()
    with pytest.raises(EditError, match="needs reference=acts"):
        hookscope.ablate(model, "fc1", how="mean")
    with pytest.raises(EditError, match="not one of 'zero', 'mean', 'resample'"):
        hookscope.ablate(model, "fc1", how="median")  # type: ignore[arg-type]


def test_steering_with_zero_changes_nothing() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.steer(model, {"fc1": torch.zeros(20)}, scale=5.0):
        got = model(x)
    assert torch.equal(got, model(x))


def test_steering_moves_the_output_by_w_v() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    x, v = torch.randn(5, 4), torch.randn(6)
    with hookscope.steer(model, {"0": v}, scale=2.0):
        got = model(x)
    moved = got - model(x)  # (5, 3): every row moves by W (2 v)
    assert torch.allclose(moved, (model[1].weight @ (2 * v)).expand(5, 3), atol=1e-5)


def test_steering_at_positions_only() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    x, v = torch.randn(2, 7, 4), torch.randn(6)
    with hookscope.steer(model, {"0": v}, positions=[1, 4]):
        got = model(x)
    moved = got - model(x)  # (2, 7, 3)
    wv = model[1].weight @ v
    for position in range(7):
        expected = wv if position in (1, 4) else torch.zeros(3)
        assert torch.allclose(moved[:, position], expected.expand(2, 3), atol=1e-5)


def test_steering_rejects_vectors_that_do_not_fit() -> None:
    model = MlpStack()
    with pytest.raises(EditError, match=r"shape \(7,\).*shape \(3, 20\)"):
        with hookscope.steer(model, {"fc1": torch.zeros(7)}):
            model(torch.randn(3, 10))
    with pytest.raises(EditError, match=r"steer one tensor in it, e\.g\. 'lstm\[0\]'"):
        lstm = TupleOutput()
        with hookscope.steer(lstm, {"lstm": torch.zeros(6)}):
            lstm(torch.randn(2, 5, 4))


def test_steering_a_feature_map_suggests_a_vector_per_channel() -> None:
    model = LeNet()  # conv1: (2, 6, 28, 28); a (28,) vector would add along the width
    with pytest.raises(EditError, match=r"e\.g\. \(6, 1, 1\) for its channels"):
        with hookscope.steer(model, {"conv1": torch.zeros(5)}):
            model(torch.randn(2, 3, 32, 32))


def test_edited_value_is_what_a_capture_inside_records() -> None:
    model, x = MlpStack(), torch.randn(3, 10)
    with hookscope.edit(model, {"fc1": lambda o: o * 2}), hookscope.capture(model, "fc1", "fc2") as acts:
        got = model(x)
    assert_same(acts["fc1"], model.fc1(x) * 2)
    assert torch.equal(acts["fc2"], got)


def _plain_hook_grad(model: nn.Module, x: torch.Tensor, value: torch.Tensor,
                     edit: Any) -> torch.Tensor:
    """The gradient of ``value`` when a plain forward hook on ``model[0]`` applies ``edit``."""
    leaf = value.detach().clone().requires_grad_()
    handle = model[0].register_forward_hook(lambda module, args, output: edit(output, leaf))
    try:
        model(x).sum().backward()
    finally:
        handle.remove()
    assert leaf.grad is not None
    return leaf.grad


@pytest.mark.parametrize("verb", ["steer", "steer-positions", "patch", "ablate-mean",
                                  "ablate-resample"])
def test_edit_values_that_require_grad_get_a_plain_hooks_gradient(verb: str) -> None:
    # finding 01: steer detached its vector, so a trained steering vector got grad None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    value = torch.randn(3, 8) if verb.startswith(("patch", "ablate")) else torch.randn(8)
    value.requires_grad_()
    make, edit = {
        "steer": (lambda v: hookscope.steer(model, {"0": v}, scale=2.0), lambda o, v: o + 2 * v),
        "steer-positions": (lambda v: hookscope.steer(model, {"0": v}, positions=[0], seq_dim=1),
                            lambda o, v: torch.cat([o[:, :1] + v[:1], o[:, 1:]], dim=1)),
        "patch": (lambda v: hookscope.patch(model, source={"0": v}, layers="0"), lambda o, v: v),
        "ablate-mean": (lambda v: hookscope.ablate(model, "0", how="mean", reference={"0": v}),
                        lambda o, v: v.mean(0).expand_as(o)),
        "ablate-resample": (lambda v: hookscope.ablate(model, "0", how="resample",
                                                       reference={"0": v}), None),
    }[verb]
    torch.manual_seed(1)
    with make(value):
        model(x).sum().backward()
    assert value.grad is not None
    if edit is None:  # resample: rows drawn with the seed; the same draw by hand
        torch.manual_seed(1)
        rows = torch.randint(3, (3,))
        edit = lambda o, v: v[rows]  # noqa: E731
    assert torch.equal(value.grad, _plain_hook_grad(model, x, value, edit))


def test_a_steering_vector_trains_across_steps_in_one_block() -> None:
    # scale * vector is taken in each forward: a second backward needs a fresh graph
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    vector = torch.zeros(8, requires_grad=True)
    with hookscope.steer(model, {"0": vector}, scale=0.5):
        model(x).sum().backward()
        model(x).sum().backward()
    expected = _plain_hook_grad(model, x, vector, lambda o, v: o + 0.5 * v)
    assert vector.grad is not None and torch.allclose(vector.grad, 2 * expected)
