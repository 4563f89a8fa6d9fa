"""hookscope: dependable PyTorch module hooks.

Select modules by the names you already see, capture every call, never fail silently; edit,
diagnose, and extract activations of whole data sets to disk.
"""

from hookscope.attention import attention
from hookscope.capture import CallInputs, Capture, capture, run
from hookscope.compare import Comparison, LayerDiff, compare
from hookscope.edit import Edit, ablate, edit, patch, steer
from hookscope.errors import (
    AttentionError,
    CaptureError,
    EditError,
    ExtractError,
    FusedModuleWarning,
    GradcamError,
    HookNeverFiredError,
    HookNeverFiredWarning,
    HookscopeError,
    MissingExtraError,
    PositionError,
    SelectorError,
    SpecError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
)
from hookscope.extract import extract
from hookscope.generation import GenerationCapture, capture_generation
from hookscope.gradcam import gradcam, save_gradcam_overlay
from hookscope.grads import NoGrad
from hookscope.hooks import HookInfo, hooks, remove_hooks
from hookscope.nonfinite import NonFiniteOrigin, TensorSummary, find_nonfinite
from hookscope.records import RecordKey, Records, load
from hookscope.select import select
from hookscope.stats import RunningStats, stats
from hookscope.store import Store, open_store
from hookscope.sweep import Sweep, patching_sweep
from hookscope.tree import TreeRow, tree

__version__ = "0.1.0"

__all__ = [
    "AttentionError",
    "CallInputs",
    "Capture",
    "CaptureError",
    "Comparison",
    "Edit",
    "EditError",
    "ExtractError",
    "FusedModuleWarning",
    "GenerationCapture",
    "GradcamError",
    "HookInfo",
    "HookNeverFiredError",
    "HookNeverFiredWarning",
    "HookscopeError",
    "LayerDiff",
    "MissingExtraError",
    "NoGrad",
    "NonFiniteOrigin",
    "PositionError",
    "RecordKey",
    "Records",
    "RunningStats",
    "SelectorError",
    "SpecError",
    "Store",
    "StoreCorruptError",
    "StoreError",
    "StoreExistsError",
    "Sweep",
    "TensorSummary",
    "TreeRow",
    "ablate",
    "attention",
    "capture",
    "capture_generation",
    "compare",
    "edit",
    "extract",
    "find_nonfinite",
    "gradcam",
    "hooks",
    "load",
    "open_store",
    "patching_sweep",
    "patch",
    "remove_hooks",
    "run",
    "save_gradcam_overlay",
    "select",
    "stats",
    "steer",
    "tree",
]
