"""efficientnet-lite0 (shipped weights): the activation module each block reuses twice, the
function inside it, and the residual add of the block's own forward are all addressable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hookscope
from hookscope.zoo.models import load_model


@pytest.mark.slow
def test_reused_swish_and_functional_calls_are_addressable() -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    model = load_model("efficientnet-lite0").module
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        with hookscope.capture(model, "_blocks.*._swish", "_blocks.*._swish::hardtanh",
                               "_blocks.*::add", "_blocks.4._bn0") as acts:
            logits = model(x)
        assert torch.equal(logits, model(x))  # watching changes nothing
    swish = [p for p in acts.paths if p.endswith("._swish")]
    assert len(swish) == 16
    for path in swish:
        modules, inner = acts.calls(path), acts.calls(f"{path}::hardtanh")
        expected = 1 if path == "_blocks.0._swish" else 2  # block 0 has no expansion conv
        assert len(modules) == len(inner) == expected
        for value, function in zip(modules, inner):
            assert torch.equal(value, function)  # ReLU6's forward is F.hardtanh(x, 0, 6)
    assert torch.equal(acts["_blocks.4._swish::hardtanh", 0],
                       F.hardtanh(acts["_blocks.4._bn0"], 0.0, 6.0))
    residual = [p for p, n in acts.counts.items() if p.endswith("::add") and n]
    assert residual and "_blocks.4::add" in residual and "_blocks.3::add" not in residual
    assert acts["_blocks.4::add"].shape == (1, 40, 28, 28)
