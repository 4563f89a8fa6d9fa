"""Looking inside a model: ``module_tree``, ``statistics`` (and ``histogram``), ``nonfinite``
(the first NaN/Inf), ``comparison`` (two runs layer by layer, ``pairing`` across
implementations, ``forwards`` the runs, ``differences`` what each pair differs by),
``attention_maps``, ``attention_rollout``, ``class_maps`` (Grad-CAM), ``lens`` (the logit lens)
and the hook ``inventory``.

Imports ``record``, the engine, ``errors`` and ``util``.
"""

from hookscope.diagnostics.attention_maps import attention, attention_gradients
from hookscope.diagnostics.attention_rollout import rollout
from hookscope.diagnostics.class_maps import gradcam, save_gradcam_overlay
from hookscope.diagnostics.comparison import Comparison, PairDiff, compare, plot_errors
from hookscope.diagnostics.differences import LayerDiff
from hookscope.diagnostics.forwards import OUTPUT
from hookscope.diagnostics.histogram import MAX_BINS, Histogram
from hookscope.diagnostics.inventory import HookInfo, hooks, remove_hooks
from hookscope.diagnostics.lens import LogitLens, logit_lens
from hookscope.diagnostics.module_tree import TreeRow, filter_rows, format_tree, tree, tree_of_call
from hookscope.diagnostics.nonfinite import (
    INPUT,
    LOSS,
    OUTSIDE,
    NonFiniteOrigin,
    TensorSummary,
    find_nonfinite,
    loss_gradient_origin,
)
from hookscope.diagnostics.statistics import RunningStats, stats

__all__ = ["Comparison", "Histogram", "HookInfo", "INPUT", "LOSS", "LayerDiff", "LogitLens", "MAX_BINS",
           "NonFiniteOrigin", "OUTPUT", "OUTSIDE", "PairDiff", "RunningStats", "TensorSummary", "TreeRow",
           "attention", "attention_gradients", "compare", "filter_rows", "find_nonfinite", "format_tree",
           "gradcam", "hooks", "logit_lens", "loss_gradient_origin", "plot_errors", "remove_hooks",
           "rollout", "save_gradcam_overlay", "stats", "tree", "tree_of_call"]
