"""Every kind of value x every verb (issue 31, items 1, 2): a tiny model whose module ``make``
returns one kind of value (a row of ``hookscope.engine.values.kinds.KINDS``), built from generated
batches (hypothesis: batch size, sequence lengths, values). Each cell gives what plain PyTorch
gives, or a ``HookscopeError`` naming the kind; a torch error from inside fails the cell.

DTensor and functorch-wrapped values need a process group or a transform around the model;
their verbs are held in test_tensor_kinds.py and test_values_kinds.py.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import hookscope
from hookscope.engine.values.kinds import KINDS
from hookscope.errors import HookscopeError

Tensor = torch.Tensor
D = 4  # features
SCALE, ZERO = 0.05, 128  # of the quantized kind


def _inference(x: Tensor) -> Tensor:
    with torch.inference_mode():
        return x.clone()


def _channels_last(x: Tensor) -> Tensor:
    return torch.stack([x, -x], -1).transpose(1, 2).contiguous(memory_format=torch.channels_last)


def _rows(x: Tensor, lengths: Tensor) -> list[Tensor]:
    return [x[i, :n] for i, n in enumerate(lengths.tolist())]


#: how a module makes each kind from a (batch, seq, 4) batch and its lengths: one per row
MAKERS: dict[str, Callable[[Tensor, Tensor], Any]] = {
    "strided": lambda x, n: x * 1,
    "channels_last": lambda x, n: _channels_last(x),
    "nested (strided)": lambda x, n: torch.nested.nested_tensor(_rows(x, n)),
    "nested (jagged)": lambda x, n: torch.nested.nested_tensor(_rows(x, n), layout=torch.jagged),
    "sparse COO": lambda x, n: x.sum(1).to_sparse(),
    "sparse CSR": lambda x, n: x.sum(1).to_sparse_csr(),
    "complex": lambda x, n: torch.complex(x, -2 * x),
    "quantized": lambda x, n: torch.quantize_per_tensor(x, SCALE, ZERO, torch.quint8),
    "inference": lambda x, n: _inference(x),
    "meta/fake": lambda x, n: x.to("meta"),
    "PackedSequence": lambda x, n: pack_padded_sequence(x, n, batch_first=True, enforce_sorted=False),
    "None": lambda x, n: None,
}
ELSEWHERE = {"DTensor", "functorch-wrapped"}
VERBS = ("capture", "repr", "save", "stats", "extract", "steer", "ablate", "edit", "compare",
         "find_nonfinite")


class Make(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: Tensor, lengths: Tensor) -> Any:
        return MAKERS[self.kind](x, lengths)


class KindModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.pre = nn.Identity()
        self.make = Make(kind)

    def forward(self, x: Tensor, lengths: Tensor) -> Any:
        return self.make(self.pre(x), lengths)


def values(v: Any) -> Tensor | None:
    """A value's numbers in plain PyTorch: the oracle every cell is checked against."""
    if v is None:
        return None
    if isinstance(v, PackedSequence):
        return v.data
    if v.is_nested:
        return torch.cat(v.unbind())
    if v.layout != torch.strided:
        return v.to_dense()
    return v.dequantize() if v.is_quantized else v


def sequences(v: Any) -> list[Tensor]:
    """One tensor per input, input order, real tokens only (what a ragged store row holds)."""
    if isinstance(v, PackedSequence):
        padded, lengths = pad_packed_sequence(v, batch_first=True)
        return _rows(padded, lengths)
    return list(v.unbind())


def _close(a: Tensor | None, b: Tensor | None) -> bool:
    assert a is not None and b is not None
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-6)


def edited(kind: str, ref: Any, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """The values plain PyTorch gives after ``fn`` on the output's numbers, in its form."""
    new = fn(values(ref))  # type: ignore[arg-type]
    if kind == "quantized":
        return torch.quantize_per_tensor(new, SCALE, ZERO, torch.quint8).dequantize()
    return new


def run_verb(kind: str, verb: str, x: Tensor, lengths: Tensor, tmp: Path) -> None:
    """One cell: raises AssertionError when the value is wrong, HookscopeError when refused."""
    model = KindModel(kind)
    with torch.no_grad():
        ref = model(x, lengths)
    batch = [{"x": x, "lengths": lengths}]
    if verb in ("capture", "repr", "save"):
        with hookscope.capture(model, "make") as acts:
            model(x, lengths)
        got = acts["make"]
        if verb == "capture" and (ref is None or getattr(ref, "is_meta", False)):  # kept as is
            assert got is None if ref is None else (got.is_meta and got.shape == ref.shape)
        elif verb == "capture":
            assert _close(values(got), values(ref))
        elif verb == "repr":
            assert "make" in repr(acts)
        else:
            acts.save(tmp / "a.safetensors")
            got = hookscope.load(tmp / "a.safetensors")["make"]
            assert _close(got[0] if isinstance(ref, PackedSequence) else got, values(ref))
    elif verb == "stats":
        result = hookscope.stats(model, batch, layers="make")["make"]
        want = values(ref)
        assert want is not None and int(result.count) == want.numel()
        assert torch.allclose(result.mean, want.double().mean())
    elif verb == "extract":
        store = hookscope.extract(model, batch, ["make"], tmp / "s", reduce=None, progress=False)
        rows = store["make"][:]
        if isinstance(rows, list):
            assert all(_close(a, b) for a, b in zip(rows, sequences(ref), strict=True))
        else:
            assert _close(rows, values(ref))
    elif verb in ("steer", "ablate", "edit"):
        v = torch.full((D, 1, 1) if kind == "channels_last" else (D,), 0.5)  # per channel
        if verb == "steer":
            block, fn = hookscope.steer(model, {"make": v}), (lambda t: t + v)
        elif verb == "ablate":
            block, fn = hookscope.ablate(model, "make"), torch.zeros_like
        else:
            block, fn = hookscope.edit(model, {"make": lambda t: t * 2}), (lambda t: t * 2)
        with torch.no_grad(), block:
            got = model(x, lengths)
        assert _close(values(got), edited(kind, ref, fn))
    elif verb == "compare":
        diff = hookscope.compare(model, copy.deepcopy(model), x, lengths, layers="make")["make"]
        assert diff.max_abs == 0.0
    else:
        assert hookscope.find_nonfinite(model, x, lengths) is None


def outcome(kind: str, verb: str, x: Tensor, lengths: Tensor, tmp: Path) -> str:
    """``"ok"``, or ``"refused"`` for a HookscopeError naming the kind; anything else raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_verb(kind, verb, x, lengths, tmp)
        except HookscopeError as err:
            named = kind.split(" ")[0].split("/")[0].lower()  # "nested", "meta", "none"
            assert named in str(err).lower(), f"{verb} on {kind}: the error does not name it: {err}"
            return "refused"
    return "ok"


#: the cells a kind refuses (every other cell must equal plain PyTorch)
REFUSED = {
    ("nested (strided)", "save"), ("nested (jagged)", "save"),
    ("complex", "stats"), ("complex", "extract"),
    *(("meta/fake", verb) for verb in ("save", "stats", "extract", "compare", "find_nonfinite",
                                       "steer", "ablate", "edit")),
    *(("None", verb) for verb in ("save", "stats", "extract", "steer", "ablate", "edit")),
}


def test_every_kind_of_the_table_is_generated_here() -> None:
    """A new row of KINDS fails here until it has a maker: then every verb tests it."""
    assert set(MAKERS) | ELSEWHERE == {kind.name for kind in KINDS}


batches = st.integers(1, 3).flatmap(lambda b: st.tuples(
    st.lists(st.integers(1, 4), min_size=b, max_size=b), st.integers(0, 2 ** 16)))


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("kind", list(MAKERS))
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=batches)
def test_kind_x_verb(kind: str, verb: str, shape: tuple[list[int], int], tmp_path: Path) -> None:
    lengths_list, seed = shape
    lengths = torch.tensor(lengths_list)
    x = torch.randn(len(lengths_list), max(lengths_list), D, generator=torch.Generator().manual_seed(seed))
    for i, n in enumerate(lengths_list):
        x[i, n:] = 0.0  # padding
    for child in tmp_path.iterdir():  # hypothesis runs each example in the same folder
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    want = "refused" if (kind, verb) in REFUSED else "ok"
    assert outcome(kind, verb, x, lengths, tmp_path) == want
