"""Training runs: ``monitor`` (statistics every N optimizer steps, the NaN guard), ``replay``
(re-run a guarded step from its bundle), ``report`` (the PNG of a run folder)."""
