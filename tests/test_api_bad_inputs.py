"""Every bad argument of every public verb is a clean error, raised before anything runs (issue 26).

One table: each row is a verb called with one kind of bad argument (a model that is not a
module, ``None``, a layer that does not exist, a flag of the wrong type, a bad device or dtype,
an empty selection, bad positions). Each must raise a hookscope exception that is also the
Python exception its kind calls for (``TypeError``, ``ValueError``, ``LookupError``), whose
message names the parameter; no forward may have run (a plain counter on ``forward``), no hook
may be left (the autouse fixture of conftest), and the model's parameters, buffers, flags and
gradients are as before. Rows marked ``in_forward`` can only be judged once a value exists
(the shape of an output, what a user function returns): their error comes at the first call.
``test_figures`` prints tried / clean / raw / silent over the table.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookscope
from hookscope.errors import HookscopeError
from tests.models import MlpStack, tiny_gpt2

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[3, 9, 14, 2, 8]])
X = torch.randn(2, 10)


@dataclass(frozen=True)
class Row:
    verb: str
    kind: str
    param: str  # a regex the message must contain (the parameter's name)
    call: Callable[[nn.Module], Any]
    gpt2: bool = False
    in_forward: bool = False  # the value to judge exists only in the forward

    @property
    def id(self) -> str:
        return f"{self.verb}-{self.kind}"


def _acts(model: nn.Module) -> hookscope.Capture:
    """A capture made before the counter starts (patch's source)."""
    with hookscope.capture(model, "fc1") as acts:
        model.__wrapped_forward__(X)  # type: ignore[operator]
    return acts


def _transcoder() -> hookscope.Transcoder:
    return hookscope.Transcoder(W_enc=torch.zeros(32, 8), b_enc=torch.zeros(8), W_dec=torch.zeros(8, 32),
                                b_dec=torch.zeros(32))


def _metric(out: Any) -> torch.Tensor:
    return out.logits[:, -1, 3].mean()


hs = hookscope  # short rows
NAN = torch.full((20,), float("nan"))
ROWS = [
    # capture
    Row("capture", "model str", "model", lambda m: hs.capture("m", "fc1")),  # type: ignore[arg-type]
    Row("capture", "model None", "model", lambda m: hs.capture(None, "fc1")),  # type: ignore[arg-type]
    Row("capture", "model function", "model", lambda m: hs.capture(lambda x: x, "fc1")),  # type: ignore[arg-type]
    Row("capture", "bad layer", "nosuch", lambda m: hs.capture(m, "nosuch")),
    Row("capture", "pattern not str", "layers", lambda m: hs.capture(m, 5)),  # type: ignore[arg-type]
    Row("capture", "empty selection", "layers", lambda m: hs.capture(m)),
    Row("capture", "flag str", "grads", lambda m: hs.capture(m, "fc1", grads="yes")),  # type: ignore[arg-type]
    Row("capture", "flag int", "inputs", lambda m: hs.capture(m, "fc1", inputs=1)),  # type: ignore[arg-type]
    Row("capture", "flag grad_inputs", "grad_inputs",
        lambda m: hs.capture(m, "fc1", grad_inputs="no")),  # type: ignore[arg-type]
    Row("capture", "flag early_stop", "early_stop",
        lambda m: hs.capture(m, "fc1", early_stop="no")),  # type: ignore[arg-type]
    Row("capture", "flag clone", "clone", lambda m: hs.capture(m, "fc1", clone="yes")),  # type: ignore[arg-type]
    Row("capture", "bad device", "to", lambda m: hs.capture(m, "fc1", to="nodevice")),
    Row("capture", "absent device", "to", lambda m: hs.capture(m, "fc1", to="cuda:99")),
    Row("capture", "device type", "to", lambda m: hs.capture(m, "fc1", to=1.5)),  # type: ignore[arg-type]
    Row("capture", "dtype str", "dtype", lambda m: hs.capture(m, "fc1", dtype="half")),  # type: ignore[arg-type]
    Row("capture", "dtype int8", "dtype", lambda m: hs.capture(m, "fc1", dtype=torch.int8)),
    Row("capture", "reduce name", "reduce", lambda m: hs.capture(m, "fc1", reduce="median")),
    Row("capture", "reduce type", "reduce", lambda m: hs.capture(m, "fc1", reduce=5)),  # type: ignore[arg-type]
    Row("capture", "reduce returns None", "reduce",
        lambda m: hs.capture(m, "fc1", reduce=lambda t: None), in_forward=True),  # type: ignore[arg-type,return-value]
    Row("capture", "reduce first on (b, f)", "reduce",
        lambda m: hs.capture(m, "fc1", reduce="first"), in_forward=True),
    Row("capture", "on_unfired", "on_unfired", lambda m: hs.capture(m, "fc1", on_unfired="loud")),  # type: ignore[arg-type]
    Row("capture", "early_stop with grads", "early_stop",
        lambda m: hs.capture(m, "fc1", grads=True, early_stop=True)),
    # run
    Row("run", "model None", "model", lambda m: hs.run(None, X, layers="fc1")),  # type: ignore[arg-type]
    Row("run", "bad layer", "nosuch", lambda m: hs.run(m, X, layers="nosuch")),
    Row("run", "empty selection", "layers", lambda m: hs.run(m, X, layers=[])),
    Row("run", "option as keyword", "grads", lambda m: hs.run(m, X, layers="fc1", grads=True)),
    Row("run", "flag str", "grads", lambda m: hs.run(m, X, layers="fc1", options={"grads": "yes"})),
    Row("run", "bad device", "to", lambda m: hs.run(m, X, layers="fc1", options={"to": "nodevice"})),
    Row("run", "dtype str", "dtype", lambda m: hs.run(m, X, layers="fc1", options={"dtype": "half"})),
    Row("run", "layers None", "layers", lambda m: hs.run(m, X, layers=None)),  # type: ignore[arg-type]
    Row("run", "unknown option", "bogus", lambda m: hs.run(m, X, layers="fc1", options={"bogus": 1})),
    Row("run", "options str", "options", lambda m: hs.run(m, X, layers="fc1", options="early_stop")),  # type: ignore[arg-type]
    # edit
    Row("edit", "model None", "model", lambda m: hs.edit(None, {"fc1": abs})),  # type: ignore[arg-type]
    Row("edit", "bad layer", "nosuch", lambda m: hs.edit(m, {"nosuch": abs})),
    Row("edit", "empty selection", "edits", lambda m: hs.edit(m, {})),
    Row("edit", "not a dict", "edits", lambda m: hs.edit(m, ["fc1"])),  # type: ignore[arg-type]
    Row("edit", "value None", r"edits\['fc1'\]", lambda m: hs.edit(m, {"fc1": None})),  # type: ignore[dict-item]
    Row("edit", "value str", r"edits\['fc1'\]", lambda m: hs.edit(m, {"fc1": "zero"})),  # type: ignore[dict-item]
    Row("edit", "value tensor", r"edits\['fc1'\]",
        lambda m: hs.edit(m, {"fc1": torch.zeros(20)})),  # type: ignore[dict-item]
    Row("edit", "flag str", "inputs", lambda m: hs.edit(m, {"fc1": abs}, inputs="yes")),  # type: ignore[arg-type]
    Row("edit", "two args without context", "context=True", lambda m: hs.edit(m, {"fc1": lambda o, p: o})),
    Row("edit", "one arg with context", r"edits\['fc1'\]",
        lambda m: hs.edit(m, {"fc1": lambda o: o}, context=True)),
    Row("edit", "meta result", "meta",
        lambda m: hs.edit(m, {"fc1": lambda t: torch.zeros_like(t, device="meta")}), in_forward=True),
    Row("edit", "dtype result", "float64",
        lambda m: hs.edit(m, {"fc1": lambda t: t.double()}), in_forward=True),
    # ablate
    Row("ablate", "model None", "model", lambda m: hs.ablate(None, "fc1")),  # type: ignore[arg-type]
    Row("ablate", "bad layer", "nosuch", lambda m: hs.ablate(m, "nosuch")),
    Row("ablate", "empty selection", "layers", lambda m: hs.ablate(m, [])),
    Row("ablate", "how", "how", lambda m: hs.ablate(m, "fc1", how="nope")),  # type: ignore[arg-type]
    Row("ablate", "no reference", "reference", lambda m: hs.ablate(m, "fc1", how="mean")),
    Row("ablate", "empty positions", "positions", lambda m: hs.ablate(m, "fc1", positions=[])),
    Row("ablate", "empty heads", "heads", lambda m: hs.ablate(m, "fc1", heads=[])),
    Row("ablate", "flag str", "absolute", lambda m: hs.ablate(m, "fc1", positions=0, absolute="yes")),  # type: ignore[arg-type]
    Row("ablate", "seq_dim str", "seq_dim", lambda m: hs.ablate(m, "fc1", positions=0, seq_dim="1")),  # type: ignore[arg-type]
    Row("ablate", "flag str, no positions", "absolute", lambda m: hs.ablate(m, "fc1", absolute="yes")),  # type: ignore[arg-type]
    Row("ablate", "seq_dim str, no positions", "seq_dim", lambda m: hs.ablate(m, "fc1", seq_dim="1")),  # type: ignore[arg-type]
    Row("ablate", "positions str", "positions", lambda m: hs.ablate(m, "fc1", positions="last")),  # type: ignore[arg-type]
    Row("ablate", "positions on (b, f)", "positions",
        lambda m: hs.ablate(m, "fc1", positions=5), in_forward=True),
    Row("ablate", "positions bool", "positions",
        lambda m: hs.ablate(m, "transformer.h.0", positions=True), gpt2=True),
    # patch
    Row("patch", "model None", "model", lambda m: hs.patch(None, source=_acts(m), layers="fc1")),  # type: ignore[arg-type]
    Row("patch", "bad layer", "nosuch", lambda m: hs.patch(m, source=_acts(m), layers="nosuch")),
    Row("patch", "empty selection", "layers", lambda m: hs.patch(m, source=_acts(m), layers=[])),
    Row("patch", "empty mapping", "layers", lambda m: hs.patch(m, source=_acts(m), layers={})),
    Row("patch", "source None", "source", lambda m: hs.patch(m, source=None, layers="fc1")),  # type: ignore[arg-type]
    Row("patch", "empty positions", "positions",
        lambda m: hs.patch(m, source=_acts(m), layers="fc1", positions=[])),
    Row("patch", "positions map of str", "positions",
        lambda m: hs.patch(m, source=_acts(m), layers="fc1", positions={"a": "b"})),  # type: ignore[dict-item]
    Row("patch", "source_layers", "source_layers",
        lambda m: hs.patch(m, source=_acts(m), layers="fc1", source_layers=["fc1", "fc2"])),
    # steer
    Row("steer", "model None", "model", lambda m: hs.steer(None, {"fc1": torch.ones(20)})),  # type: ignore[arg-type]
    Row("steer", "bad layer", "nosuch", lambda m: hs.steer(m, {"nosuch": torch.ones(20)})),
    Row("steer", "empty selection", "vectors", lambda m: hs.steer(m, {})),
    Row("steer", "vector list", "vector", lambda m: hs.steer(m, {"fc1": [1.0] * 20})),  # type: ignore[dict-item]
    Row("steer", "vector NaN", r"vectors\['fc1'\]", lambda m: hs.steer(m, {"fc1": NAN})),
    Row("steer", "vector inf", r"vectors\['fc1'\]",
        lambda m: hs.steer(m, {"fc1": torch.full((20,), float("inf"))})),
    Row("steer", "vector meta", r"vectors\['fc1'\]",
        lambda m: hs.steer(m, {"fc1": torch.zeros(20, device="meta")})),
    Row("steer", "scale str", "scale", lambda m: hs.steer(m, {"fc1": torch.ones(20)}, scale="2")),  # type: ignore[arg-type]
    Row("steer", "scale nan", "scale", lambda m: hs.steer(m, {"fc1": torch.ones(20)}, scale=float("nan"))),
    # a complex vector is not bad input: it steers a complex output (case 52); one added to a
    # real output is refused in the forward (test_cases_kinds.py::test_52_steer_edit_...)
    Row("steer", "vector empty", r"vectors\['fc1'\]", lambda m: hs.steer(m, {"fc1": torch.zeros(0)})),
    Row("steer", "empty positions", "positions",
        lambda m: hs.steer(m, {"fc1": torch.ones(20)}, positions=[])),
    Row("steer", "positions on (b, f)", "positions",
        lambda m: hs.steer(m, {"fc1": torch.ones(20)}, positions=-1), in_forward=True),
    # stats
    Row("stats", "model None", "model", lambda m: hs.stats(None, [X], "fc1")),  # type: ignore[arg-type]
    Row("stats", "bad layer", "nosuch", lambda m: hs.stats(m, [X], "nosuch")),
    Row("stats", "empty selection", "layers", lambda m: hs.stats(m, [X], [])),
    Row("stats", "flag str", "early_stop", lambda m: hs.stats(m, [X], "fc1", early_stop="yes")),  # type: ignore[arg-type]
    Row("stats", "batches None", "batches", lambda m: hs.stats(m, None, "fc1")),  # type: ignore[arg-type]
    Row("stats", "per_channel str", "per_channel", lambda m: hs.stats(m, [X], "fc1", per_channel="yes")),  # type: ignore[arg-type]
    # the attack of the merged main: an allocator's RuntimeError (800 GB) or an overflow
    Row("stats", "hist 10**11", "hist", lambda m: hs.stats(m, [X], "fc1", hist=10**11)),
    Row("stats", "hist 2**62", "hist", lambda m: hs.stats(m, [X], "fc1", hist=2**62)),
    Row("stats", "hist 10**300", "hist", lambda m: hs.stats(m, [X], "fc1", hist=10**300)),
    # find_nonfinite
    Row("find_nonfinite", "model None", "model", lambda m: hs.find_nonfinite(None, X)),  # type: ignore[arg-type]
    Row("find_nonfinite", "flag str", "backward", lambda m: hs.find_nonfinite(m, X, backward="yes")),  # type: ignore[arg-type]
    Row("find_nonfinite", "loss_fn str", "loss_fn",
        lambda m: hs.find_nonfinite(m, X, backward=True, loss_fn="mse")),  # type: ignore[arg-type]
    # compare
    Row("compare", "model None", "model", lambda m: hs.compare(None, m, X)),  # type: ignore[arg-type]
    Row("compare", "model_b str", "model", lambda m: hs.compare(m, "m", X)),  # type: ignore[arg-type]
    Row("compare", "bad layer", "nosuch", lambda m: hs.compare(m, m, X, layers="nosuch")),
    Row("compare", "empty selection", "layers", lambda m: hs.compare(m, m, X, layers=[])),
    Row("compare", "atol negative", "atol", lambda m: hs.compare(m, m, X, atol=-1)),
    Row("compare", "atol nan", "atol", lambda m: hs.compare(m, m, X, atol=float("nan"))),
    Row("compare", "rtol str", "rtol", lambda m: hs.compare(m, m, X, rtol="big")),  # type: ignore[arg-type]
    Row("compare", "tolerances str", "tolerances",
        lambda m: hs.compare(m, m, X, pair="auto", tolerances={"float32": "tight"})),  # type: ignore[dict-item]
    Row("compare", "pair unknown", "pair", lambda m: hs.compare(m, m, X, pair="magic")),  # type: ignore[arg-type]
    # extract
    Row("extract", "model None", "model", lambda m: hs.extract(None, [X], "fc1", "s")),  # type: ignore[arg-type]
    Row("extract", "bad layer", "nosuch", lambda m: hs.extract(m, [X], "nosuch", "s")),
    Row("extract", "empty selection", "layers", lambda m: hs.extract(m, [X], [], "s")),
    Row("extract", "out None", "out", lambda m: hs.extract(m, [X], "fc1", None)),  # type: ignore[arg-type]
    Row("extract", "dtype str", "dtype", lambda m: hs.extract(m, [X], "fc1", "s", dtype="half")),  # type: ignore[arg-type]
    Row("extract", "dtype int8", "dtype", lambda m: hs.extract(m, [X], "fc1", "s", dtype=torch.int8)),
    Row("extract", "batch_size 0", "batch_size", lambda m: hs.extract(m, X, "fc1", "s", batch_size=0)),
    Row("extract", "reduce name", "reduce", lambda m: hs.extract(m, [X], "fc1", "s", reduce="median")),
    Row("extract", "flag str", "resume", lambda m: hs.extract(m, [X], "fc1", "s", resume="yes")),  # type: ignore[arg-type]
    Row("extract", "flag overwrite", "overwrite",
        lambda m: hs.extract(m, [X], "fc1", "s", overwrite="no")),  # type: ignore[arg-type]
    # attention
    Row("attention", "model None", "model", lambda m: hs.attention(None, IDS, layers="transformer.h.0.attn")),  # type: ignore[arg-type]
    Row("attention", "bad layer", "nosuch", lambda m: hs.attention(m, IDS, layers="nosuch"), gpt2=True),
    Row("attention", "empty selection", "layers", lambda m: hs.attention(m, IDS, layers=[]), gpt2=True),
    # gradcam
    Row("gradcam", "model None", "model", lambda m: hs.gradcam(None, X, "fc1")),  # type: ignore[arg-type]
    Row("gradcam", "bad layer", "nosuch", lambda m: hs.gradcam(m, X, "nosuch")),
    Row("gradcam", "method", "method", lambda m: hs.gradcam(m, X, "fc1", method="cam")),  # type: ignore[arg-type]
    Row("gradcam", "x None", "x", lambda m: hs.gradcam(m, None, "fc1")),  # type: ignore[arg-type]
    Row("gradcam", "target float", "target", lambda m: hs.gradcam(m, X, "fc1", target=1.5)),  # type: ignore[arg-type]
    Row("gradcam", "target bool", "target", lambda m: hs.gradcam(m, X, "fc1", target=True)),
    Row("gradcam", "3 targets for 2 images", "target", lambda m: hs.gradcam(m, X, "fc1", target=[1, 2, 3])),
    Row("gradcam", "grid zero", "grid", lambda m: hs.gradcam(m, X, "fc1", grid=(0, 0))),
    # patching_sweep
    Row("patching_sweep", "model None", "model",
        lambda m: hs.patching_sweep(None, IDS, IDS, layers="transformer.h.0", metric=_metric)),  # type: ignore[arg-type]
    Row("patching_sweep", "bad layer", "nosuch",
        lambda m: hs.patching_sweep(m, IDS, IDS, layers="nosuch", metric=_metric), gpt2=True),
    Row("patching_sweep", "empty selection", "layers",
        lambda m: hs.patching_sweep(m, IDS, IDS, layers=[], metric=_metric), gpt2=True),
    Row("patching_sweep", "metric None", "metric",
        lambda m: hs.patching_sweep(m, IDS, IDS, layers="transformer.h.0", metric=None), gpt2=True),  # type: ignore[arg-type]
    Row("patching_sweep", "empty positions", "positions",
        lambda m: hs.patching_sweep(m, IDS, IDS, layers="transformer.h.0", metric=_metric,
                                           positions=[]), gpt2=True),
    Row("patching_sweep", "flag str", "heads",
        lambda m: hs.patching_sweep(m, IDS, IDS, layers="transformer.h.0", metric=_metric,
                                           heads="yes"), gpt2=True),  # type: ignore[arg-type]
    *[Row("patching_sweep", f"batch_size {n}", "batch_size",
          lambda m, n=n: hs.patching_sweep(m, IDS, IDS, layers="transformer.h.0", metric=_metric,
                                           batch_size=n), gpt2=True) for n in (0, -5)],
    Row("patching_sweep", "position past the input", "positions",
        lambda m: hs.patching_sweep(m, IDS, IDS, layers="transformer.h.0", metric=_metric,
                                    positions=[99]), gpt2=True),
    Row("patching_sweep", "metric returns str", "metric",
        lambda m: hs.patching_sweep(m, IDS, IDS, layers="transformer.h.0", metric=lambda o: "x",
                                    progress=False), gpt2=True, in_forward=True),
    # capture_generation
    Row("capture_generation", "model None", "model",
        lambda m: hs.capture_generation(None, "transformer.h.0")),  # type: ignore[arg-type]
    Row("capture_generation", "bad layer", "nosuch",
        lambda m: hs.capture_generation(m, "nosuch"), gpt2=True),
    Row("capture_generation", "empty selection", "layers",
        lambda m: hs.capture_generation(m), gpt2=True),
    Row("capture_generation", "bad device", "to",
        lambda m: hs.capture_generation(m, "transformer.h.0", to="nodevice"), gpt2=True),
    Row("capture_generation", "flag str", "inputs",
        lambda m: hs.capture_generation(m, "transformer.h.0", inputs="yes"), gpt2=True),
    Row("capture_generation", "unknown option", "bogus",
        lambda m: hs.capture_generation(m, "transformer.h.0", bogus=1), gpt2=True),
    # monitor
    Row("monitor", "model None", "model", lambda m: hs.monitor(None, "fc1")),  # type: ignore[arg-type]
    Row("monitor", "bad layer", "nosuch", lambda m: hs.monitor(m, "nosuch", every=1)),
    Row("monitor", "empty selection", "layers", lambda m: hs.monitor(m, [], every=1)),
    Row("monitor", "every negative", "every", lambda m: hs.monitor(m, "fc1", every=-1)),
    Row("monitor", "every str", "every", lambda m: hs.monitor(m, "fc1", every="10")),  # type: ignore[arg-type]
    Row("monitor", "hist 10**11", "hist", lambda m: hs.monitor(m, "fc1", every=1, hist=10**11)),
    Row("monitor", "guard", "guard", lambda m: hs.monitor(m, "fc1", guard="loud")),  # type: ignore[arg-type]
    Row("monitor", "optimizer str", "optimizer", lambda m: hs.monitor(m, "fc1", optimizer="sgd")),  # type: ignore[arg-type]
    Row("monitor", "scaler str", "scaler", lambda m: hs.monitor(m, "fc1", scaler="amp")),
    Row("monitor", "run_dir a file", "run_dir", lambda m: hs.monitor(m, "fc1", run_dir=__file__)),
    # logit_lens
    Row("logit_lens", "model None", "model", lambda m: hs.logit_lens(None, IDS)),  # type: ignore[arg-type]
    Row("logit_lens", "ids None", "input_ids", lambda m: hs.logit_lens(m, None), gpt2=True),  # type: ignore[arg-type]
    Row("logit_lens", "bad layer", "nosuch", lambda m: hs.logit_lens(m, IDS, layers="nosuch"), gpt2=True),
    Row("logit_lens", "empty selection", "layers", lambda m: hs.logit_lens(m, IDS, layers=[]), gpt2=True),
    Row("logit_lens", "float ids", "input_ids", lambda m: hs.logit_lens(m, IDS.float()), gpt2=True),
    Row("logit_lens", "id past the vocabulary", "60 tokens",
        lambda m: hs.logit_lens(m, torch.tensor([[1, 500]])), gpt2=True),
    Row("logit_lens", "negative id", "input_ids",
        lambda m: hs.logit_lens(m, torch.tensor([[-1, 2]])), gpt2=True),
    Row("logit_lens", "decoder ids on a decoder-only model", "decoder_input_ids",
        lambda m: hs.logit_lens(m, IDS, decoder_input_ids=IDS), gpt2=True),
    Row("logit_lens", "mask shape", "attention_mask",
        lambda m: hs.logit_lens(m, IDS, attention_mask=torch.ones(3, 3)), gpt2=True),
    Row("logit_lens", "mask all zero", "attention_mask",
        lambda m: hs.logit_lens(m, IDS, attention_mask=torch.zeros_like(IDS)), gpt2=True),
    # rollout
    Row("rollout", "model None", "model", lambda m: hs.rollout(None, IDS, layers="transformer.h.*.attn")),  # type: ignore[arg-type]
    Row("rollout", "empty selection", "layers", lambda m: hs.rollout(m, IDS, layers=[]), gpt2=True),
    Row("rollout", "head_fusion", "head_fusion",
        lambda m: hs.rollout(m, IDS, layers="transformer.h.*.attn", head_fusion="median"), gpt2=True),  # type: ignore[arg-type]
    Row("rollout", "discard_ratio", "discard_ratio",
        lambda m: hs.rollout(m, IDS, layers="transformer.h.*.attn", discard_ratio=1.5), gpt2=True),
    Row("rollout", "flag str", "gradient",
        lambda m: hs.rollout(m, IDS, layers="transformer.h.*.attn", gradient="no"), gpt2=True),  # type: ignore[arg-type]
    # direct_logit_attribution
    Row("direct_logit_attribution", "model None", "model",
        lambda m: hs.direct_logit_attribution(None, IDS, tokens=(1, 2))),  # type: ignore[arg-type]
    Row("direct_logit_attribution", "no readout", "tokens",
        lambda m: hs.direct_logit_attribution(m, IDS), gpt2=True),
    Row("direct_logit_attribution", "token outside the vocabulary", "tokens",
        lambda m: hs.direct_logit_attribution(m, IDS, tokens=(1, 60)), gpt2=True),
    Row("direct_logit_attribution", "token float", "tokens",
        lambda m: hs.direct_logit_attribution(m, IDS, tokens=(1, 2.0)), gpt2=True),
    Row("direct_logit_attribution", "direction shape", "direction",
        lambda m: hs.direct_logit_attribution(m, IDS, direction=torch.ones(31)), gpt2=True),
    # path_patching
    Row("path_patching", "model None", "model",
        lambda m: hs.path_patching(None, IDS, IDS, senders=["a0.h0"], receivers=["logits"],  # type: ignore[arg-type]
                                   metric=_metric)),
    Row("path_patching", "senders str", "senders",
        lambda m: hs.path_patching(m, IDS, IDS, senders="a0.h0", receivers=["logits"],  # type: ignore[arg-type]
                                   metric=_metric), gpt2=True),
    Row("path_patching", "head outside", "a0.h9",
        lambda m: hs.path_patching(m, IDS, IDS, senders=["a0.h9"], receivers=["logits"],
                                   metric=_metric), gpt2=True),
    Row("path_patching", "through", "through",
        lambda m: hs.path_patching(m, IDS, IDS, senders=["a0.h0"], receivers=["a1.h0"],
                                   through="z", metric=_metric), gpt2=True),
    Row("path_patching", "receiver first", "receiver",
        lambda m: hs.path_patching(m, IDS, IDS, senders=["a1.h0"], receivers=["a0.h0"],
                                   metric=_metric), gpt2=True),
    Row("path_patching", "flag str", "direct",
        lambda m: hs.path_patching(m, IDS, IDS, senders=["a0.h0"], receivers=["logits"],
                                   metric=_metric, direct="no"), gpt2=True),  # type: ignore[arg-type]
    # edge_attribution_patching
    Row("edge_attribution_patching", "model None", "model",
        lambda m: hs.edge_attribution_patching(None, IDS, IDS, _metric)),  # type: ignore[arg-type]
    Row("edge_attribution_patching", "metric None", "metric",
        lambda m: hs.edge_attribution_patching(m, IDS, IDS, None), gpt2=True),  # type: ignore[arg-type]
    Row("edge_attribution_patching", "steps 0", "steps",
        lambda m: hs.edge_attribution_patching(m, IDS, IDS, _metric, steps=0), gpt2=True),
    Row("edge_attribution_patching", "steps float", "steps",
        lambda m: hs.edge_attribution_patching(m, IDS, IDS, _metric, steps=2.5), gpt2=True),  # type: ignore[arg-type]
    # attribution_patching
    Row("attribution_patching", "model None", "model",
        lambda m: hs.attribution_patching(None, IDS, IDS, _metric, layers="transformer.h.0")),  # type: ignore[arg-type]
    Row("attribution_patching", "empty selection", "layers",
        lambda m: hs.attribution_patching(m, IDS, IDS, _metric, layers=[]), gpt2=True),
    Row("attribution_patching", "metric None", "metric",
        lambda m: hs.attribution_patching(m, IDS, IDS, None, layers="transformer.h.0"), gpt2=True),  # type: ignore[arg-type]
    Row("attribution_patching", "empty positions", "positions",
        lambda m: hs.attribution_patching(m, IDS, IDS, _metric, layers="transformer.h.0",
                                                 positions=[]), gpt2=True),
    Row("attribution_patching", "position past the input", "positions",
        lambda m: hs.attribution_patching(m, IDS, IDS, _metric, layers="transformer.h.0",
                                          positions=[99]), gpt2=True),
    # issue 35: steer's overflow and layout, 1-D ids, open_store, replay, tree, remove_hooks
    Row("steer", "vector sparse", r"vectors\['fc1'\].*to_dense",
        lambda m: hs.steer(m, {"fc1": torch.ones(20).to_sparse()})),
    Row("steer", "scale overflows", r"scale \* vectors\['fc1'\] \(scale=1e\+308\)",
        lambda m: hs.steer(m, {"fc1": torch.ones(20)}, scale=1e308)),
    Row("logit_lens", "1-D ids", r"input_ids has shape \(5,\).*input_ids\[None\]",
        lambda m: hs.logit_lens(m, IDS[0]), gpt2=True),
    Row("open_store", "path None", "path must be a path", lambda m: hs.open_store(None)),  # type: ignore[arg-type]
    Row("open_store", "path int", "path must be a path", lambda m: hs.open_store(5)),  # type: ignore[arg-type]
    Row("replay", "bundle None", "bundle must be a path", lambda m: hs.replay(None, m)),  # type: ignore[arg-type]
    Row("replay", "model None", "model", lambda m: hs.replay("b.safetensors", None)),  # type: ignore[arg-type]
    Row("replay", "bundle missing", "nofile.safetensors",
        lambda m: hs.replay("nofile.safetensors", m)),
    Row("tree", "flag str", "ops", lambda m: hs.tree(m, X, ops="yes")),  # type: ignore[arg-type]
    Row("tree", "flag int", "ops", lambda m: hs.tree(m, ops=1)),  # type: ignore[arg-type]
    Row("remove_hooks", "flag str", "include_global",
        lambda m: hs.remove_hooks(m, include_global="yes")),  # type: ignore[arg-type]
    Row("remove_hooks", "flag int", "include_internal",
        lambda m: hs.remove_hooks(m, include_internal=1)),  # type: ignore[arg-type]
    Row("remove_hooks", "model None", "model", lambda m: hs.remove_hooks(None)),  # type: ignore[arg-type]
    # issue 50: feature circuits
    Row("attribution_graph", "model None", "model",
        lambda m: hs.attribution_graph(None, IDS, transcoders={})),  # type: ignore[arg-type]
    Row("attribution_graph", "layer missing", "transcoders", lambda m: hs.attribution_graph(
        m, IDS, transcoders={"transformer.h.9.mlp": _transcoder()}), gpt2=True),
    Row("attribution_graph", "inputs batch", "inputs", lambda m: hs.attribution_graph(
        m, torch.cat([IDS, IDS]), transcoders={"transformer.h.0.mlp": _transcoder()}), gpt2=True),
    Row("splice", "model None", "model", lambda m: hs.splice(None, {})),  # type: ignore[arg-type]
    Row("splice", "not a dictionary", "dictionaries",
        lambda m: hs.splice(m, {"fc1": nn.Linear(10, 10)})),  # type: ignore[dict-item]
]


def _counted(model: nn.Module) -> nn.Module:
    """``model`` whose forwards are counted in ``model.forwards`` (a plain counter, no hook)."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        model.forwards += 1  # type: ignore[operator]
        return original(*args, **kwargs)
    model.forwards = 0  # type: ignore[assignment]
    model.__wrapped_forward__ = original  # type: ignore[assignment]
    model.forward = forward  # type: ignore[method-assign]
    return model


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    return _counted(tiny_gpt2(n_head=2))


def _state(model: nn.Module) -> dict[str, Any]:
    return {"tensors": {k: v.clone() for k, v in model.state_dict().items()},
            "training": [m.training for m in model.modules()],
            "requires_grad": [p.requires_grad for p in model.parameters()],
            "grads": [p.grad for p in model.parameters()]}


def _same_state(model: nn.Module, before: dict[str, Any]) -> bool:
    after = _state(model)
    return (after["training"] == before["training"] and after["requires_grad"] == before["requires_grad"]
            and all(g is None for g in after["grads"])
            and all(torch.equal(after["tensors"][k], v) for k, v in before["tensors"].items()))


def _attempt(row: Row, model: nn.Module, tmp: Any) -> tuple[str, BaseException | None]:
    """Make the call (entering a returned block and running the model in it); return
    ``("clean" | "raw" | "silent", the exception)``."""
    try:
        with _in(tmp):
            made = row.call(model)
            if hasattr(made, "__enter__"):
                with made:
                    model(IDS if row.gpt2 else X)
    except HookscopeError as err:
        return "clean", err
    except Exception as err:  # noqa: BLE001  the figure counts raw errors
        return "raw", err
    return "silent", None


@functools.cache
def _mlp() -> nn.Module:
    return _counted(MlpStack())


class _in:
    """Run inside folder ``tmp`` (extract's relative ``out``)."""

    def __init__(self, tmp: Any):
        self.tmp = tmp

    def __enter__(self) -> None:
        import os
        self.old = os.getcwd()
        os.chdir(self.tmp)

    def __exit__(self, *exc: object) -> None:
        import os
        os.chdir(self.old)


# the kind of Python exception each kind of bad argument calls for
_PYTHON_KINDS = (TypeError, ValueError, LookupError)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_argument_is_a_clean_error_before_anything_runs(row: Row, gpt2: nn.Module, tmp_path: Any) -> None:
    model = gpt2 if row.gpt2 else _mlp()
    before, forwards = _state(model), model.forwards  # type: ignore[attr-defined]
    outcome, err = _attempt(row, model, tmp_path)
    assert outcome == "clean", f"{row.id}: {outcome} {type(err).__name__ if err else ''}: {err}"
    assert isinstance(err, _PYTHON_KINDS), f"{type(err).__mro__}"
    assert re.search(row.param, str(err)), f"{row.id}: {row.param!r} not named in: {err}"
    ran = model.forwards - forwards  # type: ignore[attr-defined]
    assert ran == (1 if row.in_forward else 0), f"{row.id}: {ran} forwards ran"
    assert _same_state(model, before)
    assert not list(tmp_path.iterdir()), "nothing is written for a refused call"


def test_figures(gpt2: nn.Module, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    outcomes = [_attempt(row, gpt2 if row.gpt2 else _mlp(), tmp_path)[0] for row in ROWS]
    counts = {k: outcomes.count(k) for k in ("clean", "raw", "silent")}
    with capsys.disabled():
        print(f"\nAPI bad calls: tried {len(ROWS)} / clean {counts['clean']} / raw "
              f"{counts['raw']} / silent {counts['silent']}")
    assert counts == {"clean": len(ROWS), "raw": 0, "silent": 0}
    assert len({r.verb for r in ROWS}) == 27  # 23 + attribution_graph, splice, direct_logit_attribution,
    # path_patching (issue 50)


# ---------------------------------------------------------------- generated inputs
_NOT_BOOL = st.one_of(st.text(max_size=5), st.integers(), st.none(), st.floats(allow_nan=False),
                      st.lists(st.booleans(), max_size=2))
_FLAGS = ("inputs", "grads", "grad_inputs", "early_stop")


@settings(max_examples=25, deadline=None)
@given(flag=st.sampled_from(_FLAGS), value=_NOT_BOOL)
def test_any_non_bool_flag_is_refused_naming_it(flag: str, value: object) -> None:
    with pytest.raises(hookscope.ArgumentTypeError, match=rf"^{flag} must be True or False; got "):
        hookscope.capture(_mlp(), "fc1", **{flag: value})


@settings(max_examples=25, deadline=None)
@given(text=st.text(max_size=12))
def test_a_device_string_torch_does_not_parse_is_refused(text: str) -> None:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        with pytest.raises(hookscope.ArgumentValueError, match=r"^to=.* is not a device torch knows"):
            hookscope.capture(_mlp(), "fc1", to=text)
        return
    if device.type in ("cpu", "meta"):
        hookscope.capture(_mlp(), "fc1", to=text)  # a device this machine has: accepted


@settings(max_examples=25, deadline=None)
@given(key=st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.booleans(),
                     st.tuples(st.just("fc1"), st.booleans()),
                     st.tuples(st.just("fc1"), st.text(max_size=3)),
                     st.tuples(st.integers(), st.integers())))
def test_a_record_key_of_another_type_is_refused(key: object) -> None:
    acts = hookscope.Records.from_tensors({"fc1": torch.ones(2, 20)})
    with pytest.raises(hookscope.ArgumentTypeError, match=r"a record is read as acts\['path'\]"):
        acts[key]  # type: ignore[index]


def test_acts_with_bool_call_is_refused_not_read_as_call_1() -> None:
    model = _mlp()
    with hookscope.capture(model, "fc1") as acts:
        model(X)
        model(X + 1)
    with pytest.raises(hookscope.ArgumentTypeError, match=r"got acts\[\('fc1', True\)\]"):
        acts["fc1", True]
    assert torch.equal(acts["fc1", 1], model.fc1(X + 1).detach())  # type: ignore[operator]


def test_an_edit_returning_another_device_names_both_devices() -> None:
    model = _mlp()
    with pytest.raises(hookscope.EditError, match=r"float32 on cpu, but the edit returned a "
                                                  r"Tensor of shape \(2, 20\), dtype torch.float32 "
                                                  r"on meta"):
        with hookscope.edit(model, {"fc1": lambda t: torch.zeros_like(t, device="meta")}):
            model(X)


def test_reduce_returning_none_names_the_reduce_and_the_shape() -> None:
    model = _mlp()
    with pytest.raises(hookscope.errors.ExtractError, match=r"returned a NoneType for an output "
                                                            r"of shape \(2, 20\)"):
        with hookscope.capture(model, "fc1", reduce=lambda t: None):  # type: ignore[arg-type,return-value]
            model(X)


def test_a_failed_monitor_entry_leaves_no_hook(tmp_path: Any) -> None:
    """A failure inside ``__enter__`` after hooks were registered removes them all (issue 26:
    ``optimizer="sgd"`` once left ``_forward_begins``/``_forward_ends`` on the model)."""
    model = MlpStack()

    class BrokenStepHooks(torch.optim.SGD):
        def register_step_post_hook(self, hook: Any) -> Any:
            raise RuntimeError("no post hooks here")

    optimizer = BrokenStepHooks(model.parameters(), lr=0.1)
    monitor = hookscope.monitor(model, "fc1", optimizer=optimizer, run_dir=tmp_path / "run")
    with pytest.raises(RuntimeError, match="no post hooks here"):
        monitor.__enter__()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert not optimizer._optimizer_step_pre_hooks
    assert (tmp_path / "run" / "records.jsonl").is_file()  # hookscope's own file, closed


def test_attribution_patching_warns_of_positions_left_out_as_patching_sweep_does(gpt2: nn.Module) -> None:
    """A corrupted input longer than the clean one: both verbs cover the clean one's positions
    and name the rest in the same warning (issue 26: attribution_patching was silent)."""
    longer = torch.tensor([[3, 9, 14, 2, 8, 5, 7]])
    for verb in (lambda: hs.attribution_patching(gpt2, IDS, longer, _metric, layers="transformer.h.0"),
                 lambda: hs.patching_sweep(gpt2, IDS, longer, layers="transformer.h.0", metric=_metric,
                                           progress=False)):
        with pytest.warns(UserWarning, match=r"covers positions 0 … 4: the corrupted input has 7"):
            sweep = verb()
        assert sweep.positions == [0, 1, 2, 3, 4] and sweep.values.shape == (1, 5)


# ---------------------------------------------------------------- issue 35's second attack
_HOSTILE = st.one_of(
    st.none(), st.booleans(), st.binary(max_size=3), st.text(max_size=3),
    st.integers(min_value=2**60, max_value=2**80), st.integers(max_value=-(2**64)),
    st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    st.just(torch.ones(2, 2).to_sparse()), st.just(object()))


def _calls(gpt2: nn.Module) -> dict[str, Callable[[Any], Any]]:
    from tests.models import LeNet

    mlp, x, ids = MlpStack(), torch.randn(2, 10), torch.tensor([[1, 2, 3]])
    return {
        "gradcam target": lambda v: hookscope.gradcam(LeNet(), torch.randn(1, 3, 32, 32), "conv2",
                                                      target=v),
        "rollout discard_ratio": lambda v: hookscope.rollout(
            gpt2, ids, layers="transformer.h.*.attn", discard_ratio=v),
        "steer scale": lambda v: hookscope.steer(mlp, {"fc1": torch.ones(20)}, scale=v),
        "steer vector": lambda v: hookscope.steer(mlp, {"fc1": v}),
        "ablate how": lambda v: hookscope.ablate(mlp, "fc1", how=v),
        "load": lambda v: hookscope.load(v),
        "monitor every": lambda v: hookscope.monitor(mlp, "fc1", every=v),
        "monitor guard": lambda v: hookscope.monitor(mlp, "fc1", guard=v),
        "capture model": lambda v: hookscope.capture(v, "fc1"),
        "tree ops": lambda v: hookscope.tree(mlp, x, ops=v),
        "remove_hooks include_global": lambda v: hookscope.remove_hooks(mlp, include_global=v),
        "steer positions": lambda v: hookscope.steer(mlp, {"fc1": torch.ones(20)}, positions=v),
        "capture pattern": lambda v: hookscope.capture(mlp, v),
        "run layers": lambda v: hookscope.run(mlp, x, layers=v),
    }


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_hostile_values_are_accepted_or_one_line_hookscope_errors(data: Any, gpt2: nn.Module) -> None:
    """Issue 35: a hostile value (None, bytes, 2**70, NaN, a sparse tensor whose repr spans
    lines, ...) for an argument is either a value that argument takes or a HookscopeError whose
    message is one line; before, ``gradcam(target=b"x")``/``2**70``, ``load(None)``,
    ``rollout(discard_ratio=None)``, ``probe(test_fraction=None)`` and ``steer(scale=2**70)``
    raised raw errors and a sparse tensor made every message span lines."""
    calls = _calls(gpt2)
    name = data.draw(st.sampled_from(sorted(calls)))
    value = data.draw(_HOSTILE)
    try:
        result = calls[name](value)
    except HookscopeError as err:
        assert "\n" not in str(err), f"{name}={value!r}: {err}"
        return
    if hasattr(result, "__exit__"):  # a block accepted the value: it is not entered here
        return


@pytest.mark.parametrize("value", [None, "x", [], 2**70, float("nan"), b"x"])
def test_probe_numbers_are_checked_before_use(value: object, tmp_path: Any) -> None:
    store = hookscope.extract(MlpStack(), [torch.randn(4, 10)], "fc1", tmp_path / "s", progress=False)
    for option in ("test_fraction", "C"):
        with pytest.raises(HookscopeError, match=option):
            hookscope.probe(store, labels=[0, 1, 0, 1], **{option: value})
