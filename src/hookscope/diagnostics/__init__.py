"""Looking inside a model: ``tree``, ``stats``, ``nonfinite`` (the first NaN/Inf), ``compare``
(two runs layer by layer), ``attention``, ``gradcam`` and the hook ``inventory``.

Imports ``record``, the engine, ``errors`` and ``util``.
"""
