"""What a model's output means: top ImageNet classes, or how alike sentence embeddings are.

``predict(loaded, output)`` reads the output of a ``LoadedModel`` as its ``task`` says; the
``hookscope capture`` command prints the result above the activation table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hookscope.zoo.models import LoadedModel, Task

__all__ = ["ClassScore", "Prediction", "predict", "top_classes", "sentence_similarity"]


@dataclass(frozen=True)
class ClassScore:
    """One class of a classifier's prediction: output ``index``, its ``name``, probability ``p``."""

    index: int
    name: str
    p: float


@dataclass(frozen=True)
class Prediction:
    """What a model's output means, per input row.

    Attributes:
        task: the ``LoadedModel.task`` that produced it.
        classes: for ``"imagenet-classes"``, the top classes of each batch row, best first.
        similarity: for ``"sentence-embeddings"``, the ``(batch, batch)`` float32 cosine
            similarity of the mean-pooled, L2-normalised sentence embeddings.
    """

    task: Task
    classes: tuple[tuple[ClassScore, ...], ...] = ()
    similarity: torch.Tensor | None = None


def predict(loaded: LoadedModel, output: Any, *, attention_mask: torch.Tensor | None = None,
            k: int = 5) -> Prediction:
    """Read ``output`` (what ``loaded.module`` returned) as its task says.

    Args:
        loaded: the model that produced ``output``.
        output: ``(batch, classes)`` logits for ``"imagenet-classes"``; an output with
            ``last_hidden_state`` ``(batch, seq, d_model)`` for ``"sentence-embeddings"``.
        attention_mask: ``(batch, seq)`` mask of real tokens, for mean pooling (text models).
        k: number of classes to keep per row.

    Returns:
        A ``Prediction``; empty (``task == "none"``) when the model has no known head.
    """
    if loaded.task == "imagenet-classes" and isinstance(output, torch.Tensor):
        names = loaded.class_names or tuple(str(i) for i in range(output.shape[-1]))
        return Prediction(task=loaded.task, classes=top_classes(output, names, k=k))
    hidden = getattr(output, "last_hidden_state", None)
    if loaded.task == "sentence-embeddings" and isinstance(hidden, torch.Tensor):
        return Prediction(task=loaded.task, similarity=sentence_similarity(hidden, attention_mask))
    return Prediction(task="none")


def top_classes(logits: torch.Tensor, names: tuple[str, ...], *,
                k: int = 5) -> tuple[tuple[ClassScore, ...], ...]:
    """Softmax ``(batch, classes)`` logits (in float32) and keep the ``k`` best of each row."""
    probabilities = logits.detach().float().softmax(dim=-1)
    values, indices = probabilities.topk(min(k, probabilities.shape[-1]), dim=-1)
    return tuple(tuple(ClassScore(index=i, name=names[i], p=float(p))
                       for i, p in zip(row_indices.tolist(), row_values))
                 for row_indices, row_values in zip(indices, values))


def sentence_similarity(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean-pool token states over real tokens, L2-normalise, return cosine similarities.

    Args:
        hidden: ``(batch, seq, d_model)`` token states.
        attention_mask: ``(batch, seq)``, 1 for real tokens, 0 for padding; ``None``: all real.

    Returns:
        ``(batch, batch)`` float32 matrix, 1 on the diagonal.
    """
    states = hidden.detach().float()
    mask = (torch.ones(states.shape[:2]) if attention_mask is None
            else attention_mask.float()).unsqueeze(-1)  # (batch, seq, 1)
    pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (batch, d_model)
    unit = torch.nn.functional.normalize(pooled, dim=-1)
    return unit @ unit.T
