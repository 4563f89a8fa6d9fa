"""A pairing that cannot be made is an error naming the unpaired modules of both models, never a
comparison of 0 pairs; one that can be made accounts for every call. Generated variants: small
MLPs and CNNs against a copy with renamed, reordered or missing modules, or an unrelated model."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hookscope import compare
from hookscope.diagnostics.comparison import Comparison
from hookscope.diagnostics.pairing import kind
from hookscope.errors import HookscopeError, SelectorError

WIDTH = 6
EXTRAS = {"relu": nn.ReLU, "tanh": nn.Tanh, "norm": lambda: nn.LayerNorm(WIDTH)}


def mlp(extras: list[str]) -> nn.Sequential:
    """Linear layers of one width, each followed by the module ``extras`` names."""
    layers: list[nn.Module] = []
    for extra in extras:
        layers += [nn.Linear(WIDTH, WIDTH), EXTRAS[extra]()]
    return nn.Sequential(*layers)


def cnn(depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(1, 3, 3, padding=1)]
    for _ in range(depth):
        layers += [nn.ReLU(), nn.Conv2d(3, 3, 3, padding=1)]
    return nn.Sequential(*layers)


def renamed(model: nn.Sequential) -> nn.Sequential:
    return nn.Sequential(OrderedDict((f"step_{k}", copy.deepcopy(m)) for k, m in enumerate(model)))


def calls(model: nn.Sequential) -> list[str]:
    return [f"{name}:0" for name, _ in model.named_children()]


def accounted(result: Comparison, a: nn.Sequential, b: nn.Sequential) -> None:
    """Every call of each side is paired once or listed as unpaired."""
    assert result.pairing is not None and result.pairs
    found = [f"{p.path_a}:0" for p in result.pairs] + list(result.pairing.unpaired_a)
    assert sorted(found) == sorted(calls(a))
    found = [f"{p.path_b}:0" for p in result.pairs] + list(result.pairing.unpaired_b)
    assert sorted(found) == sorted(calls(b))


def names_the_unpaired(error: pytest.ExceptionInfo[HookscopeError], a: list[str], b: list[str]) -> None:
    message = str(error.value)
    assert "paired 0 of" in message or "pair='auto' paired" in message
    assert all(f"'{name}'" in message for name in a[:10]) and all(f"'{name}'" in message for name in b[:10])
    assert "0 layers compared" not in message


EXTRA_LISTS = st.lists(st.sampled_from(sorted(EXTRAS)), min_size=2, max_size=5)


@settings(max_examples=8, deadline=None)
@given(extras=EXTRA_LISTS, seed=st.integers(0, 2**16))
def test_renamed_modules_pair_by_auto_not_by_name(extras: list[str], seed: int) -> None:
    torch.manual_seed(seed)
    a = mlp(extras)
    b = renamed(a)
    x = torch.randn(2, WIDTH)
    result = compare(a, b, x, pair="auto")
    accounted(result, a, b)
    assert [(p.path_a, p.path_b) for p in result.pairs] == [(str(k), f"step_{k}") for k in range(len(a))]
    assert result.first_origin is None and result.pairing is not None and result.pairing.confidence == 1.0
    with pytest.raises(HookscopeError) as error:
        compare(a, b, x, pair={"{n}": "{n}"})
    names_the_unpaired(error, calls(a), calls(b))


@settings(max_examples=8, deadline=None)
@given(extras=EXTRA_LISTS, seed=st.integers(0, 2**16), data=st.data())
def test_a_missing_module_is_unpaired_and_the_rest_pairs(extras: list[str], seed: int,
                                                         data: st.DataObject) -> None:
    torch.manual_seed(seed)
    a = mlp(extras)
    gone = data.draw(st.integers(0, len(a) - 1))
    b = nn.Sequential(*[copy.deepcopy(m) for k, m in enumerate(a) if k != gone])
    result = compare(a, b, torch.randn(2, WIDTH), pair="auto")
    accounted(result, a, b)
    assert result.pairing is not None
    # every module of B has its partner: only one call of A is left, of the dropped module's kind
    assert result.pairing.unpaired_b == () and len(result.pairing.unpaired_a) == 1
    left = int(result.pairing.unpaired_a[0].removesuffix(":0"))
    assert kind(a[left]) == kind(a[gone])


@settings(max_examples=8, deadline=None)
@given(extras=st.lists(st.sampled_from(["relu", "tanh"]), min_size=2, max_size=5),
       seed=st.integers(0, 2**16), data=st.data())
def test_reordered_modules_leave_one_of_the_swapped_unpaired(extras: list[str], seed: int,
                                                             data: st.DataObject) -> None:
    torch.manual_seed(seed)
    a = mlp(extras)
    k = data.draw(st.integers(0, len(a) - 2))
    order = list(range(len(a)))
    order[k], order[k + 1] = order[k + 1], order[k]  # a Linear and its activation swap places
    b = nn.Sequential(OrderedDict((f"m{j}", copy.deepcopy(a[j])) for j in order))
    result = compare(a, b, torch.randn(2, WIDTH), pair="auto")
    accounted(result, a, b)
    assert result.pairing is not None
    assert len(result.pairing.unpaired_a) == len(result.pairing.unpaired_b) == 1
    assert {result.pairing.unpaired_a[0], result.pairing.unpaired_b[0]} & {
        f"{k}:0", f"{k + 1}:0", f"m{order[k]}:0", f"m{order[k + 1]}:0"}


@settings(max_examples=6, deadline=None)
@given(extras=EXTRA_LISTS, depth=st.integers(1, 3))
def test_unrelated_models_are_an_error_naming_both_sides(extras: list[str], depth: int) -> None:
    a, b = mlp(extras), cnn(depth)
    with pytest.raises(HookscopeError) as error:
        compare(a, b, torch.randn(1, 1, WIDTH, WIDTH), pair="auto")
    names_the_unpaired(error, calls(a), calls(b))
    with pytest.raises(HookscopeError) as error:
        compare(a, b, torch.randn(1, 1, WIDTH, WIDTH), pair={"{n}": "conv.{n}"})
    names_the_unpaired(error, calls(a), calls(b))


def reference_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return mlp(["relu", "tanh", "norm"])


def renamed_port() -> nn.Sequential:
    return renamed(reference_mlp())


@settings(max_examples=6, deadline=None)
@given(extras=EXTRA_LISTS, seed=st.integers(0, 2**16))
def test_renamed_port_without_pair_says_how_to_pair(extras: list[str], seed: int) -> None:
    torch.manual_seed(seed)
    a = mlp(extras)
    with pytest.raises(SelectorError) as error:
        compare(a, renamed(a), torch.randn(2, WIDTH))
    message = str(error.value)
    assert message.startswith(f"cannot compare name by name: only 0 of {len(a)} selected modules "
                              f"of model A and {len(a)} of model B have the same name in both")
    assert "pair='auto' (hookscope diff --pair auto)" in message
    assert "(hookscope diff --pair 'h.{i}.attn=layers.{i}.attn')" in message


def test_cli_diff_of_a_renamed_port_is_a_usage_error_naming_pair(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hookscope.cli.main import main

    argv = ["diff", "tests.test_compare_unpaired:reference_mlp",
            "tests.test_compare_unpaired:renamed_port", "--input", "randn:2,6"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "only 0 of 6 selected modules" in err and "--pair auto" in err
    assert main([*argv, "--pair", "auto"]) == 0  # the same weights: every pair is close
    err = capsys.readouterr().err
    assert "paired 6 calls (auto, confidence 1.00); unpaired in A: 0, in B: 0" in err
    assert err.splitlines()[-1] == "all 6 paired calls close (each within its tolerance)"
