"""Changing what modules compute: ``edit`` (edit, ablate, patch, steer), the rules that fit a
value to an output (``rules``), where patched values come from (``sources``), and activation
patching sweeps (``sweep``).

Imports ``record``, the engine, ``errors`` and ``util``.
"""
