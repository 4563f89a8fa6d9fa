"""Run README.md and every docs page as a test: every code block runs and every shown output
is compared.

Blocks are fenced with a language, and run in page order, in one temporary folder per page
(a page is its own session: it defines what it uses):

- ```` ```python ````: executed as a script (an exception fails the test, naming the README line).
  A block whose first line is an import starts a new namespace, as a reader who copies it into a
  new file would (so a missing import fails); any other block continues the one before.
- ```` ```pycon ````: an interactive session. ``>>> `` starts a statement, ``... `` continues
  it, and the lines up to the next ``>>> `` are its shown output: what the REPL prints (values
  through ``sys.displayhook``, ``print`` output), then one ``Category: message`` line per warning
  raised, then for an exception ``Traceback (most recent call last):``, ``  ...``, and
  ``module.Class: message`` followed by the exception's notes.
- ```` ```console ````: ``$ `` starts a command (``\\`` continues it, ``#`` starts a comment);
  the lines up to the next ``$ `` are its shown output: stdout and stderr in the order written,
  where stderr's lines (progress, timings) may be left out. ``hookscope ...`` and
  ``python -m hookscope ...`` run in this process through ``hookscope.cli.main.main``; any other
  command must be marked ``skip``.
- ```` ```text ````: prose (a folder layout, a diagram); never run. A text block that starts with
  ``$ `` or ``>>> `` is an error (it is a console or pycon block), and so is a fence without a
  language.

Comparison of a shown output with the actual one (``outputs_match``):

- Trailing spaces and blank lines of the output are ignored; a run of spaces equals any other
  run (columns of a table move when a number's width changes).
- A line that is only ``...`` stands for any number of lines (none included).
- Integers (no ``.`` and no exponent) and all other text must be equal.
- A decimal number shown as ``s`` matches an actual ``a`` when
  ``|a - s| <= 2 * 10**(-d) + 1e-4 * |s|``, ``d`` the digits shown after the point (for
  ``1.5e-05``, the unit of its last digit): the shown digits are right up to rounding and the
  last digit's kernel-to-kernel noise on other CPUs.

Directives: an HTML comment ``<!-- readme-test: KEYWORD ... -->`` before a block applies to that
block; one comment may hold several, one a line:

- ``skip REASON``: do not run the block (a pytest skip with the reason), e.g. it needs torchrun.
- ``replace OLD => NEW``: run the block with OLD replaced by NEW (smaller data, no plots); both
  sides are stripped of spaces, NEW may be empty.
- ``setup CODE``: run the Python statement CODE first, unseen by the reader (make input files).
- ``rtol R REASON``: decimal numbers of the block's output match within the relative tolerance
  ``R`` as well (integers and text stay exact). For values that depend on the CPU's kernels
  (reduced precision, thread counts, vector width), which a page may not pin to its last digit;
  the page's prose must state the tolerance to its reader.
- ``atol A REASON``: every number, integers too, matches within ``A`` absolute as well (a fraction
  of exact zeros that rounding on another CPU can make: ``0`` shown, ``6.4e-05`` there).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import shlex
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LANGUAGES = ("python", "pycon", "console", "text")
_DIRECTIVE = re.compile(r"<!--\s*readme-test:(.*?)-->", re.S)
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w]|\.\d)")


class ReadmeError(AssertionError):
    """A README block failed or its shown output differs; the message names the README line."""


@dataclass
class Block:
    """One fenced block: its language, first code line (1-based) and lines, and directives."""

    language: str
    line: int
    lines: list[str]
    skip: str | None = None
    replace: list[tuple[str, str]] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    rtol: float = 0.0  # relative tolerance of shown decimal numbers (directive ``rtol``)
    atol: float = 0.0  # absolute tolerance of every shown number (directive ``atol``)
    file: str = "README.md"  # the page it is in, as errors name it

    @property
    def name(self) -> str:
        return f"line {self.line} {self.language}"

    def text(self) -> str:
        text = "\n".join(self.lines)
        for old, new in self.replace:
            if old not in text:
                raise ReadmeError(f"{self.file} line {self.line}: 'replace {old} => {new}' "
                                  f"finds no {old!r} in the block")
            text = text.replace(old, new)
        return text


def parse(readme: str, file: str = "README.md") -> list[Block]:
    """Return the fenced blocks of ``readme`` (the text of ``file``: README.md or a docs page)
    with their directives, checking the conventions."""
    blocks: list[Block] = []
    pending: list[tuple[int, str]] = []
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("<!--") and "readme-test:" in stripped:
            end = _closing(lines, i, i, "-->", "the readme-test comment is never closed with -->",
                           file)
            body = _DIRECTIVE.search("\n".join(lines[i:end + 1]))
            assert body is not None
            pending += [(i + 1, d.strip()) for d in body.group(1).splitlines() if d.strip()]
        elif stripped.startswith("```"):
            end = _closing(lines, i, i + 1, "```", "the block is never closed with ```", file)
            indent = len(lines[i]) - len(lines[i].lstrip())
            block = Block(stripped[3:].strip(), i + 2, [line[indent:] for line in lines[i + 1:end]],
                          file=file)
            _check_language(block)
            for where, directive in pending:
                _apply(block, where, directive)
            pending = []
            blocks.append(block)
        else:
            end = i
        i = end + 1
    return blocks


def _closing(lines: list[str], opening: int, start: int, marker: str, problem: str,
             file: str) -> int:
    """The index of the first line from ``start`` that closes what line ``opening`` opened."""
    for end in range(start, len(lines)):
        if (marker in lines[end]) if marker == "-->" else lines[end].strip() == marker:
            return end
    raise ReadmeError(f"{file} line {opening + 1}: {problem}")


def _check_language(block: Block) -> None:
    where = f"{block.file} line {block.line - 1}"
    if block.language not in LANGUAGES:
        raise ReadmeError(f"{where}: a fence needs one of the languages {', '.join(LANGUAGES)}, "
                          f"not {block.language!r}, so that the README test knows how to run it")
    first = next((line for line in block.lines if line.strip()), "")
    if block.language == "text" and first.startswith(("$ ", ">>> ")):
        raise ReadmeError(f"{where}: this text block shows a session: mark it ```console "
                          "(for $ commands) or ```pycon (for >>> Python) so that it is tested")


def _apply(block: Block, where: int, directive: str) -> None:
    keyword, _, rest = directive.partition(" ")
    if keyword == "skip" and rest.strip():
        block.skip = rest.strip()
    elif keyword == "replace" and "=>" in rest:
        old, new = (side.strip() for side in rest.split("=>", 1))
        block.replace.append((old, new))
    elif keyword == "setup" and rest.strip():
        block.setup.append(rest.strip())
    elif keyword in ("rtol", "atol") and _is_tolerance(rest):
        setattr(block, keyword, float(rest.split()[0]))
    else:
        raise ReadmeError(f"{block.file} line {where}: unknown readme-test directive {directive!r}: "
                          "use 'skip REASON', 'replace OLD => NEW', 'setup CODE', 'rtol R REASON' or "
                          "'atol A REASON'")


def _is_tolerance(rest: str) -> bool:
    """Whether ``rest`` is ``R REASON`` with ``0 < R < 1`` and a reason of at least two words."""
    words = rest.split()
    try:
        return len(words) >= 3 and 0.0 < float(words[0]) < 1.0
    except ValueError:
        return False


# ----------------------------------------------------------------------------- comparison


def outputs_match(expected: str, actual: str, optional: set[int] | None = None,
                  rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """Return None when ``actual`` matches the shown ``expected``, else why (the first line).

    ``optional`` holds indices of ``actual`` lines (stderr's) that the shown output may leave out;
    ``rtol`` and ``atol`` widen the match of numbers (directives ``rtol``, ``atol``).
    """
    want = _trim(expected.splitlines())
    # A terminal shows what follows a line's last carriage return (progress bars rewrite lines).
    got = [line.rsplit("\r", 1)[-1].rstrip() for line in actual.split("\n")]
    skippable = {j for j in optional or set()} | {j for j, line in enumerate(got) if not line}
    problem = _match(want, 0, got, 0, skippable, (rtol, atol))
    return None if problem is None else problem[1]


def _trim(lines: list[str]) -> list[str]:
    lines = [line.rstrip() for line in lines]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _match(want: list[str], i: int, got: list[str], j: int, skippable: set[int],
           tolerance: tuple[float, float]) -> tuple[int, str] | None:
    """None when ``want[i:]`` matches ``got[j:]``; else how far it got and why it stopped."""
    while i < len(want):
        if want[i].strip() == "...":
            if i + 1 == len(want):
                return None
            tries = [_match(want, i + 1, got, k, skippable, tolerance) for k in range(len(got), j - 1, -1)]
            if any(t is None for t in tries):
                return None
            return max((t for t in tries if t is not None), key=lambda t: t[0])  # the furthest
        if j >= len(got):
            return i, f"shown line {i + 1} {want[i]!r} is missing: the output ended"
        problem = line_mismatch(want[i], got[j], *tolerance)
        if problem is None:
            i += 1
        elif j not in skippable:
            return i, f"shown line {i + 1} {want[i]!r} differs from {got[j]!r}: {problem}"
        j += 1
    rest = [line for k, line in enumerate(got[j:], j) if k not in skippable]
    if rest:
        return i, f"the output goes on after the shown lines: {rest[0]!r}"
    return None


def line_mismatch(shown: str, actual: str, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """Why the ``actual`` line does not match the ``shown`` one, or None (rules: module docstring)."""
    shown_text, shown_numbers = _split(shown)
    actual_text, actual_numbers = _split(actual)
    if shown_text != actual_text or len(shown_numbers) != len(actual_numbers):
        return "the text differs"
    for s, a in zip(shown_numbers, actual_numbers):
        if not _number_matches(s, a, rtol, atol):
            return f"{a} is not {s} to the shown precision" + (
                f" (rtol {rtol}, atol {atol})" if rtol or atol else "")
    return None


def _split(line: str) -> tuple[list[str], list[str]]:
    text = [" ".join(part.split()) for part in _NUMBER.split(line)]
    return text, _NUMBER.findall(line)


def _number_matches(shown: str, actual: str, rtol: float = 0.0, atol: float = 0.0) -> bool:
    if not re.search(r"[.eE]", shown):
        return shown.lstrip("+") == actual.lstrip("+") or (
            atol > 0 and math.isfinite(float(actual)) and abs(float(actual) - float(shown)) <= atol)
    mantissa, _, exponent = shown.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    unit = 10.0 ** (int(exponent or 0) - decimals)
    s, a = float(shown), float(actual)
    return math.isfinite(a) and abs(a - s) <= 2 * unit + max(1e-4, rtol) * abs(s) + atol


# ----------------------------------------------------------------------------- running


class Session:
    """The state shared by the blocks of one README: a namespace and the README's path."""

    def __init__(self, readme: Path):
        self.readme = readme
        self.namespace: dict[str, Any] = {"__name__": "__readme__"}

    def run(self, block: Block) -> None:
        """Run ``block`` (in the current folder); raise ``ReadmeError`` naming the line."""
        for code in block.setup:
            exec(compile(code, f"{self.readme} setup", "exec"), self.namespace)
        runner: dict[str, Callable[[Block], None]] = {
            "python": self._python, "pycon": self._pycon, "console": self._console}
        if block.language in runner:
            runner[block.language](block)

    def _compile(self, source: str, line: int, mode: str) -> Any:
        # Pad with newlines so that a traceback's line numbers are README.md's own.
        return compile("\n" * (line - 1) + source, str(self.readme), mode)

    def _python(self, block: Block) -> None:
        if block.text().startswith(("import ", "from ")):
            self.namespace = {"__name__": "__readme__"}
        try:
            exec(self._compile(block.text(), block.line, "exec"), self.namespace)
        except Exception as err:
            line = _innermost_line(err, str(self.readme)) or block.line
            raise ReadmeError(f"{block.file} line {line} (python block at line {block.line}) "
                              f"raised {type(err).__name__}: {err}\n"
                              f"{''.join(traceback.format_exception(err))}") from err

    def _pycon(self, block: Block) -> None:
        for line, source, shown in _statements(block):
            actual = self._interact(source, line)
            problem = outputs_match(shown, actual, rtol=block.rtol, atol=block.atol)
            if problem is not None:
                raise ReadmeError(_mismatch(block.file, line, f">>> {source.splitlines()[0]}", problem,
                                            shown, actual))

    def _interact(self, source: str, line: int) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            error = None
            try:
                code = self._compile(source + "\n", line, "single")
                exec(code, self.namespace)
            except Exception as err:
                error = err
        text = out.getvalue()
        text += "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
        if error is not None:
            text += "Traceback (most recent call last):\n  ...\n" + _exception_text(error)
        return text

    def _console(self, block: Block) -> None:
        for line, command, shown in _commands(block):
            argv = shlex.split(command, comments=True)
            if not argv:  # a comment only
                continue
            if argv[:3] == ["python", "-m", "hookscope"]:
                argv = argv[2:]
            if not argv or argv[0] != "hookscope":
                raise ReadmeError(f"{block.file} line {line}: the test runs only hookscope commands, "
                                  f"not {command!r}: mark the block <!-- readme-test: skip REASON -->")
            actual, stderr = _run_cli(argv[1:])
            problem = outputs_match(shown, actual, stderr, block.rtol, block.atol)
            if problem is not None:
                raise ReadmeError(_mismatch(block.file, line, f"$ {command}", problem, shown, actual))


def _statements(block: Block) -> list[tuple[int, str, str]]:
    """Split a pycon block into (README line, source, shown output) per ``>>>`` statement."""
    found: list[tuple[int, list[str], list[str]]] = []
    for offset, line in enumerate(block.text().splitlines()):
        if line.startswith(">>>"):
            found.append((block.line + offset, [line[4:]], []))
        elif line.startswith("...") and found and not found[-1][2]:
            found[-1][1].append(line[4:])
        elif found:
            found[-1][2].append(line)
        elif line.strip():
            raise ReadmeError(f"{block.file} line {block.line + offset}: a pycon block starts "
                              "with '>>> '")
    return [(line, "\n".join(source), "\n".join(shown)) for line, source, shown in found]


def _commands(block: Block) -> list[tuple[int, str, str]]:
    """Split a console block into (README line, command, shown output) per ``$`` command."""
    found: list[tuple[int, str, list[str]]] = []
    continued = False
    for offset, line in enumerate(block.text().splitlines()):
        if continued:
            found[-1] = (found[-1][0], found[-1][1][:-1] + " " + line.strip(), [])
        elif line.startswith("$ "):
            found.append((block.line + offset, line[2:], []))
        elif found:
            found[-1][2].append(line)
        elif line.strip():
            raise ReadmeError(f"{block.file} line {block.line + offset}: a console block starts "
                              "with '$ '")
        continued = bool(found) and not found[-1][2] and found[-1][1].endswith("\\")
    return [(line, command, "\n".join(shown)) for line, command, shown in found]


class _Lines:
    """stdout and stderr of one command, as lines in the order they were written."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, bool]] = []  # (line, from stderr)
        self._partial = {False: "", True: ""}

    def stream(self, stderr: bool) -> io.TextIOBase:
        lines = self

        class _Stream(io.TextIOBase):
            def write(self, text: str) -> int:
                lines._write(text, stderr)
                return len(text)

        return _Stream()

    def _write(self, text: str, stderr: bool) -> None:
        *done, self._partial[stderr] = (self._partial[stderr] + text).split("\n")
        self.lines += [(line, stderr) for line in done]

    def close(self) -> None:
        self.lines += [(rest, stderr) for stderr, rest in self._partial.items() if rest]


def _run_cli(argv: list[str]) -> tuple[str, set[int]]:
    """Run ``hookscope argv`` here: (its stdout and stderr lines, indices of stderr's)."""
    from hookscope.cli.main import main

    lines = _Lines()
    with contextlib.redirect_stdout(lines.stream(False)), \
            contextlib.redirect_stderr(lines.stream(True)):
        try:
            main(argv)
        except SystemExit:  # argparse's usage errors
            pass
    lines.close()
    text = "".join(f"{line}\n" for line, _ in lines.lines)
    return text, {j for j, (_, stderr) in enumerate(lines.lines) if stderr}


def _exception_text(err: BaseException) -> str:
    kind = type(err)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    notes = "".join(f"{note}\n" for note in getattr(err, "__notes__", []))
    return f"{name}: {err}\n{notes}"


def _innermost_line(err: BaseException, filename: str) -> int | None:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == filename]
    return frames[-1].lineno if frames else None


def _mismatch(file: str, line: int, what: str, problem: str, shown: str, actual: str) -> str:
    return (f"{file} line {line}: the output of {what!r} differs from the page: {problem}\n"
            f"--- shown in {file}\n{shown}\n--- actual\n{actual}")
