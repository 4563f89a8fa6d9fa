"""hookscope: dependable PyTorch module hooks.

Select modules by the names you already see, capture every call, never fail silently; edit,
diagnose, and extract activations of whole data sets to disk.

The layers are sub-packages (``engine`` <- ``record`` <- ``editing`` / ``diagnostics`` /
``store`` <- ``zoo`` <- ``cli``; ``errors`` and ``util`` everywhere): see docs/development.md.
``import hookscope`` loads no model spec, input or picture machinery (``hookscope.zoo``,
transformers, PIL, matplotlib).
"""

from hookscope.diagnostics.attention import attention, attention_gradients
from hookscope.diagnostics.compare import Comparison, LayerDiff, PairDiff, compare, plot_errors
from hookscope.diagnostics.gradcam import gradcam, save_gradcam_overlay
from hookscope.diagnostics.inventory import HookInfo, hooks, remove_hooks
from hookscope.diagnostics.lens import LogitLens, logit_lens
from hookscope.diagnostics.nonfinite import NonFiniteOrigin, TensorSummary, find_nonfinite
from hookscope.diagnostics.rollout import rollout
from hookscope.diagnostics.stats import RunningStats, stats
from hookscope.diagnostics.tree import TreeRow, tree
from hookscope.editing.attribution import attribution_patching
from hookscope.editing.edit import Edit, ablate, edit, patch, steer
from hookscope.editing.sweep import Sweep, patching_sweep
from hookscope.engine.select import select
from hookscope.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    AttentionError,
    BundleError,
    CaptureError,
    ConcurrentModelError,
    EditError,
    EmptySelectionError,
    ExtractError,
    ExtractInterrupted,
    FusedModuleWarning,
    GradcamError,
    HookNeverFiredError,
    HookNeverFiredWarning,
    HookscopeError,
    HookscopeWarning,
    MisalignedLabelsWarning,
    MissingExtraError,
    ModelCodeError,
    MonitorFaultWarning,
    NonFiniteStepError,
    NonFiniteStepWarning,
    PositionError,
    SelectorError,
    SpecError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
    TrainingModeWarning,
)
from hookscope.record.capture import CallInputs, Capture, capture, run
from hookscope.record.generation import GenerationCapture, capture_generation
from hookscope.record.grads import NoGrad
from hookscope.record.records import RecordKey, Records, load
from hookscope.store.extract import extract
from hookscope.store.probe import ProbeResult, probe
from hookscope.store.reader import Store, open_store
from hookscope.train.guard import ReplayBundle, replay
from hookscope.train.monitor import Monitor, monitor

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "ProbeResult",
    "probe",
    "ArgumentValueError",
    "AttentionError",
    "BundleError",
    "CallInputs",
    "Capture",
    "CaptureError",
    "ConcurrentModelError",
    "Comparison",
    "Edit",
    "EditError",
    "EmptySelectionError",
    "ExtractError",
    "ExtractInterrupted",
    "FusedModuleWarning",
    "GenerationCapture",
    "GradcamError",
    "HookInfo",
    "HookNeverFiredError",
    "HookNeverFiredWarning",
    "HookscopeWarning",
    "HookscopeError",
    "LayerDiff",
    "LogitLens",
    "MisalignedLabelsWarning",
    "MissingExtraError",
    "ModelCodeError",
    "Monitor",
    "MonitorFaultWarning",
    "NoGrad",
    "NonFiniteOrigin",
    "NonFiniteStepError",
    "NonFiniteStepWarning",
    "PairDiff",
    "PositionError",
    "RecordKey",
    "Records",
    "ReplayBundle",
    "RunningStats",
    "SelectorError",
    "SpecError",
    "Store",
    "StoreCorruptError",
    "StoreError",
    "StoreExistsError",
    "Sweep",
    "TensorSummary",
    "TrainingModeWarning",
    "TreeRow",
    "ablate",
    "attention",
    "attention_gradients",
    "attribution_patching",
    "capture",
    "capture_generation",
    "compare",
    "edit",
    "extract",
    "find_nonfinite",
    "gradcam",
    "hooks",
    "load",
    "logit_lens",
    "monitor",
    "open_store",
    "patch",
    "patching_sweep",
    "plot_errors",
    "remove_hooks",
    "replay",
    "rollout",
    "run",
    "save_gradcam_overlay",
    "select",
    "stats",
    "steer",
    "tree",
]

