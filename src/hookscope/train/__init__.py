"""Training runs: ``monitoring`` (``monitor``: statistics every N optimizer steps, the NaN guard;
``watcher``: the running ``Monitor``, ``sampling``: a sampled step, ``findings``: the guard's),
``guard`` (``replay``: re-run a guarded step from its bundle), ``report`` (the PNG of a run folder), and
``HookscopeCallback`` (the monitor in a Hugging Face ``Trainer``; imported on first use, as it
imports transformers)."""

from typing import Any

from hookscope.train.guard import ReplayBundle, replay
from hookscope.train.monitoring import monitor
from hookscope.train.report import draw_records, read_run
from hookscope.train.watcher import Monitor

__all__ = ["HookscopeCallback", "Monitor", "ReplayBundle", "draw_records", "monitor", "read_run", "replay"]


def __getattr__(name: str) -> Any:
    if name == "HookscopeCallback":
        from hookscope.train.hf import HookscopeCallback
        return HookscopeCallback
    raise AttributeError(f"module 'hookscope.train' has no attribute {name!r}")
