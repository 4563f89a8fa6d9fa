"""Looking inside a model: ``tree``, ``stats``, ``nonfinite`` (the first NaN/Inf), ``compare``
(two runs layer by layer), ``attention``, ``gradcam`` and the hook ``inventory``.

Imports ``record``, the engine, ``errors`` and ``util``.
"""

from hookscope.diagnostics.attention import attention, attention_gradients
from hookscope.diagnostics.compare import OUTPUT, Comparison, LayerDiff, PairDiff, compare, plot_errors
from hookscope.diagnostics.gradcam import gradcam, save_gradcam_overlay
from hookscope.diagnostics.histogram import MAX_BINS, Histogram
from hookscope.diagnostics.inventory import HookInfo, hooks, remove_hooks
from hookscope.diagnostics.lens import LogitLens, logit_lens
from hookscope.diagnostics.nonfinite import INPUT, NonFiniteOrigin, TensorSummary, find_nonfinite
from hookscope.diagnostics.rollout import rollout
from hookscope.diagnostics.stats import RunningStats, stats
from hookscope.diagnostics.tree import TreeRow, filter_rows, format_tree, tree, tree_of_call

__all__ = ["Comparison", "Histogram", "HookInfo", "INPUT", "LayerDiff", "LogitLens", "MAX_BINS",
           "NonFiniteOrigin", "OUTPUT", "PairDiff", "RunningStats", "TensorSummary", "TreeRow", "attention",
           "attention_gradients", "compare", "filter_rows", "find_nonfinite", "format_tree", "gradcam",
           "hooks", "logit_lens", "plot_errors", "remove_hooks", "rollout", "save_gradcam_overlay", "stats",
           "tree", "tree_of_call"]
