"""HookscopeCallback: hookscope.monitor inside a transformers.Trainer (tiny GPT-2, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope
from tests.models import tiny_gpt2

transformers = pytest.importorskip("transformers")
from hookscope.train import HookscopeCallback  # noqa: E402 - needs transformers

STEPS, LR, LAYERS = 12, 0.1, ["transformer.h.0.mlp", "transformer.h.1", "lm_head"]


class Scaled(nn.Module):
    """GPT-2's MLP activation divided by a temperature a callback sets: zero at one step."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act, self.temperature = act, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) / self.temperature


class ZeroAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, module: Scaled, step: int) -> None:
        self.module, self.step = module, step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.module.temperature = 0.0 if state.global_step == self.step else 1.0


def model() -> nn.Module:
    gpt2 = tiny_gpt2().train()
    for module in gpt2.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # the plain loop below draws no dropout masks in the Trainer's order
    gpt2.transformer.h[0].mlp.act = Scaled(gpt2.transformer.h[0].mlp.act)
    return gpt2


def data() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(1, 60, (2 * STEPS, 8), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def run_trainer(gpt2: nn.Module, tmp_path: Path, callbacks: list[Any],
                seen: list[dict[str, torch.Tensor]]) -> Any:
    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([r[key] for r in rows]) for key in rows[0]}
        seen.append({key: value.clone() for key, value in batch.items()})
        return batch
    optimizer = torch.optim.SGD(gpt2.parameters(), lr=LR)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=STEPS,
        use_cpu=True, report_to=[], max_grad_norm=0.0, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(
        model=gpt2, args=args, train_dataset=data(), data_collator=collate, callbacks=callbacks,
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)))
    return trainer.train()


def records(path: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "event" not in r]


def test_trainer_records_equal_the_plain_monitors(tmp_path: Path) -> None:
    seen: list[dict[str, torch.Tensor]] = []
    callback = HookscopeCallback(LAYERS, every=4, run_dir=tmp_path / "trainer")
    run_trainer(model(), tmp_path, [callback], seen)
    assert callback.monitor is not None and callback.monitor.step_index == STEPS
    assert callback.monitor.events == []

    plain = model()  # the same initial weights (seed 0), the Trainer's batches in its order
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    with hookscope.monitor(plain, LAYERS, every=4, optimizer=optimizer, run_dir=tmp_path / "plain"):
        for batch in seen:
            optimizer.zero_grad()
            # the Trainer's loss: summed over tokens, divided by the batch's label count
            plain(**batch, num_items_in_batch=batch["labels"].ne(-100).sum()).loss.backward()
            optimizer.step()
    assert hookscope.hooks(plain) == []

    ours = records(tmp_path / "trainer" / "records.jsonl")
    theirs = records(tmp_path / "plain" / "records.jsonl")
    assert [(r["step"], r["module"]) for r in ours] == [(s, m) for s in (0, 4, 8) for m in LAYERS]
    assert [(r["step"], r["module"]) for r in theirs] == [(r["step"], r["module"]) for r in ours]
    for mine, plain_record in zip(ours, theirs, strict=True):
        for kind in ("activation", "gradient"):
            for stat, value in plain_record[kind].items():
                expected = pytest.approx(value, rel=1e-4, abs=1e-7)
                assert mine[kind][stat] == expected, (mine["step"], kind, stat)
        assert mine["grad_norm"] == pytest.approx(plain_record["grad_norm"], rel=1e-4)
        assert mine["update_ratio"] == pytest.approx(plain_record["update_ratio"], rel=1e-4)


def test_trainer_nan_at_step_k_is_named_with_its_module(tmp_path: Path) -> None:
    gpt2 = model()
    callback = HookscopeCallback(LAYERS, every=2, run_dir=tmp_path / "run")
    seen: list[dict[str, torch.Tensor]] = []
    with pytest.raises(hookscope.NonFiniteStepError) as caught:
        run_trainer(gpt2, tmp_path, [ZeroAt(gpt2.transformer.h[0].mlp.act, 5), callback], seen)
    origin = caught.value.origin  # type: ignore[attr-defined]
    assert caught.value.step == 5  # type: ignore[attr-defined]
    assert (origin.path, origin.phase, origin.op) == ("transformer.h.0.mlp.act", "forward", "div")
    assert "step 5: first non-finite output: 'transformer.h.0.mlp.act' (Scaled)" in str(caught.value)
    assert all(torch.isfinite(p).all() for p in gpt2.parameters())  # raised before optimizer.step
    assert hookscope.hooks(gpt2) == []  # the callback closed the monitor
    bundle = tmp_path / "run" / "nonfinite-step-5.safetensors"
    assert caught.value.bundle == bundle  # type: ignore[attr-defined]
    recorded = hookscope.ReplayBundle.load(bundle)
    assert torch.equal(recorded.inputs.kwargs["input_ids"], seen[5]["input_ids"])  # step 5's batch
    gpt2.transformer.h[0].mlp.act.temperature = 0.0
    assert hookscope.replay(bundle, gpt2) == origin


def test_callback_outside_a_trainer_is_refused() -> None:
    callback = HookscopeCallback()
    with pytest.raises(hookscope.HookscopeError, match="callbacks=\\[...\\]"):
        callback.on_optimizer_step(None, None, None)
    with pytest.raises(hookscope.HookscopeError, match="got no model"):
        callback.on_train_begin(None, None, None)
