"""Changing what modules compute: ``edits`` (edit, ablate, patch, steer), the rules that fit a
value to an output (``rules``), where patched values come from (``sources``), and activation
patching sweeps (``sweep``), attribution patching of nodes (``attribution``) and of edges
(``edges``), direct logit attribution (``direct_logit``, reading out through ``frozen_readout``)
and path patching (``patched_paths``).

Imports ``record``, the engine, ``errors`` and ``util``.
"""

from hookscope.editing.attribution import attribution_patching
from hookscope.editing.direct_logit import LogitAttribution, direct_logit_attribution
from hookscope.editing.edges import Edges, edge_attribution_patching
from hookscope.editing.edits import Edit, ablate, edit, patch, steer
from hookscope.editing.patched_paths import PathPatch, path_patching
from hookscope.editing.sweep import Sweep, patching_sweep

__all__ = ["Edges", "Edit", "Sweep", "ablate", "attribution_patching", "edge_attribution_patching", "edit",
           "patch", "patching_sweep", "steer",
           "LogitAttribution", "direct_logit_attribution", "PathPatch", "path_patching"]
