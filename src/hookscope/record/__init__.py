"""Recording what modules compute: ``verbs`` (``capture``, ``run``), ``captures`` (the session),
``slots`` (its hooks' record entries), ``records`` (the read API), ``entries`` (what one record
name holds), ``record_file`` (the saved file), gradients (``grads``), generation steps
(``generation``), reductions and token positions.

Imports the engine, ``errors`` and ``util``.
"""

from hookscope.engine import NotKept
from hookscope.record.captures import Capture
from hookscope.record.entries import CallInputs
from hookscope.record.generation import GenerationCapture, capture_generation
from hookscope.record.grads import NoGrad, grad_leaf, gradient_pass
from hookscope.record.positions import (
    Heads,
    Over,
    Positions,
    check_over,
    layout_positions,
    padding_dropped,
    real_tokens,
    resolve_heads,
    selected,
    tokens_first,
)
from hookscope.record.records import RecordKey, Records, load
from hookscope.record.reductions import NAMES, REDUCTIONS, Reduce, Reduction, reduction, reduction_name
from hookscope.record.verbs import capture, run

__all__ = ["CallInputs", "Capture", "GenerationCapture", "Heads", "NAMES", "NoGrad", "NotKept", "Over",
           "Positions", "REDUCTIONS", "RecordKey", "Records", "Reduce", "Reduction", "capture",
           "capture_generation", "check_over", "grad_leaf", "gradient_pass", "layout_positions", "load",
           "reduction", "reduction_name", "resolve_heads", "run", "padding_dropped", "real_tokens",
           "selected", "tokens_first"]
