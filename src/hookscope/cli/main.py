"""Entry point of the ``hookscope`` command: finds the verbs, parses, maps errors to exit codes.

Every module in ``hookscope.cli`` whose name does not start with ``_`` (``main`` aside) is a verb.
It defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.

Exit codes: the one rule is ``EXIT_CODES`` (also the epilog of ``hookscope --help``). A usage
error (``USAGE_ERRORS``, or argparse's) is one line, ``error: <message>``, naming the flag, what it
got and the fix; a run that failed prints ``error: <message>`` (a file-system error as the path
and what to do; any other exception, from the model's code, as ``error: <type>: <message>`` with
hookscope's note naming the module); a traceback only with ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from types import ModuleType
from typing import NoReturn, TextIO

import hookscope
from hookscope.cli._common import refuse_repeats
from hookscope.engine import exit_at_interrupt
from hookscope.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    EmptySelectionError,
    HookNeverFiredWarning,
    HookscopeError,
    SelectorError,
    SpecError,
    StoreError,
    StoreExistsError,
    StoreFaultError,
)
from hookscope.util import advice

__all__ = ["build_parser", "main", "run"]

# Verbs appear in --help in this order; any verb not listed follows alphabetically.
ORDER = ("tree", "capture", "attention", "gradcam", "lens", "nan", "diff", "stats", "extract", "show")

EXIT_CODES = """exit codes:
  0    success (a check found nothing wrong)
  1    the run failed: the model's code raised, a file could not be read or written, or a
       check found a problem (nan: a non-finite value, diff: a difference, show --verify:
       a damaged or incomplete store, monitor-report: the guard fired)
  2    usage: the command line asks for something that is not there or cannot be used (a
       flag's value, the model spec, an input, a --layers address matching nothing in the
       model, an output path); nothing was written
  130  interrupted (Ctrl-C)"""

# Errors that mean the command line is wrong (exit 2), not that the run failed (exit 1).
# A bad argument the API refuses at the call (engine.checks: a token id past the vocabulary,
# a --per-channel dimension the output lacks) came from the command line: usage too.
USAGE_ERRORS = (SpecError, SelectorError, StoreError, StoreExistsError, ArgumentTypeError,
                ArgumentValueError, EmptySelectionError)


def _verbs() -> dict[str, ModuleType]:
    import hookscope.cli as package

    names = [m.name for m in pkgutil.iter_modules(package.__path__)
             if not m.name.startswith("_") and m.name != "main"]
    names.sort(key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    return {n: importlib.import_module(f"hookscope.cli.{n}") for n in names}


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line: what is wrong, and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the whole command, one sub-parser per verb."""
    verbs = {name.replace("_", "-"): module for name, module in _verbs().items()}
    parser = _Parser(
        prog="hookscope",
        description=f"Look inside PyTorch models by module name: {', '.join(verbs)}.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hookscope {hookscope.__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")
    for name, module in verbs.items():  # a module monitor_report.py is the verb monitor-report
        verb_parser = sub.add_parser(name, help=module.HELP, description=module.HELP,
                                     epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        verb_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="show the full traceback of an error")
        module.add_arguments(verb_parser)
        refuse_repeats(verb_parser)
        verb_parser.set_defaults(run=module.run, parser=verb_parser)
    return parser


def run() -> None:
    """The ``hookscope`` process (console script and ``python -m hookscope``): ``main()``, then
    exit; a Ctrl-C that lands after the verb has returned (while Python shuts down) still
    exits 130 with one line instead of a traceback from an exit handler."""
    code = main()
    exit_at_interrupt("interrupted", 130)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
    _take_back_positionals(args, argv)
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
        usage = isinstance(err, USAGE_ERRORS) and not isinstance(err, StoreFaultError)
        return 2 if usage else 1  # a store that fails is no usage error: exit 1
    except OSError as err:  # the file system: the path and what to do
        if args.debug or err.errno is None:
            raise
        print(f"error: {advice(err)}", file=sys.stderr)
        return 1
    except Exception as err:  # the model's own code: still one paragraph
        if args.debug:
            raise
        notes = "".join(f"\n  {note}" for note in getattr(err, "__notes__", []))
        print(f"error: {type(err).__name__}: {err}{notes}\n(run with --debug for the traceback)",
              file=sys.stderr)
        return 1


def _take_back_positionals(args: argparse.Namespace, argv: list[str]) -> None:
    """``hookscope tree --input a b MODEL``: argparse gives MODEL to ``--input`` (an option taking
    several values takes every word up to the next option). When a positional is missing, hand
    it the last words of such runs, latest run first (each run keeps its first value); fail as
    a missing argument does when there are none."""
    missing = [(dest, metavar) for dest, metavar in getattr(args, "positionals", ())
               if getattr(args, dest) is None]
    if not missing:
        return
    several = getattr(args, "several", ())
    runs: list[tuple[list[str], int, int]] = []  # (the option's values, run start, run length)
    seen: dict[str, int] = {}
    for i, token in enumerate(argv):
        if token in several:
            length = next((j for j, t in enumerate(argv[i + 1:]) if t.startswith("-")),
                          len(argv) - i - 1)
            values = getattr(args, token.lstrip("-").replace("-", "_"))
            runs.append((values, seen.get(token, 0), length))
            seen[token] = seen.get(token, 0) + length
    taken: list[str] = []
    for values, start, length in reversed(runs):  # later runs and their ends first
        spare = min(length - 1, len(missing) - len(taken))
        if spare > 0:
            taken[:0] = values[start + length - spare:start + length]
            del values[start + length - spare:start + length]
    if len(taken) < len(missing):
        args.parser.error(f"the following arguments are required: "
                          f"{', '.join(metavar for _, metavar in missing)}")
    for (dest, _), value in zip(missing, taken):
        setattr(args, dest, value)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """Print a warning as one readable ``warning: ...`` paragraph on stderr (no file:line)."""
    print(f"warning: {message}", file=sys.stderr)
