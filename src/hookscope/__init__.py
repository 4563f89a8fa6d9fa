"""hookscope: dependable PyTorch module hooks.

Select modules by the names you already see, capture every call, never fail silently; edit,
diagnose, and extract activations of whole data sets to disk.
"""

from hookscope.capture import CallInputs, Capture, capture, run
from hookscope.errors import (
    CaptureError,
    HookNeverFiredError,
    HookNeverFiredWarning,
    HookscopeError,
    SelectorError,
    StoreCorruptError,
)
from hookscope.hooks import HookInfo, hooks, remove_hooks
from hookscope.records import load
from hookscope.select import select

__version__ = "0.1.0"

__all__ = [
    "CallInputs",
    "Capture",
    "CaptureError",
    "HookInfo",
    "HookNeverFiredError",
    "HookNeverFiredWarning",
    "HookscopeError",
    "SelectorError",
    "StoreCorruptError",
    "capture",
    "hooks",
    "load",
    "remove_hooks",
    "run",
    "select",
]
