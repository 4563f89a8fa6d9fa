"""monitor's sampled statistics count the real tokens of a batch given with an attention mask,
by each value's layout (``record.padding_dropped``), as ``hookscope.stats`` does: padding
activations were counted, and the zero gradients of padding (masked out of the loss) dragged
the gradient statistics toward 0. With a GradScaler, the gradient statistics stay unscaled."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hookscope
from tests.models import padding_mask, tiny_gpt2

transformers = pytest.importorskip("transformers")

KEY = "transformer.h.0.mlp"
MODEL = tiny_gpt2()


def _plain(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: the module's output and d(loss)/d(output), by hooks."""
    seen: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []

    def hook(module: Any, args: Any, output: torch.Tensor) -> None:
        seen.append(output.detach())
        output.register_hook(lambda g: grads.append(g.detach()))
    handle = MODEL.transformer.h[0].mlp.register_forward_hook(hook)
    try:
        MODEL(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    finally:
        handle.remove()
    MODEL.zero_grad()
    return seen[0], grads[0]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3), st.integers(3, 6), st.booleans(), st.data())
def test_sampled_statistics_count_real_tokens(rows: int, seq: int, left: bool,
                                              data: st.DataObject) -> None:
    mask = padding_mask([seq] + [data.draw(st.integers(1, seq - 1)) for _ in range(rows - 1)],
                        seq, left)
    ids = torch.randint(1, 60, (rows, seq), generator=torch.Generator().manual_seed(rows * seq))
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.SGD(MODEL.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with tempfile.TemporaryDirectory() as tmp:
        with hookscope.monitor(MODEL, KEY, every=1, scaler=scaler, run_dir=tmp, guard=None) as mon:
            loss = MODEL(input_ids=ids, attention_mask=mask, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            mon.step()
        lines = (Path(tmp) / "records.jsonl").read_text().splitlines()
    optimizer.zero_grad()
    records = [json.loads(line) for line in lines]
    (record,) = [r for r in records if r.get("module") == KEY]
    output, grad = _plain(ids, mask, labels)
    real = mask.bool()
    for name, plain in (("activation", output[real]), ("gradient", grad[real])):
        got = record[name]
        assert got["count"] == plain.numel(), name
        assert got["mean"] == pytest.approx(float(plain.double().mean()), rel=1e-4, abs=1e-9), name
        assert got["absmax"] == pytest.approx(float(plain.abs().max()), rel=1e-4), name
    assert record["loss_scale"] == 2.0**8
