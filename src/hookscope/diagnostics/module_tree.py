"""The module tree of a model: every path, class and parameter count; with an example input, how
often each module ran and what it returned.

Containers with no ``forward`` of their own (``ModuleList``, ``ModuleDict``) are marked with the
pattern that selects their children (``_blocks.*``); modules that never ran in the example pass
are marked too, so the tree shows at a glance which names a hook can use. A module registered
under several names is listed once, with its other names in the note. Lazy modules
(``LazyLinear``...) whose parameters do not exist before the first forward show ``?`` for their
parameter counts until an example input materialises them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.engine import (
    FunctionCall,
    ModuleIndex,
    Observer,
    Target,
    check_flag,
    explain_no_hooks,
    functional_hint,
    index,
    is_container,
    preflight,
    select,
    standard_names,
    untouched,
)
from hookscope.errors import HookscopeError, SelectorError
from hookscope.util import iter_tensors

__all__ = ["OpRow", "TreeRow", "tree", "tree_of_call", "format_tree", "filter_rows", "describe_output",
           "format_count"]

_MAX_DESCRIPTION = 160  # characters of an output description before it is cut


@dataclass(frozen=True)
class OpRow:
    """The calls of one torch function that a module's own forward made (``tree(..., ops=True)``).

    Attributes:
        address: what selects these calls: ``"conv_stack::max_pool2d"``, ``"::relu"`` (the root).
        calls: how many calls, over all the module's calls.
        outputs: distinct output descriptions in call order, e.g. ``("2x16x5x5 float32",)``.
    """

    address: str
    calls: int
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class TreeRow:
    """One module of the tree.

    Attributes:
        path: qualified name as ``named_modules()`` gives it (wrappers stripped); ``""`` is the root.
        class_name: the module's class, e.g. ``"Conv2d"``.
        depth: 0 for the root, 1 for its children, ...
        params: parameters of the module and everything below it (shared ones counted once);
            ``None`` while some of them are lazy (``UninitializedParameter``: not yet known).
        own_params: parameters registered on the module itself; ``None`` while lazy.
        calls: how many times it ran in the example forward pass; ``None`` without an example.
        outputs: its distinct output signatures in call order, e.g. ``("1x32x112x112 float32",)``.
        container: ``True`` for a module with no ``forward`` (never called, hooks never fire).
        note: why a hook here would not fire and what to select instead, or ``""``.
        ops: with ``ops=True``, the torch function calls of its own forward (not its children's)
            that returned a tensor, one ``OpRow`` per function name, in order of first call.
    """

    path: str
    class_name: str
    depth: int
    params: int | None
    own_params: int | None
    calls: int | None = None
    outputs: tuple[str, ...] = ()
    container: bool = False
    note: str = ""
    ops: tuple[OpRow, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The row as plain JSON-ready values, keys in field order."""
        return dataclasses.asdict(self)


def tree(model: nn.Module, *args: Any, ops: bool = False, **kwargs: Any) -> list[TreeRow]:
    """List every module of ``model``; with example inputs, also calls and output shapes.

    Args:
        model: root module; ``DataParallel``/``DDP``/``torch.compile`` wrappers are looked
            through, and paths are those of the wrapped model.
        *args, **kwargs: an example input; when given, ``model(*args, **kwargs)`` runs once
            under ``torch.no_grad()`` in the model's current mode with a counting hook on every
            module (all removed on return, also when the forward raises); the model is then
            left as it was found (BatchNorm statistics, spectral norm's ``_u``/``_v``, train/eval
            flags, ``requires_grad``, ``.grad``, the RNG state: ``engine.run.untouched``).
        ops: with an example input, also list each module's own torch function calls
            (``TreeRow.ops``): what a ``path::function`` address can reach. The example pass
            is then slower (every call goes through a ``TorchFunctionMode``).

    Returns:
        One ``TreeRow`` per module in ``named_modules()`` order, the root first.

    Raises:
        HookscopeError: ``model`` cannot run module hooks (``diagnose.preflight``: TorchScript,
            an exported program's flattened module); or, with an example, a ``torch.compile``'d
            model ran code compiled before the hooks existed (the message gives the fix).
        Whatever the forward pass raises on a bad example input.
    """
    check_flag("ops", ops)
    preflight(model)
    if not (args or kwargs):
        names = index(model)
        standard = standard_names(names)
        return [_row(path, names, None, standard=standard) for path in names.modules]
    return tree_of_call(model, lambda: model(*args, **kwargs), ops=ops)


def tree_of_call(model: nn.Module, call: Callable[[], Any], *, ops: bool = False) -> list[TreeRow]:
    """As ``tree``, with the example pass given as a function, e.g. ``lambda: inputs.call(model)``.

    ``call()`` runs once under ``torch.no_grad()`` while every module of ``model`` has a
    counting hook; hooks are removed and the model is restored on return, also when ``call``
    raises.

    Raises:
        HookscopeError: as ``tree``; or ``model`` is a ``torch.compile``'d model whose compiled
            code predates the hooks, so no call could be counted (the message gives the fix).
    """
    preflight(model)
    names = index(model)
    # running the example materialises lazy modules, as a forward does
    ran, calls = _run_example(names.root, names.modules, call, ops)
    why = explain_no_hooks(model, {path for path, seen in ran.items() if seen})
    if why is not None and len(names.modules) > 1:
        raise HookscopeError(f"cannot count calls: {why}")
    standard = standard_names(names)
    return [_row(path, names, ran, calls.get(path), standard) for path in names.modules]


def filter_rows(rows: Sequence[TreeRow], model: nn.Module, pattern: str | None = None,
                depth: int | None = None) -> list[TreeRow]:
    """Keep the rows that ``pattern`` selects (``hookscope.select`` syntax) up to ``depth``.

    A pattern naming a container exactly keeps that row (the tree is where its note is read).

    Raises:
        SelectorError: ``pattern`` matches no module (the message lists close paths).
    """
    kept = list(rows)
    if pattern is not None:
        exact = {row.path for row in rows if row.path == pattern}
        try:
            chosen = set(select(model, pattern)) | exact
        except SelectorError:
            if not exact:
                raise
            chosen = exact
        kept = [row for row in kept if row.path in chosen]
    if depth is not None:
        kept = [row for row in kept if row.depth <= depth]
    return kept


def format_tree(rows: Sequence[TreeRow]) -> str:
    """Render rows as an aligned text table, one module a line, paths indented by depth
    (relative to the shallowest row shown).

    Columns: path, class, params (with children), own; then calls and output when the rows
    come from an example pass; then a note for containers and modules that never ran. Each
    row's ``ops`` follow it, one line each: ``address  xCALLS  outputs``.
    """
    with_calls = any(row.calls is not None for row in rows)
    header = ["path", "class", "params", "own"] + (["calls", "output"] if with_calls else [])
    top = min((row.depth for row in rows), default=0)
    table = [header] + [_cells(row, with_calls, row.depth - top) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    notes = [""] + [row.note for row in rows]
    lines = []
    for line, note, row in zip(table, notes, [None, *rows]):
        text = "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
        lines.append(f"{text}  # {note}" if note else text)
        indent = "  " * (row.depth - top + 1) if row is not None else ""
        lines += [f"{indent}{op.address}  x{op.calls}  {' | '.join(op.outputs)}"
                  for op in (row.ops if row is not None else ())]
    return "\n".join(lines) + "\n"


def describe_output(value: Any) -> str:
    """Say what a module returned: ``"1x32x112x112 float32"`` for a tensor, ``"(a, b)"`` for a
    tuple, ``"{key: a}"`` for a dict or ``ModelOutput``, the class name for anything else."""
    text = _describe(value)
    return text if len(text) <= _MAX_DESCRIPTION else text[:_MAX_DESCRIPTION - 1] + "…"


def format_count(n: int) -> str:
    """Compact count: ``864``, ``12.3K``, ``4.65M``, ``1.1B`` (three significant digits)."""
    if n < 1000:
        return str(n)
    for scale, suffix in ((1e3, "K"), (1e6, "M")):
        if n / scale < 999.5:
            return f"{n / scale:.3g}{suffix}"
    return f"{n / 1e9:.3g}B" if n / 1e9 < 999.5 else f"{n / 1e9:.0f}B"


# ------------------------------------------------------------------------------- internals
def _run_example(root: nn.Module, modules: dict[str, nn.Module], call: Callable[[], Any],
                 ops: bool) -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """Run the example once; return ``{path: [output description of each call]}`` and, with
    ``ops``, ``{path: {function name: [output description of each call]}}``."""
    ran: dict[str, list[str]] = {path: [] for path in modules}
    functions: dict[str, dict[str, list[str]]] = {}

    def recorder(target: Target) -> Any:
        descriptions = ran[target.path]

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            descriptions.append(describe_output(output))
        return hook

    targets = [Target(path, module) for path, module in modules.items() if not is_container(module)]
    session = Observer(root, targets, forward=recorder, explain_unfired=False)
    if ops:
        for path, module in modules.items():
            if not is_container(module):
                functions[path] = {}
                session.functions.watch(module, _op_recorder(functions[path]))
    with untouched(root), session, torch.no_grad():
        call()
    return ran, functions


def _op_recorder(calls: dict[str, list[str]]) -> Callable[[FunctionCall], None]:
    def on_call(call: FunctionCall) -> None:
        if next(iter_tensors(call.output), None) is not None:
            calls.setdefault(call.name, []).append(describe_output(call.output))
    return on_call


def _row(path: str, names: ModuleIndex, ran: dict[str, list[str]] | None,
         functions: dict[str, list[str]] | None = None,
         standard: dict[str, list[str]] | None = None) -> TreeRow:
    module = names.modules[path]
    container = is_container(module) and path != ""
    calls = None if ran is None or container else len(ran[path])
    outputs = tuple(dict.fromkeys(ran[path])) if ran is not None and not container else ()
    notes = [_container_note(path, names.modules) if container else (
        _never_ran_note(path, module, ran) if ran is not None and calls == 0 else "")]
    if path in names.aliases:
        notes.append(f"also named {', '.join(names.aliases[path])} (one module)")
    if standard and path in standard:
        notes.append(f"standard name: {', '.join(standard[path])}")
    if _count(module.parameters(recurse=False)) is None:
        notes.append("lazy: parameters are created by the first forward; give an input to see them")
    return TreeRow(path=path, class_name=type(module).__name__,
                   depth=0 if path == "" else path.count(".") + 1,
                   params=_count(module.parameters()),
                   own_params=_count(module.parameters(recurse=False)),
                   calls=calls, outputs=outputs, container=container,
                   note="; ".join(n for n in notes if n),
                   ops=tuple(OpRow(f"{path}::{name}", len(described), tuple(dict.fromkeys(described)))
                             for name, described in (functions or {}).items()))


def _count(parameters: Iterator[nn.Parameter]) -> int | None:
    """Number of parameter elements, or None when one is lazy (its shape is not known yet)."""
    total = 0
    for p in parameters:
        if isinstance(p, nn.parameter.UninitializedParameter):
            return None
        total += p.numel()
    return total


def _container_note(path: str, modules: dict[str, nn.Module]) -> str:
    prefix = path + "."
    children = [p for p in modules if p.startswith(prefix) and "." not in p[len(prefix):]]
    plural = "s" if len(children) != 1 else ""
    return (f"container, no forward: select '{path}.*' ({len(children)} module{plural})"
            if children else "container, no forward and no children: nothing to hook")


def _never_ran_note(path: str, module: nn.Module, ran: dict[str, list[str]]) -> str:
    parent = path.rpartition(".")[0]
    if ran.get(parent):
        who = f"'{parent}'" if parent else "the model's forward"
        address = functional_hint(parent, module)
        functional = f"F.{address.split('::')[1][:-1]}: address it as {address}" if address else (
            "a functional call such as F.relu")
        return f"never ran: {who} ran without calling it ({functional}, or a branch not taken)"
    return "never ran, nor did its parent: this input takes a branch that does not reach it"


def _cells(row: TreeRow, with_calls: bool, indent: int) -> list[str]:
    name = "  " * indent + (row.path or "(root)")
    cells = [name, row.class_name, _param_cell(row.params), _param_cell(row.own_params)]
    if with_calls:
        calls = "-" if row.calls is None else str(row.calls)
        cells += [calls, " | ".join(row.outputs) or "-"]
    return cells


def _param_cell(n: int | None) -> str:
    return "?" if n is None else format_count(n)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(n) for n in value.shape) or "scalar"
        return f"{shape} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value)
        return f"({inner},)" if isinstance(value, tuple) and len(value) == 1 else (
            f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in fields.items()) + "}"
    return "None" if value is None else type(value).__name__
