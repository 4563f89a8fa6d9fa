"""The ``hookscope`` command: one module per verb; each parses, calls the public API, formats."""

from hookscope.cli.main import run

__all__ = ["run"]
