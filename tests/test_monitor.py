"""hookscope.monitor: statistics every N optimizer steps, the NaN guard and its replay bundle,
GradScaler overflows, the run folder and ``hookscope monitor-report``."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import hookscope
from hookscope.cli.main import main
from hookscope.train.report import run_figure
from tests.models import Temperature

VOCAB, DIM, SEQ, BATCH = 11, 16, 6, 4



class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.scale = Temperature()
        self.block = nn.TransformerEncoderLayer(DIM, 2, dim_feedforward=32, dropout=0.1,
                                                batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.scale(self.embed(tokens))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic next-token data: the target is the token plus one, modulo VOCAB."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return tokens, (tokens + 1) % VOCAB


def train(model: nn.Module, steps: int, run_dir: Path, *, zero_at: int | None = None,
          every: int = 100, guard: str = "raise") -> hookscope.Monitor:
    """A plain loop; the temperature is (zero_at - step) / zero_at, zero at step ``zero_at``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with hookscope.monitor(model, ["scale", "block", "head"], every=every, optimizer=optimizer,
                           run_dir=run_dir, guard=guard) as mon:  # type: ignore[arg-type]
        for step in range(steps):
            model.scale.temperature = 1.0 if zero_at is None else (zero_at - step) / zero_at
            tokens, targets = batch(step)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
    return mon


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_guard_names_step_module_direction_and_the_bundle_reproduces_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    with pytest.raises(hookscope.NonFiniteStepError) as caught:
        train(model, 300, tmp_path, zero_at=200)
    origin = caught.value.origin  # type: ignore[attr-defined]
    assert caught.value.step == 200  # type: ignore[attr-defined]
    assert (origin.path, origin.phase, origin.op, origin.call_index) == ("scale", "forward", "div", 0)
    assert "step 200: first non-finite output: 'scale' (Temperature)" in str(caught.value)
    assert "that module at step 100: activation mean " in str(caught.value)  # 200 was in progress
    assert not any(math.isnan(float(p.detach().sum())) for p in model.parameters())  # raised before the step
    (event,) = [r for r in lines(tmp_path / "records.jsonl") if r.get("event") == "nonfinite"]
    assert event | {"bundle": None} == {"event": "nonfinite", "step": 200, "rank": 0, "module": "scale",
                                        "class": "Temperature", "call": 0, "direction": "forward",
                                        "op": "div", "tensor": "output", "parameters": [],
                                        "bundle": None}
    bundle = Path(event["bundle"])
    assert bundle == tmp_path / "nonfinite-step-200.safetensors"
    fresh = TinyTransformer()  # other weights: the bundle brings the step's own
    fresh.scale.temperature = 0.0
    again = hookscope.replay(bundle, fresh)
    assert again == origin
    assert torch.equal(fresh.head.weight, model.head.weight)


def test_guard_never_fires_without_the_injection(tmp_path: Path) -> None:
    """The injected run above is silent for its first 200 steps; this one runs clean to the end
    (fewer steps: the same loop, the test file's time)."""
    torch.manual_seed(0)
    mon = train(TinyTransformer(), 120, tmp_path, every=40)
    records = lines(tmp_path / "records.jsonl")
    assert mon.events == [] and not any(r.get("event") == "nonfinite" for r in records)
    assert sorted({r["step"] for r in records if "step" in r and "event" not in r}) == [0, 40, 80]
    assert mon.step_index == 120


class SqrtGate(nn.Module):
    """sqrt(x * gate): with gate 0 the forward is finite (0) and the backward is not (1/0)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * self.gate + 0.0)


def small(gate_module: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Softplus(), gate_module, nn.Linear(8, 2))


@pytest.mark.parametrize("guard", ["warn", "skip"])
def test_backward_origin_and_warn_or_skip(guard: str) -> None:
    model = small(SqrtGate())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    with hookscope.monitor(model, every=0, optimizer=optimizer, guard=guard) as mon:  # type: ignore[arg-type]
        for step in range(3):
            model[2].gate = 0.0 if step == 1 else 1.0
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.zero_grad()
            model(x).sum().backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
            changed = not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            if step == 1:
                assert [w.category for w in caught] == [hookscope.NonFiniteStepWarning]
                assert changed == (guard == "warn")  # skip: the step's gradients were dropped
    assert len(mon.events) == (2 if guard == "warn" else 1)  # warn: NaN weights fire again
    event = mon.events[0]
    assert (event["step"], event["module"], event["direction"], event["op"]) == (
        1, "2", "backward", "SqrtBackward0")


def test_records_equal_stats_by_hand(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):  # plain hooks, computed by hand: outputs and their gradients
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            out.retain_grad()
            outputs[name] = out
        return hook
    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in ("0", "1")]
    expected = {}
    with hookscope.monitor(model, ["0", "1"], every=2, optimizer=optimizer, run_dir=tmp_path):
        for step in range(4):
            x = torch.randn(6, 4)
            snapshot = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))  # no hooks
            snapshot.load_state_dict(model.state_dict())
            before = [p.detach().clone() for p in model[0].parameters()]
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            grad_norm = torch.cat([p.grad.flatten() for p in model[0].parameters()]).norm()
            optimizer.step()
            if step % 2 == 0:
                after = torch.cat([p.detach().flatten() for p in model[0].parameters()])
                old = torch.cat([b.flatten() for b in before])
                expected[step] = (hookscope.stats(snapshot, [x], ["0", "1"]),
                                  {n: outputs[n].grad.clone() for n in outputs}, float(grad_norm),
                                  float((after - old).norm() / old.norm()))
    for handle in handles:
        handle.remove()
    records = [r for r in lines(tmp_path / "records.jsonl") if "event" not in r]
    assert [(r["step"], r["module"]) for r in records] == [(0, "0"), (0, "1"), (2, "0"), (2, "1")]
    for record in records:
        stats, grads, grad_norm, ratio = expected[record["step"]]
        values = stats[record["module"]].as_dict()
        activation = record["activation"]
        for key in ("mean", "std", "frac_zeros", "frac_nonfinite", "count"):
            assert activation[key] == pytest.approx(values[key], rel=1e-6, abs=1e-9)
        assert activation["absmax"] == pytest.approx(max(abs(values["min"]), abs(values["max"])))
        grad = grads[record["module"]].double()
        assert record["gradient"]["mean"] == pytest.approx(float(grad.mean()), abs=1e-9)
        assert record["gradient"]["std"] == pytest.approx(float(grad.std(unbiased=False)), rel=1e-6)
        assert record["gradient"]["absmax"] == pytest.approx(float(grad.abs().max()), rel=1e-6)
        if record["module"] == "0":
            assert record["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
            assert record["update_ratio"] == pytest.approx(ratio, rel=1e-5)
        else:
            assert record["grad_norm"] is None and record["update_ratio"] is None


def test_between_sampled_steps_only_the_root_is_hooked() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = []
    with hookscope.monitor(model, every=3, optimizer=optimizer):
        for _ in range(4):
            hooked.append(sorted({h.path for h in hookscope.hooks(model)}))
            optimizer.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
    assert hooked == [["", "0", "1", "2"], [""], [""], ["", "0", "1", "2"]]
    assert hookscope.hooks(model) == []


def test_gradscaler_overflows_are_counted_not_reported(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows fp16 gradients at once
    skipped = 0
    with hookscope.monitor(model, every=5, scaler=scaler, run_dir=tmp_path) as mon:
        for _ in range(30):
            x = torch.randn(16, 8)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < scale  # the scale backs off only after a skipped step
            mon.step()
    assert skipped > 5 and mon.overflows == skipped and mon.events == []
    records = lines(tmp_path / "records.jsonl")
    assert sum(r.get("event") == "overflow_skipped" for r in records) == skipped
    assert all(math.isfinite(p.detach().sum()) for p in model.parameters())


def test_an_infinite_forward_under_the_scaler_is_reported() -> None:
    model = small(Temperature())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model[2].temperature = 0.0
    with pytest.raises(hookscope.NonFiniteStepError, match="step 0: first non-finite output: '2'"):
        with hookscope.monitor(model, every=0, scaler=scaler) as mon:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(3, 4)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            mon.step()
    assert mon.overflows == 0


def test_an_infinite_loss_outside_the_model_is_named_as_the_loss(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A +inf loss computed outside the model (the model's output is finite) was reported as
    '1 NaN, 0 +Inf' of the replay's surrogate loss; the finding is the loss, with the +Inf its
    gradient carried into the model's output (issue 34)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Softplus())  # output > 0: inf * output = +inf
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(hookscope.NonFiniteStepWarning) as caught:
        with hookscope.monitor(model, every=1, optimizer=optimizer, run_dir=tmp_path,
                               guard="skip") as mon:
            optimizer.zero_grad()
            loss = model(torch.randn(2, 4)).sum() * float("inf")
            assert float(loss.detach()) == math.inf
            loss.backward()
            optimizer.step()
    message = str(caught[0].message)
    assert message.splitlines()[0] == (
        "step 0: the loss computed outside the model is non-finite: the gradient it sent into "
        "the model's output holds 6 +Inf (grad of output 0, first at [0, 0], [0, 1], [0, 2], "
        "[1, 0], [1, 1], [1, 2]); no module made it: check the loss function (a log or division "
        "of 0, an overflow, a non-finite target or weight)")
    assert message.splitlines()[1].endswith(", 0 NaN, 6 +Inf, 0 -Inf")
    origin = hookscope.replay(tmp_path / "nonfinite-step-0.safetensors", model)
    assert origin is not None and (origin.path, origin.phase, origin.bad_count) == (
        "<loss>", "backward", 6)
    assert (origin.outputs[0].nan, origin.outputs[0].posinf, origin.outputs[0].neginf) == (0, 6, 0)
    assert (mon.events[0]["module"], mon.events[0]["direction"]) == ("<loss>", "backward")
    assert main(["monitor-report", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        "step 0 (rank 0): the loss computed outside the model is non-finite (its grad of output 0 "
        "is; no module made it)")


def test_bf16_autocast_replays_under_autocast(tmp_path: Path) -> None:
    model = small(Temperature())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(hookscope.NonFiniteStepError) as caught:
        with hookscope.monitor(model, every=1, optimizer=optimizer, run_dir=tmp_path):
            for step in range(3):
                model[2].temperature = 0.0 if step == 2 else 1.0
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(torch.randn(3, 4))
                out.float().sum().backward()
                optimizer.step()
    assert "that module at step 1: activation" in str(caught.value)
    bundle = hookscope.ReplayBundle.load(caught.value.bundle)  # type: ignore[attr-defined]
    assert bundle.inputs.autocast == ("cpu", "bfloat16") and bundle.step == 2
    assert hookscope.replay(bundle, model).path == "2"


@pytest.mark.parametrize("first_call", ["before", "after"])
def test_compiled_model_is_watched_through_orig_mod(first_call: str) -> None:
    """backend="eager": dynamo traces the hooks as with inductor, without its compile time."""
    def run(compiled: bool) -> tuple[list[dict], hookscope.NonFiniteStepError]:
        model = small(Temperature())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        call = torch.compile(model, backend="eager") if compiled else model
        if first_call == "before":
            call(torch.randn(2, 4))  # compiled before the monitor's hooks exist
        seen = []
        with pytest.raises(hookscope.NonFiniteStepError) as caught:
            with hookscope.monitor(call, ["0", "2"], every=2, optimizer=optimizer) as mon:
                for step in range(5):
                    model[2].temperature = 0.0 if step == 4 else 1.0
                    optimizer.zero_grad()
                    call(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
                    optimizer.step()
                    seen.append(dict(mon.latest))
        assert hookscope.hooks(model) == []
        return seen, caught.value
    (eager, eager_error), (compiled, compiled_error) = run(False), run(True)
    assert [sorted({r["step"] for r in latest.values()}) for latest in compiled] == [[0], [0], [2], [2]]
    assert compiled == eager
    assert compiled_error.step == eager_error.step == 4  # type: ignore[attr-defined]
    assert compiled_error.origin == eager_error.origin  # type: ignore[attr-defined]
    assert (compiled_error.origin.path, compiled_error.origin.op) == ("2", "div")  # type: ignore[attr-defined]


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.inner, x, use_reentrant=False))


def test_checkpoint_recomputes_are_not_steps_nor_calls() -> None:
    model = Checkpointed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookscope.monitor(model, ["inner.0"], every=1, optimizer=optimizer) as mon:
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            optimizer.step()
    assert mon.step_index == 2
    assert mon.latest["inner.0"]["activation"]["count"] == 20  # one call of 5 x 4, not two
    assert mon.latest["inner.0"]["gradient"]["count"] == 20


def test_arguments_are_checked(tmp_path: Path) -> None:
    model = small(nn.Identity())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(hookscope.HookscopeError, match="call mon.step\\(\\) after scaler.update"):
        hookscope.monitor(model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(hookscope.HookscopeError, match="remove the mon.step"):
        with hookscope.monitor(model, optimizer=optimizer) as mon:
            mon.step()
    hookscope.monitor(model, run_dir=tmp_path).open().close()
    with pytest.raises(hookscope.HookscopeError, match="pass a new run_dir"):
        hookscope.monitor(model, run_dir=tmp_path).open()


def test_the_report_reads_at_a_glance() -> None:
    """monitor-report (issue 34): module names at a readable size, the guard's line outside the
    columns of other steps, a legend for scaler-skipped steps, and gradient-norm lines that go
    on past a skipped step (its norm is the overflow's inf)."""
    modules = ["block.self_attn.out_proj", "head"]
    records = [{"step": step, "module": module, "activation": {"absmax": 2.0, "frac_zeros": 0.1},
                "gradient": None, "grad_norm": math.inf if step == 4 else 1.0 + step,
                "update_ratio": None} for step in (0, 4, 8, 12) for module in modules]
    events = [{"event": "overflow_skipped", "step": 4}, {"event": "nonfinite", "step": 10},
              {"event": "nonfinite", "step": 13}]
    axes = {ax.get_title(): ax for ax in run_figure(records, events).axes}
    for title in ("activation absmax (log10)", "activation zero fraction"):
        heat = axes[title]
        assert [t.get_text() for t in heat.get_yticklabels()] == modules
        assert all(t.get_fontsize() >= 10 for t in heat.get_yticklabels())
        guard = [line.get_xdata()[0] for line in heat.get_lines() if line.get_color() == "red"]
        assert guard == [2.5, 3.75]  # between the columns of steps 8 and 12; after step 12's
        assert heat.get_xlim()[1] >= 4.0
    norms = axes["gradient norm"]
    drawn = {line.get_label(): list(line.get_xdata()) for line in norms.get_lines()}
    assert drawn["head"] == drawn[modules[0]] == [0, 8, 12]  # one line past skipped step 4
    legend = [t.get_text() for t in norms.get_legend().get_texts()]
    assert legend == [*modules, "guard fired", "step skipped by the GradScaler (overflow)"]


def test_monitor_report_draws_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    with pytest.raises(hookscope.NonFiniteStepError):
        train(TinyTransformer(), 12, tmp_path, zero_at=10, every=4)
    assert main(["monitor-report", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "step 10 (rank 0): non-finite forward in 'scale' (Temperature), call 0, op div, output",
        str(tmp_path / "monitor.png")]
    assert Image.open(tmp_path / "monitor.png").size == (1600, 800)


def test_entering_an_open_monitor_again_is_refused_and_closes_nothing() -> None:
    """A second ``with`` of an open monitor is refused; the monitor stays open and hooked (its
    refused entry once closed it, and the exit's watch of that entry closed it again)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = hookscope.monitor(model, every=1, optimizer=optimizer)
    with mon:
        with pytest.raises(hookscope.HookscopeError, match="already open"):
            with mon:
                pass
        assert sorted({h.path for h in hookscope.hooks(model)}) == ["", "0", "1", "2"]
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    assert hookscope.hooks(model) == []
