"""The address of one recorded value, in one format, for every layer.

A record is addressed by a ``RecordKey``: the module ``path``, optionally a function-level ``op``
inside that module's forward, the ``call`` (0, 1, ... in call order) and the ``parts`` of a
structured output. Its one text form, used for file keys, messages and the CLI, is
``path[::op][:call][part]...``:

- ``fc1`` (a module that ran once), ``relu:2`` (call 2), ``lstm[1][0]`` (part ``[1][0]`` of the
  output), ``lstm:1[0]`` (part ``[0]`` of call 1);
- ``h.0.attn::softmax`` (``softmax`` called inside ``h.0.attn``'s forward), ``::relu:1`` (call 1
  of ``relu`` in the root module's own forward);
- ``(root)``, ``(root)[0]``: the root module's own output. A ``RecordKey`` spells the root's path
  ``""`` (as ``named_modules()`` does); its text form writes ``(root)`` where the path would be
  empty, and ``parse`` reads ``(root)`` back as path ``""``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from hookscope.errors import HookscopeError

__all__ = ["ROOT", "Part", "RecordKey", "record_name"]

ROOT = "(root)"  # the pattern, and the record name, of the model itself
Part = int | str

_KEY = re.compile(r"(?P<path>[^:\[\]]*)(?:::(?P<op>[^:\[\]]+))?(?P<early>(?:\[[^\]]*\])*)"
                  r"(?::(?P<call>\d+))?(?P<parts>(?:\[[^\]]*\])*)")
_PART = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True, init=False)
class RecordKey:
    """The address of one recorded value; ``str(key)`` is its text form (module docstring).

    Attributes:
        path: module path as in ``named_modules()`` (``""`` is the root module).
        call: call index, or None for "the one call" (a record with a single call).
        parts: keys into a structured output, e.g. ``(1, 0)`` for ``lstm[1][0]``.
        op: name of a function called inside the module's forward (``"softmax"``), or None for
            the module's own output.
    """

    path: str
    call: int | None = None
    parts: tuple[Part, ...] = ()
    op: str | None = None

    def __init__(self, path: str, call: int | None = None, parts: tuple[Part, ...] = (),
                 op: str | None = None):
        # one dict update instead of a frozen dataclass's object.__setattr__ per field
        self.__dict__.update(path=path, call=call, parts=parts, op=op)

    def __str__(self) -> str:
        call = "" if self.call is None else f":{self.call}"
        return self.name_of(self.path, self.op) + call + _brackets(self.parts)

    @property
    def name(self) -> str:
        """The record name: the text form without the call (``lstm[1][0]``, ``h.0::softmax``)."""
        return record_name(self.path, self.op, self.parts)

    @staticmethod
    def name_of(path: str, op: str | None) -> str:
        """``"fc1"``, ``"h.0::softmax"``, ``"::relu"``; ``"(root)"`` for the root's output."""
        return (path or ROOT) if op is None else f"{path}::{op}"

    @classmethod
    def parse(cls, text: str) -> RecordKey:
        """Read the text form back (also the older ``name[parts]:call[parts]`` order);
        ``"(root)"`` (with a call or parts after it) is the root's output, path ``""``.

        Raises:
            HookscopeError: ``text`` is not a record key (empty, a stray ``:`` or bracket).
        """
        match = _KEY.fullmatch(text)
        if match is None or not (match["path"] or match["op"]):
            raise HookscopeError(f"{text!r} is not a record key: write path[:call][part]..., e.g. "
                                 f"'fc1', 'relu:2', 'lstm[1][0]', 'h.0.attn::softmax:1'")
        parts = tuple(_part(p) for p in _PART.findall(match["early"] + match["parts"]))
        call = None if match["call"] is None else int(match["call"])
        path = "" if match["path"] == ROOT and match["op"] is None else match["path"]
        return cls(path, call, parts, match["op"])


def record_name(path: str, op: str | None = None, parts: tuple[Part, ...] = ()) -> str:
    """``RecordKey(path, None, parts, op).name`` without building the key (a capture of every
    module names one record per module). ``record_name(path)`` is also how every message and
    table names a module: ``(root)`` for the root (path ``""``)."""
    name = (path or ROOT) if op is None else f"{path}::{op}"
    return name + _brackets(parts) if parts else name


def _part(text: str) -> Part:
    return int(text) if text.isdigit() else text


def _brackets(parts: Iterable[Part]) -> str:
    if not parts:  # most keys: no generator to run
        return ""
    return "".join(f"[{p}]" for p in parts)
