"""Entry point of the ``hookscope`` command: finds the verbs, parses, maps errors to exit codes.

Every module in ``hookscope.cli`` whose name does not start with ``_`` (``main`` aside) is a verb.
It defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.

Exit codes: 0 success; 1 the run failed or a check found a problem (a ``HookscopeError``,
printed as ``error: <message>`` without a traceback unless ``--debug``); 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from types import ModuleType

from hookscope.errors import HookscopeError

# Verbs appear in --help in this order; any verb not listed follows alphabetically.
ORDER = ("tree", "capture", "nan", "diff", "stats", "extract", "show")


def _verbs() -> dict[str, ModuleType]:
    import hookscope.cli as package

    names = [m.name for m in pkgutil.iter_modules(package.__path__)
             if not m.name.startswith("_") and m.name != "main"]
    names.sort(key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    return {n: importlib.import_module(f"hookscope.cli.{n}") for n in names}


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the whole command, one sub-parser per verb."""
    parser = argparse.ArgumentParser(
        prog="hookscope",
        description="Look inside PyTorch models by module name: tree, capture, nan, diff, "
                    "stats, extract, show.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND", required=True)
    for name, module in _verbs().items():
        verb_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        verb_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="show the full traceback of an error")
        module.add_arguments(verb_parser)
        verb_parser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except HookscopeError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
