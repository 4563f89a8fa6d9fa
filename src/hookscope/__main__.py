"""``python -m hookscope`` runs the command-line tool, exactly as the ``hookscope`` script does."""

import sys

try:
    from hookscope.cli import run
except KeyboardInterrupt:  # Ctrl-C while the command loads: one line, as during a run
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

run()
