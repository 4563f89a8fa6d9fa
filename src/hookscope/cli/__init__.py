"""The ``hookscope`` command: one module per verb; each parses, calls the public API, formats."""
