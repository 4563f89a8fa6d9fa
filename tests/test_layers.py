"""The layers: each file's layer is read from its path, imports run one way, no file reaches
into another package's private names, and only the door (``engine/door/``) calls torch's hook API."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hookscope"
FILES = sorted(p for p in SRC.rglob("*.py"))
#: the order of the layers: a file may import its own package and lower ranks only
RANK = {"errors": -1, "util": 0, "engine": 1, "record": 2, "editing": 3, "diagnostics": 3,
        "store": 3, "zoo": 4, "train": 4, "circuits": 4, "cli": 5, "hookscope": 6}
#: torch's hook registration, for modules, tensors, autograd nodes and the global tables
TORCH_HOOK_API = {
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook", "register_hook", "register_prehook",
    "register_module_forward_hook", "register_module_forward_pre_hook",
    "register_module_full_backward_hook", "register_module_full_backward_pre_hook",
    "register_module_backward_hook", "register_multi_grad_hook", "register_step_pre_hook",
    "register_step_post_hook", "queue_callback",
}
DOOR = {SRC / "engine" / "door" / f"{name}.py" for name in ("hooks", "sharing", "tables")}


def layer(path: Path) -> str:
    """``engine`` for ``src/hookscope/engine/naming/selection.py``; ``errors``; ``hookscope`` for the
    package's own ``__init__``/``__main__``."""
    parts = path.relative_to(SRC).parts
    if len(parts) > 1:
        return parts[0]
    return "errors" if parts[0] == "errors.py" else "hookscope"


def imports(source: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for each hookscope import, at top level or inside a function, however
    spelled: ``import``, ``from ... import``, ``importlib.import_module("...")`` and
    ``__import__("...")`` (an f-string counts by its constant start: ``f"hookscope.cli.{n}"``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hookscope"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("hookscope")]
        elif isinstance(node, ast.Call) and _call_name(node.func) in ("import_module", "__import__"):
            module = _leading_text(node.args[0]) if node.args else ""
            if module.startswith("hookscope"):  # a computed rest: some module below that start
                found.append((module + "*" if module.endswith(".") else module, []))
    return found


def _call_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _leading_text(arg: ast.expr) -> str:
    """The constant start of a string argument: all of ``"a.b"``, ``"a.b."`` of ``f"a.b.{n}"``."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    return ""


def module_all(path: Path) -> list[str] | None:
    """The names of ``path``'s ``__all__`` (read, not imported), or None when it has none."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [element.value for element in node.value.elts]  # type: ignore[attr-defined]
    return None


#: each package's face: the names its ``__init__`` offers the other packages
FACES = {p.parent.name: set(module_all(p) or ()) for p in SRC.glob("*/__init__.py")}


def violations(path: Path, source: str) -> list[str]:
    """What ``source`` (the text of ``path``) imports against the layer rules."""
    own = layer(path)
    found = []
    for module, names in imports(source):
        parts = module.split(".")
        if len(parts) == 1:  # from hookscope import x: the public API, only for the top layers
            if RANK[own] < RANK["zoo"]:
                found.append(f"{module} imports the public API from inside the library")
            continue
        other = parts[1] if parts[1] in RANK else "errors"
        if other != own and other in FACES:
            found += _past_the_face(own, other, parts, names)
        if other != own and RANK[other] >= RANK[own]:
            found.append(f"{own} imports {module} (layer {other})")
        if other != own and any(p.startswith("_") for p in parts[2:]):
            found.append(f"{own} imports private module {module}")
        if other != own and any(n.startswith("_") for n in names):
            found.append(f"{own} imports private names {names} of {module}")
    return found


def _past_the_face(own: str, other: str, parts: list[str], names: list[str]) -> list[str]:
    """An import by ``own`` of ``hookscope.<other>...`` that does not go through ``other``'s face:
    an inner module (``hookscope.engine.naming.selection``), or a name its ``__all__`` does not offer (a
    module: ``from hookscope.engine import diagnose``)."""
    module = ".".join(parts)
    if len(parts) > 2:
        return [f"{own} imports {module}, an inner module of {other}: import from hookscope.{other}"]
    return [f"{own} imports {name} from {module}, which its face (__all__) does not offer"
            for name in names if name not in FACES[other]]


def hook_api_calls(source: str) -> list[int]:
    """Lines of ``source`` that call one of torch's hook registrations."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in TORCH_HOOK_API]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_run_one_way(path: Path) -> None:
    assert violations(path, path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", [p for p in FILES if p not in DOOR], ids=lambda p: str(p.relative_to(SRC)))
def test_only_the_door_calls_torchs_hook_api(path: Path) -> None:
    assert hook_api_calls(path.read_text(encoding="utf-8")) == []


def test_the_checks_can_fail() -> None:
    engine = SRC / "engine" / "naming" / "selection.py"
    assert violations(engine, "from hookscope.record import capture") == [
        "engine imports hookscope.record (layer record)"]
    assert violations(SRC / "store" / "x.py", "from hookscope.editing import edit") == [
        "store imports hookscope.editing (layer editing)"]
    assert violations(SRC / "cli" / "x.py", "from hookscope.engine import _witness") == [
        "cli imports _witness from hookscope.engine, which its face (__all__) does not offer",
        "cli imports private names ['_witness'] of hookscope.engine"]
    assert violations(engine, "def f():\n    import hookscope.zoo") == [
        "engine imports hookscope.zoo (layer zoo)"]
    assert hook_api_calls("def f(m):\n    m.register_forward_hook(print)") == [2]
    assert layer(SRC / "store" / "new_file.py") == "store" and layer(SRC / "errors.py") == "errors"


def test_the_face_check_sees_every_import_past_a_face() -> None:
    """Issue 34 item 3: another package's inner module, however imported, and a name (or a
    module) that the package's ``__all__`` does not offer."""
    record = SRC / "record" / "x.py"
    inner = "record imports hookscope.engine.{}, an inner module of engine: import from hookscope.engine"
    assert violations(record, "from hookscope.engine.naming.selection import select") == [
        inner.format("naming.selection")]
    assert violations(record, "import hookscope.engine.door.hooks as h") == [inner.format("door.hooks")]
    assert violations(record, "import importlib\n"
                              "importlib.import_module('hookscope.engine.naming.names')") == [
        inner.format("naming.names")]
    assert violations(record, "def f():\n    return __import__('hookscope.engine.values.kinds')") == [
        inner.format("values.kinds")]
    assert violations(SRC / "cli" / "x.py", "import_module(f'hookscope.zoo.{name}')") == [
        "cli imports hookscope.zoo.*, an inner module of zoo: import from hookscope.zoo"]
    assert violations(record, "from hookscope.engine import diagnose, select") == [
        "record imports diagnose from hookscope.engine, which its face (__all__) does not offer"]
    # a package's own modules, and the faces, pass
    assert violations(SRC / "cli" / "main.py", "import_module(f'hookscope.cli.{name}')") == []
    assert violations(record, "from hookscope.engine import HookSession\nfrom hookscope.util import "
                              "map_tensors\nfrom hookscope.record.records import Records") == []


@pytest.mark.parametrize("path", [p for p in FILES if p.name != "__main__.py"],
                         ids=lambda p: str(p.relative_to(SRC)))
def test_every_module_says_what_it_offers(path: Path) -> None:
    """Each module declares ``__all__`` (ruff's F822 holds each name to a definition); each
    package's face offers only names that one of its modules offers."""
    offered = module_all(path)
    assert offered is not None and len(offered) == len(set(offered))
    if path.name != "__init__.py":
        return
    # a face's name is never one of its modules too (hookscope.record.capture was the function
    # and, in sys.modules, the module; griffe documented the module in the function's place)
    if path.parent != SRC:
        assert {p.stem for p in path.parent.glob("*.py")} & set(offered) == set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hookscope."):
            home = SRC.joinpath(*node.module.split(".")[1:])
            home = home / "__init__.py" if home.is_dir() else home.with_suffix(".py")
            assert {a.name for a in node.names} <= set(module_all(home) or ()), node.module
            assert {a.name for a in node.names} <= set(offered)


def test_every_package_has_a_layer() -> None:
    packages = {p.relative_to(SRC).parts[0] for p in FILES if p.parent != SRC}
    assert packages <= set(RANK) and {"engine", "record", "store", "zoo", "cli"} <= packages


def test_import_hookscope_loads_no_model_spec_or_picture_machinery() -> None:
    code = ("import sys, hookscope; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('hookscope', 'transformers', 'matplotlib', 'PIL')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(SRC.parent)}).stdout
    assert "'hookscope'" in loaded and "'hookscope.record.captures'" in loaded
    for heavy in ("hookscope.zoo", "hookscope.zoo.models", "hookscope.zoo.inputs", "hookscope.zoo.viz",
                  "transformers", "matplotlib", "PIL"):
        assert f"'{heavy}'" not in loaded


def test_every_module_has_one_path() -> None:
    """No aliases (issue 34): hookscope has no earlier release to stay compatible with, and a
    module reachable under two names is two places to look."""
    code = ("import importlib, sys, hookscope\n"
            "for old in ('models', 'inputs', 'tree', 'positions', 'stats', 'capture'):\n"
            "    try:\n"
            "        module = importlib.import_module('hookscope.' + old)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    print(old, module.__name__)\n"
            "print(sorted(k for k, m in sys.modules.items() if k.startswith('hookscope') "
            "and getattr(m, '__name__', k) != k))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC.parent)}).stdout.split("\n")
    assert out[:-1] == ["[]"]


# ------------------------------------------------------------------ every way into torch's hooks
#: each way into torch's hook machinery (or the interpreter's, which hookscope needs for the same
#: guarantees) -> the files that may use it. A use is found however it is spelled: an attribute
#: (``m.register_forward_hook``), an imported name (``from signal import signal``) or a string
#: (``getattr(m, "register_forward_hook")``, ``importlib.import_module("copyreg")``).
_HOOK_DOOR = {str(p.relative_to(SRC)) for p in DOOR}
_TABLES_READ = _HOOK_DOOR  # hooks() lists them and remove_hooks clears them through the door
WAYS_IN: dict[str, set[str]] = {
    **{name: _HOOK_DOOR for name in TORCH_HOOK_API | {"register_post_accumulate_grad_hook"}},
    **{table: _TABLES_READ for table in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
        "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs", "_is_full_backward_hook", "_global_is_full_backward_hook")},
    # a function mode is made only in engine.function_mode (the watcher's) and engine.mode_stack
    # (find_nonfinite's each_call), and entered only through them
    "TorchFunctionMode": {"engine/function_mode.py", "engine/mode_stack.py"},
    "TorchDispatchMode": set(),
    # SIGINT: the engine's stand-in, extract's graceful stop and the CLI's exit at an interrupt
    "signal": {"engine/interrupts.py"},
    "copyreg": {"engine/door/copies.py"},
    # the ownership check (not a checkpoint recompute) is the door's: capture's hot path had a
    # copy of OwnedHook's checks; it is the door's RecordingHook now
    "_current_graph_task_id": _HOOK_DOOR,
    "settrace": set(), "setprofile": set(),
    # process-wide changes to dynamo: code compiled from now on checks the hook tables, code
    # compiled before (without the checks) is dropped once (engine.compile.graph.prepare)
    "skip_nnmodule_hook_guards": {"engine/compile/graph.py"}, "reset_code": {"engine/compile/graph.py"},
}


def ways_in(source: str) -> dict[str, list[int]]:
    """``{way: [lines]}`` of each way in ``WAYS_IN`` that ``source`` uses, however spelled."""
    found: dict[str, set[int]] = {}
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0], *(a.name for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        for name in names:
            if name in WAYS_IN:
                found.setdefault(name, set()).add(getattr(node, "lineno", 0))
    return {way: sorted(lines) for way, lines in found.items()}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_every_way_into_the_hook_machinery_goes_through_its_door(path: Path) -> None:
    where = str(path.relative_to(SRC))
    used = ways_in(path.read_text(encoding="utf-8"))
    assert {way: lines for way, lines in used.items() if where not in WAYS_IN[way]} == {}


def test_the_door_test_sees_every_spelling() -> None:
    assert ways_in("m._forward_hooks[1] = f") == {"_forward_hooks": [1]}
    assert ways_in("getattr(m, 'register_forward_hook')(f)") == {"register_forward_hook": [1]}
    assert ways_in("from signal import signal as s") == {"signal": [1]}
    assert ways_in("import importlib\nimportlib.import_module('copyreg')") == {"copyreg": [2]}
    assert ways_in("import sys\nsys.settrace(None)") == {"settrace": [2]}
    assert ways_in("t.register_post_accumulate_grad_hook(f)") == {
        "register_post_accumulate_grad_hook": [1]}
    assert ways_in("class M(TorchDispatchMode): pass") == {"TorchDispatchMode": [1]}


# ------------------------------------------------------------------ the door's floor
def _imported_files(path: Path) -> set[Path]:
    """The hookscope files ``path`` imports directly: ``from pkg import module`` that module,
    ``from pkg import name`` the package's face (``__init__``). (Python runs the package's
    ``__init__`` first in both cases; a floor is what a module's own code needs.)"""
    found = set()
    for module, names in imports(path.read_text(encoding="utf-8")):
        base = SRC.parent.joinpath(*module.split("."))
        modules = [base / f"{name}.py" for name in names if (base / f"{name}.py").exists()]
        if len(modules) < len(names) or not names:  # a face's names, or the module itself
            modules.append(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))
        found |= {m for m in modules if m.exists()}
    return found


def floor_of(path: Path) -> set[str]:
    """Every hookscope file ``path`` stands on: what it imports, what those import, ... (itself
    left out), as paths relative to ``src/hookscope``."""
    seen: set[Path] = set()
    todo = [path]
    while todo:
        for found in _imported_files(todo.pop()) - seen:
            seen.add(found)
            todo.append(found)
    return {str(p.relative_to(SRC)) for p in seen - {path}}


#: the ground floor: the door and the engine modules it owns stand only on these
GROUND = {*_HOOK_DOOR, "engine/compile/graph.py", "engine/compile/spec.py",
          "engine/compile/function_calls.py", "engine/mode_stack.py", "engine/naming/function_names.py",
          "engine/interrupts.py", "errors.py"}  # interrupts: stdlib only (never_skipped exits)


@pytest.mark.parametrize("where", sorted({f for files in WAYS_IN.values() for f in files}))
def test_every_door_stands_on_the_ground_floor(where: str) -> None:
    """Issue 34 item 2: the door imported diagnose -> select -> names ..., floor 6 of the
    engine's 8 (and function_mode, a door for function modes, stood on diagnose too): a way into
    torch's hook machinery must not depend on the selection language or the sessions above it."""
    assert floor_of(SRC / where) <= GROUND
    assert floor_of(SRC / "engine" / "door" / "hooks.py") == {
        "engine/compile/graph.py", "engine/compile/spec.py", "errors.py"}


def test_the_floor_is_read_through_every_import() -> None:
    select = floor_of(SRC / "engine" / "naming" / "selection.py")
    assert {"engine/naming/names.py", "engine/naming/wrappers.py", "engine/checks.py", "errors.py"} <= select
    # the standard names' checks against a probe forward register with the resolver
    # (engine.naming.residual_check): the selection language stands on no hook code
    assert "engine/door/hooks.py" not in select and "engine/ground_truth.py" not in select
    assert "engine/naming/selection.py" not in floor_of(SRC / "engine" / "door" / "hooks.py")
