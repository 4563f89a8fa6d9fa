"""Entry point of the ``hookscope`` command: finds the verbs, parses, maps errors to exit codes.

Every module in ``hookscope.cli`` whose name does not start with ``_`` (``main`` aside) is a verb.
It defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.

Exit codes: 0 success; 1 the run failed or a check found a problem (a ``HookscopeError`` is
printed as ``error: <message>``; any other exception, from the model's code or the file system,
as ``error: <type>: <message>`` with hookscope's note naming the module; a traceback only with
``--debug``); 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from types import ModuleType
from typing import TextIO

from hookscope.errors import HookNeverFiredWarning, HookscopeError

# Verbs appear in --help in this order; any verb not listed follows alphabetically.
ORDER = ("tree", "capture", "attention", "nan", "diff", "stats", "extract", "show")


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
        description="Look inside PyTorch models by module name: tree, capture, attention, nan, "
                    "diff, stats, extract, show.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")
    for name, module in _verbs().items():
        verb_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        verb_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="show the full traceback of an error")
        module.add_arguments(verb_parser)
        verb_parser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            warnings.filterwarnings("always", category=HookNeverFiredWarning)
            warnings.filterwarnings("always", module=r"hookscope\.")
            return int(args.run(args))
    except HookscopeError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the model's own code, the file system: still one paragraph
        if args.debug:
            raise
        notes = "".join(f"\n  {note}" for note in getattr(err, "__notes__", []))
        print(f"error: {type(err).__name__}: {err}{notes}\n(run with --debug for the traceback)",
              file=sys.stderr)
        return 1


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """Print a warning as one readable ``warning: ...`` paragraph on stderr (no file:line)."""
    print(f"warning: {message}", file=sys.stderr)
