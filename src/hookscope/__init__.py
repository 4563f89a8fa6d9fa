"""hookscope: dependable PyTorch module hooks.

Select modules by the names you already see, capture every call, never fail silently; edit,
diagnose, and extract activations of whole data sets to disk.

The layers are sub-packages (``engine`` <- ``record`` <- ``editing`` / ``diagnostics`` /
``store`` <- ``zoo`` <- ``cli``; ``errors`` and ``util`` everywhere): see the README's
Development section. ``import hookscope`` loads no model spec, input or picture machinery
(``hookscope.zoo``, transformers, PIL, matplotlib).
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

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


# Module paths of earlier releases that the README documents or users import, -> where they live
# now. Loaded modules are aliased at once (so ``import hookscope.tree`` never rebinds the
# ``hookscope.tree`` function to a module); the zoo's are loaded on first import.
_MOVED = {
    "attention": "diagnostics.attention", "capture": "record.capture", "compare": "diagnostics.compare",
    "diagnose": "engine.diagnose", "edit": "editing.edit", "extract": "store.extract",
    "generation": "record.generation", "gradcam": "diagnostics.gradcam", "grads": "record.grads",
    "hooks": "diagnostics.inventory", "names": "engine.names", "nonfinite": "diagnostics.nonfinite",
    "positions": "record.positions", "records": "record.records", "reductions": "record.reductions",
    "select": "engine.select", "stats": "diagnostics.stats", "sweep": "editing.sweep",
    "tree": "diagnostics.tree", "wrappers": "engine.wrappers",
}
_MOVED_LAZY = {"inputs": "zoo.inputs", "models": "zoo.models", "predictions": "zoo.predictions",
               "viz": "zoo.viz"}
for _old, _new in _MOVED.items():
    sys.modules.setdefault(f"{__name__}.{_old}", sys.modules[f"{__name__}.{_new}"])


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import hookscope.models`` (an earlier path) imports ``hookscope.zoo.models``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in _MOVED_LAZY:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.{_MOVED_LAZY[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system replaces it; exec_module restores it
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran under its own name in ``create_module``; give it back its own spec,
        which the import system replaced by the earlier path's."""
        module.__spec__ = module.__spec__.loader_state if module.__spec__ else None


sys.meta_path.append(_MovedModules())
