"""Changing what modules compute: ``edit`` (edit, ablate, patch, steer), the rules that fit a
value to an output (``rules``), where patched values come from (``sources``), and activation
patching sweeps (``sweep``), attribution patching of nodes (``attribution``) and of edges
(``edges``).

Imports ``record``, the engine, ``errors`` and ``util``.
"""
