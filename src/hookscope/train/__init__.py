"""Training runs: ``monitor`` (statistics every N optimizer steps, the NaN guard), ``replay``
(re-run a guarded step from its bundle), ``report`` (the PNG of a run folder), and
``HookscopeCallback`` (the monitor in a Hugging Face ``Trainer``; imported on first use, as it
imports transformers)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "HookscopeCallback":
        from hookscope.train.hf import HookscopeCallback
        return HookscopeCallback
    raise AttributeError(f"module 'hookscope.train' has no attribute {name!r}")
