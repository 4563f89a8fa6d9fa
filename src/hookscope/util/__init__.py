"""Helpers with no knowledge of hooks, used by every layer: tensors in nested structures
(``nested``), atomic files (``files``), optional dependencies (``extras``), PNG figures
(``figures``). Imports nothing of hookscope but ``errors``."""
