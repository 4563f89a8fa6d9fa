"""``python -m hookscope`` runs the command-line tool, exactly as the ``hookscope`` script does."""

from hookscope.cli.main import main

raise SystemExit(main())
