"""The two built-in pretrained models, through the library API (loaded once for this file)."""

from __future__ import annotations

import pytest
import torch

from hookscope.zoo.inputs import load_inputs
from hookscope.zoo.models import LoadedModel, load_model
from hookscope.zoo.predictions import predict, sentence_similarity


@pytest.fixture(scope="module")
def efficientnet() -> LoadedModel:
    return load_model("efficientnet-lite0")


@pytest.fixture(scope="module")
def minilm() -> LoadedModel:
    return load_model("minilm")


def test_efficientnet_is_ready(efficientnet: LoadedModel) -> None:
    module = efficientnet.module
    assert not module.training and efficientnet.kind == "image"
    assert sum(p.numel() for p in module.parameters()) == 4_652_008
    assert type(module._blocks).__name__ == "ModuleList" and len(module._blocks) == 16
    assert efficientnet.preprocess is not None and efficientnet.preprocess.size == (224, 224)
    assert efficientnet.class_names is not None and efficientnet.class_names[285] == "Egyptian cat"


def test_efficientnet_sees_an_egyptian_cat(efficientnet: LoadedModel) -> None:
    inputs = load_inputs(["sample:chelsea"], efficientnet)
    prediction = predict(efficientnet, inputs.call(efficientnet.module))
    best = prediction.classes[0][0]
    assert (best.index, best.name) == (285, "Egyptian cat")
    assert best.p == pytest.approx(0.76, abs=0.05)
    assert {s.index for s in prediction.classes[0][1:3]} == {281, 282}  # tabby, tiger cat


def test_minilm_similarity_matches_manual_mean_pooling(minilm: LoadedModel) -> None:
    sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue."]
    inputs = load_inputs(sentences, minilm)
    assert minilm.kind == "text" and set(inputs.kwargs) >= {"input_ids", "attention_mask"}
    output = inputs.call(minilm.module)
    prediction = predict(minilm, output, attention_mask=inputs.kwargs["attention_mask"])
    mask = inputs.kwargs["attention_mask"].unsqueeze(-1).float()
    pooled = (output.last_hidden_state * mask).sum(1) / mask.sum(1)
    unit = torch.nn.functional.normalize(pooled, dim=-1)
    assert prediction.similarity is not None
    assert torch.allclose(prediction.similarity, unit @ unit.T, atol=1e-6)
    assert prediction.similarity[0, 1] > 0.5 > prediction.similarity[0, 2]
    assert torch.equal(prediction.similarity,
                       sentence_similarity(output.last_hidden_state, inputs.kwargs["attention_mask"]))
