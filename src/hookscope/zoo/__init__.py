"""Real models and real inputs for the CLI and the demo: model specs (``models``), inputs
(``inputs``), predictions and pictures (``viz``). Loaded only when asked for: ``import
hookscope`` never imports this package (nor transformers, PIL or matplotlib).

Imports every layer below the CLI.
"""
