"""Why a hook cannot fire or did not fire, and where a forward pass broke.

Three moments, three functions:

- ``preflight(model)`` and ``check_targets(names, targets)``, before any hook exists: refuse
  models and modules whose hooks cannot work.
- ``explain_unfired(names, targets, ran)``, after the forward: for each selected module whose
  hook never fired, the likely cause and the fix. ``ran`` holds the paths of selected modules
  and of their *witnesses* (parents, siblings and children, see ``witnesses``) that ran.
- ``locate_error(names, exc)``, when the forward raised: a note on the exception naming the
  innermost module that was running (path, class, input shapes), found from the traceback.

``names`` is the model's ``ModuleIndex`` (``hookscope.names.index``): a session builds it once
and hands the same one to every function here.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Collection, Sequence
from types import FrameType

import torch
from torch import nn

from hookscope.engine.function_names import functional_counterpart, functional_hint
from hookscope.engine.names import ModuleIndex
from hookscope.engine.record_key import record_name
from hookscope.engine.selection import Target
from hookscope.engine.wrappers import wrapped_attribute
from hookscope.errors import FusedModuleWarning, HookscopeError

__all__ = ["preflight", "check_targets", "witnesses", "explain_unfired", "explain_no_hooks", "locate_error",
           "fullgraph", "bypassed", "COMPILED"]

COMPILED = "<torch.compile wrapper>"  # witness key of an OptimizedModule around the model


def preflight(model: nn.Module) -> None:
    """Raise before anything is resolved or registered when ``model`` cannot run Python hooks.

    Raises:
        HookscopeError: ``model`` is TorchScript (``torch.jit.script``/``trace``/``load``), or
            the flattened module of a ``torch.export`` program (``ep.module()``).
    """
    _refuse_script("", model)
    _refuse_flat_export(model)


def _refuse_flat_export(model: nn.Module) -> None:
    # ep.module()'s class has no public name (torch 2.1-2.13: torch.export._unlift); until
    # that module is loaded no model can be one
    unlift = sys.modules.get("torch.export._unlift")
    if not isinstance(model, getattr(unlift, "_StatefulGraphModule", ())):
        return
    raise HookscopeError(
        "cannot hook the model: it is an exported program's flattened module "
        "(torch.export.export(...).module()). Export inlined every submodule's forward into one "
        "graph of aten ops, so its submodule names only hold parameters: those modules are never "
        "called and their hooks never fire. Hook the module tree that "
        "torch.export.unflatten(ep) rebuilds (same names, same values), or the eager model")


def check_targets(names: ModuleIndex, targets: Sequence[Target]) -> None:
    """Raise before registering when a selected module's hook could not fire; warn when its
    output is not what its name says.

    Raises:
        HookscopeError: a selected module is TorchScript.

    Warns:
        FusedModuleWarning: a selected ``nn.Identity`` is a placeholder that
            ``torch.ao.quantization.fuse_modules`` left where a fused module (``bn``, ``relu``)
            was: it returns its input, the fused module's output (shared/cases/32).
    """
    modules = names.modules
    for target in targets:  # the cheap type tests inline: one pass per capture, 200+ targets
        if isinstance(target.module, torch.jit.ScriptModule):
            _refuse_script(target.path, target.module)
        fused = _fused_into(target.path, modules) if type(target.module) is nn.Identity else None
        if fused is not None:
            warnings.warn(
                f"'{target.path}' is an nn.Identity left by fuse_modules: '{fused}' "
                f"({type(modules[fused]).__name__}) now computes it, so '{target.path}' returns "
                f"its input unchanged, the fused module's output. Select '{fused}' for the fused "
                f"result, or capture the float model before fusion for '{target.path}' alone",
                FusedModuleWarning, stacklevel=4)


def _fused_into(path: str, modules: dict[str, nn.Module]) -> str | None:
    """The sibling fused module (``torch.ao.nn.intrinsic``) that an ``Identity`` stands in for."""
    if type(modules[path]) is not nn.Identity:
        return None
    parent, _, _ = path.rpartition(".")
    siblings = [p for p in modules if p and p.rpartition(".")[0] == parent and p != path]
    before = [p for p in siblings if list(modules).index(p) < list(modules).index(path)]
    fused = [p for p in before if type(modules[p]).__module__.startswith("torch.ao.nn.intrinsic")]
    return fused[-1] if fused else None


def _refuse_script(path: str, module: nn.Module) -> None:
    if isinstance(module, torch.jit.ScriptModule):
        where = f"'{path}'" if path else "the model"
        raise HookscopeError(
            f"cannot hook TorchScript module {where} ({module.original_name}): TorchScript "
            f"runs compiled code that never calls Python hooks. Load or build the eager "
            f"nn.Module instead (the Python class with its state_dict).")


def witnesses(model: nn.Module, names: ModuleIndex, targets: Sequence[Target]) -> dict[str, nn.Module]:
    """Modules around the selected ones whose running tells why a selected one did not:
    each selected module's parent, the parent's other children, and its own children.

    Args:
        model: the root module as given (its ``torch.compile`` wrapper, if any, is a witness).
        names: ``index(model)``.
        targets: the selected targets.

    Returns:
        ``{path: module}`` of modules that are not themselves selected (root is ``""``), and
        for a ``torch.compile``'d model its wrapper under the key ``COMPILED``.
    """
    modules = names.modules
    selected = {t.path for t in targets}
    parents = {path.rpartition(".")[0] for path in selected}
    found = {p: modules[p] for p in parents if p not in selected and p in modules}
    around = parents | selected
    for path, module in modules.items():  # one pass, no child index (a capture's set-up)
        if path and path not in selected and path.rpartition(".")[0] in around:
            found[path] = module
    wrapper = compile_wrapper(model)
    if wrapper is not None:
        found[COMPILED] = wrapper
    return found


def compile_wrapper(model: nn.Module) -> nn.Module | None:
    """The ``torch.compile`` wrapper (``OptimizedModule``) around the model, if any. Its own
    hooks run on every call, outside the compiled code, even when those inside do not."""
    while (attribute := wrapped_attribute(model)) is not None:
        if attribute == "_orig_mod":
            return model
        model = model._modules[attribute]  # type: ignore[assignment]
    return None


def fullgraph(model: nn.Module) -> bool:
    """True when ``model`` is (or wraps) a ``torch.compile(..., fullgraph=True)`` wrapper."""
    wrapper = compile_wrapper(model)
    context = getattr(wrapper, "dynamo_ctx", None)
    return bool(getattr(context, "fullgraph", False))


def explain_unfired(names: ModuleIndex, targets: Sequence[Target], ran: set[str]) -> dict[str, str]:
    """Return ``{record key: reason}`` for ``targets`` (selected modules that recorded nothing).

    Args:
        names: the captured model's ``ModuleIndex``.
        targets: the selected targets that never ran.
        ran: paths of every hooked module (selected or witness) that ran.
    """
    if not targets:
        return {}
    modules = names.modules
    children = _child_index(modules)
    return {t.key: _reason(t.path, modules, children, ran) for t in targets}


def bypassed(names: ModuleIndex, targets: Sequence[Target], ran: set[str]) -> dict[str, str]:
    """``{record key: reason}`` of the silent ``targets`` whose module's code ran although its
    hooks did not: compiled code built before the hooks (the compiled model ran, no hook
    inside it did), or a parent that calls ``module.forward(...)`` directly (a child of the
    module ran). Not a branch the input did not take: such a module is simply not called.

    Args:
        names: the model's ``ModuleIndex``.
        targets: selected targets (module addresses) that never ran.
        ran: paths of every hooked module (selected or witness) that ran.
    """
    modules = names.modules
    children = _child_index(modules)
    found = {}
    for target in targets:
        why = _compiled_reason(target.path, type(modules[target.path]).__name__, ran)
        if why is None and any(child in ran for child in children.get(target.path, ())):
            why = _reason(target.path, modules, children, ran)
        if why is not None:
            found[target.key] = why
    return found


_LISTED = 10  # names a warning lists with their reasons (an error lists all)


def unfired_message(unfired: dict[str, str], wide: Collection[str], consequence: str, *,
                    detailed: bool) -> str:
    """The report on selected modules that never ran: a line with the reason for each name
    the user typed; the silent members of a glob (``wide``: ``"**"``, ``"h.*"``, ``type:``;
    the session passes none when no glob member ran at all) summarised in one line
    (``detailed``: listed with their reasons too, for an error), so a "capture everything"
    call on GPT-2 does not warn about each dropout SDPA never runs. A warning lists at most
    ``_LISTED`` names with their reasons (a block that ran no forward at all makes every
    selected module silent) and counts the rest."""
    typed = {k: why for k, why in unfired.items() if k not in wide or detailed}
    globbed = [k for k in unfired if k not in typed]
    parts = []
    if typed:
        shown_typed = list(typed.items()) if detailed else list(typed.items())[:_LISTED]
        lines = "\n".join(f"  - {key}: {why}" for key, why in shown_typed)
        n = len(typed)
        if n > len(shown_typed):  # a warning stays readable: the rest are in .unfired
            lines += f"\n  - … {n - len(shown_typed)} more (the reason of each is in .unfired)"
        parts.append(f"{n} selected module{'s' if n > 1 else ''} never ran, so no hook fired and "
                     f"{consequence}:\n{lines}")
    if globbed:
        shown = ", ".join(globbed[:4]) + (f", … {len(globbed) - 4} more" if len(globbed) > 4 else "")
        parts.append(f"{len(globbed)} module{'s' if len(globbed) > 1 else ''} that a pattern "
                     f"matched never ran ({shown}); {consequence} there (the reason of each is in "
                     f".unfired)")
    return "\n".join(parts)


def _reason(path: str, modules: dict[str, nn.Module], children: dict[str, list[str]],
            ran: set[str]) -> str:
    module = modules[path]
    kind = type(module).__name__
    parent = path.rpartition(".")[0]
    parent_name = f"'{parent}'" if parent else "the model's forward"
    special = (_compiled_reason(path, kind, ran) or _out_proj_reason(path, modules, ran)
               or _fast_path_reason(path, kind, modules, ran) or _unused_child_reason(path, modules, ran))
    if special:
        return special
    if not ran:
        return (f"{path} ({kind}) was hooked but no forward pass ran inside the with block: "
                f"call the model inside it ('with hookscope.capture(...): model(x)')")
    ran_children = [c for c in children.get(path, ()) if c in ran]
    if ran_children:
        return (f"{path} ({kind}) never ran through its hooks although its child "
                f"{ran_children[0]} ran: its parent probably calls {path.rsplit('.', 1)[-1]}"
                f".forward(...) directly, which bypasses hooks. Call the module itself "
                f"(module(x)), or capture its children ('{path}.*')")
    if parent in ran:
        siblings = [c for c in children.get(parent, ()) if c in ran and c != path]
        seen = f" (modules that did run there: {', '.join(siblings[:6])})" if siblings else ""
        address = functional_hint(parent, module)
        reach = (f"the address {address} reaches that value (every such call of the parent's "
                 f"own forward, in order; 'hookscope tree MODEL --input X --ops' lists them)"
                 if address else f"capture a module next to it that runs"
                 f"{' (' + siblings[0] + ')' if siblings else ''} or the parent")
        return (f"{path} ({kind}) was registered but never called: {parent_name} ran without "
                f"calling it{seen}. Either the parent applies the functional form instead "
                f"(torch.nn.functional, e.g. F.relu), which module hooks cannot see: {reach}; "
                f"or this input takes a branch that does not use it")
    return (f"{path} ({kind}) never ran, and neither did its parent {parent_name}: this input "
            f"takes a branch of the model that does not reach it")


_COMPILED_WHY = ("its compiled code was built before these hooks existed and does not check for "
                 "new ones. Call torch._dynamo.reset() first (the next call recompiles with the "
                 "hooks), register hooks before the first call of the compiled model, or use the "
                 "eager model (model._orig_mod)")


def _compiled_reason(path: str, kind: str, ran: set[str]) -> str | None:
    """pytorch/pytorch#117758: the compiled model ran, but none of the hooks inside it did
    (the root's own hooks may: dynamo runs some roots' ``__call__`` outside the compiled code)."""
    if COMPILED not in ran or ran - {COMPILED, ""}:
        return None
    return (f"{path} ({kind}) never ran through its hooks although the torch.compile'd model was "
            f"called: {_COMPILED_WHY}")


def explain_no_hooks(model: nn.Module, ran: Collection[str] = ()) -> str | None:
    """Why ``model`` ran without firing any hook inside it, when the cause is known: a
    ``torch.compile`` wrapper whose code was compiled earlier (pytorch/pytorch#117758); else None.

    Args:
        model: the model as called (its ``torch.compile`` wrapper included).
        ran: paths of the hooked modules that did run; None is known when any but the root
            (``""``) did, whose hooks dynamo may run outside the compiled code.
    """
    if compile_wrapper(model) is None or set(ran) - {""}:
        return None
    return f"the torch.compile'd model ran but none of its modules' hooks fired: {_COMPILED_WHY}"


def _fast_path_reason(path: str, kind: str, modules: dict[str, nn.Module],
                      ran: set[str]) -> str | None:
    """pytorch/pytorch#128413: a TransformerEncoderLayer that ran its fused kernel skips its children."""
    ancestors = [path.rsplit(".", n)[0] for n in range(1, path.count(".") + 1)] + [""]
    layer = next((a for a in ancestors if isinstance(modules[a], nn.TransformerEncoderLayer)), None)
    if layer is None or layer not in ran:
        return None
    where = f"'{layer}'" if layer else "the model"
    return (f"{path} ({kind}) was skipped: {where} (TransformerEncoderLayer) ran its fused fast "
            f"path (eval mode without grad), one native kernel that never calls its submodules. "
            f"Turn the fast path off for the run with torch.backends.mha.set_fastpath_enabled("
            f"False) (and back on afterwards), or run with gradients enabled")


def _out_proj_reason(path: str, modules: dict[str, nn.Module], ran: set[str]) -> str | None:
    """MultiheadAttention reads out_proj's weights inside F.multi_head_attention_forward."""
    parent, _, name = path.rpartition(".")
    if name != "out_proj" or not isinstance(modules.get(parent), nn.MultiheadAttention):
        return None
    if parent not in ran:
        return None
    return (f"{path} is never called: MultiheadAttention '{parent}' passes out_proj.weight and "
            f".bias to F.multi_head_attention_forward instead of calling the module. Capture "
            f"'{parent}[0]' (the attention output, after out_proj) instead")


def _unused_child_reason(path: str, modules: dict[str, nn.Module], ran: set[str]) -> str | None:
    """The parent ran, and no method of its class names the child's attribute: the module holds
    a child its code never uses (``nn.SyncBatchNorm.convert_sync_batchnorm`` rebuilds a
    norm+activation subclass as a bare ``SyncBatchNorm`` and keeps its ``act``,
    pytorch/pytorch#187298). Read from the class's code objects; nothing is run."""
    parent, _, name = path.rpartition(".")
    owner = modules.get(parent)
    if (owner is None or parent not in ran or not name.isidentifier()
            or getattr(owner, name, None) is not modules[path]):
        return None
    cls = type(owner)
    functional = functional_counterpart(modules[path])  # F.relu in place of the child: not this
    if any(_names_attribute(c, name) or (functional and _names_attribute(c, functional))
           for c in cls.__mro__ if c not in (nn.Module, object)):
        return None
    return (f"{path} ({type(modules[path]).__name__}) is held by '{parent or '(root)'}' but never "
            f"used: no method of {cls.__module__}.{cls.__qualname__} refers to '{name}', so its "
            f"forward computes without it. The child was most likely kept by a conversion that "
            f"replaced the module it belonged to (e.g. nn.SyncBatchNorm.convert_sync_batchnorm "
            f"of a norm+activation subclass drops the activation, pytorch/pytorch#187298): the "
            f"converted model computes a different function. Compare the two models "
            f"(hookscope.compare) to see where they part, or convert only exact BatchNorm classes")


def _names_attribute(cls: type, name: str) -> bool:
    """True when code defined in ``cls`` itself names ``name`` (an attribute read or a string)."""
    stack = [getattr(getattr(f, "__func__", f), "__code__", None) for f in vars(cls).values()]
    stack += [getattr(getattr(p, "fget", None), "__code__", None) for p in vars(cls).values()]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        if name in code.co_names or name in code.co_consts:
            return True
        stack.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return False


def locate_error(names: ModuleIndex, exc: BaseException) -> None:
    """Add a note to ``exc`` naming the innermost module of the model ``names`` indexes that
    was running.

    The note reads ``hookscope: raised inside 'blocks.3.mlp.fc1' (Linear) called with input
    shapes [(2, 7)]``. Python 3.11+ prints notes with the traceback; the exception's type and
    message are unchanged.
    """
    paths = {id(m): p for p, m in names.modules.items()}
    frame = _innermost_module_frame(exc, paths)
    if frame is None:
        return
    module = frame.f_locals["self"]
    path = record_name(paths[id(module)])
    shapes = _tensor_shapes(frame)
    note = (f"hookscope: raised inside '{path}' ({type(module).__name__})"
            f"{' called with input shapes ' + shapes if shapes else ''}")
    if note in getattr(exc, "__notes__", ()):  # nested blocks: the outer one says it again
        return
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: keep it where tools look for notes
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


def _innermost_module_frame(exc: BaseException, names: dict[int, str]) -> FrameType | None:
    """The ``forward`` frame of the innermost model module in the traceback (its inputs are what
    the module was called with), else that module's last frame (e.g. a helper method)."""
    frames: list[FrameType] = []
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    if not frames:
        return None
    innermost = frames[-1].f_locals["self"]
    own = [f for f in frames if f.f_locals["self"] is innermost]
    return next((f for f in reversed(own) if f.f_code.co_name == "forward"), own[-1])


def _tensor_shapes(frame: FrameType) -> str:
    code = frame.f_code
    arg_names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(n) for n in arg_names if n != "self"]
    if code.co_flags & 0x04:  # *args
        values.extend(frame.f_locals.get(code.co_varnames[len(arg_names)], ()) or ())
    shapes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]
    return str(shapes) if shapes else ""


def _child_index(modules: dict[str, nn.Module]) -> dict[str, list[str]]:
    """``{path: [paths of its direct children]}``, in ``named_modules()`` order."""
    index: dict[str, list[str]] = {}
    for path in modules:
        if path:
            index.setdefault(path.rpartition(".")[0], []).append(path)
    return index
