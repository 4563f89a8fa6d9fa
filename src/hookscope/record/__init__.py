"""Recording what modules compute: ``capture`` (the session) and ``records`` (the read API),
gradients (``grads``), generation steps (``generation``), reductions and token positions.

Imports the engine, ``errors`` and ``util``.
"""
