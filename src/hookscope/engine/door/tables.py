"""Torch's other hook tables: tensor, autograd-node and optimizer hooks, and the inventory of
every module's and the global tables.

Every hook here is hookscope's own or read for ``hooks(model)``/``remove_hooks``; module forward
(pre-)hooks go through ``engine.door.hooks.register`` and ``engine.door.sharing.ModuleHooks``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from hookscope.engine.door.hooks import owner
from hookscope.engine.door.sharing import locked

__all__ = ["on_tensor_grad", "on_output_grad", "on_node", "on_optimizer_step", "after_backward",
           "MODULE_TABLES", "GLOBAL_TABLES", "MODULE_FLAGS", "GLOBAL_FLAGS", "registered", "unregister",
           "others_tables"]

def on_tensor_grad(tensor: torch.Tensor, function: Callable[[torch.Tensor], Any]) -> RemovableHandle:
    """Run ``function(grad)`` when autograd computes d(loss)/d(``tensor``); return the handle.

    Call it only from code that already acts for a session (an ``OwnedHook``'s function, or the
    thread that entered the block): ``tensor`` is then a value of that session's own forward,
    so only a backward pass through that forward reaches ``function``. Its thread is not
    checked when it fires: the autograd engine runs a CUDA graph's hooks on its own device
    threads, not in the thread that called ``backward``.

    Raises:
        RuntimeError: (torch) ``tensor`` does not require grad.
    """
    handle: RemovableHandle = tensor.register_hook(function)  # type: ignore[no-untyped-call]
    return handle


def on_output_grad(tensor: torch.Tensor, function: Callable[[torch.Tensor], Any]) -> Any:
    """``on_tensor_grad`` through a pre-hook of ``tensor.grad_fn`` (registered in C++, without
    ``Tensor.register_hook``'s Python bookkeeping: a hook registered on every training step):
    ``function(grad)`` runs with d(loss)/d(``tensor``) when autograd reaches the node, as a
    tensor hook would (torch runs a non-leaf tensor's hooks as that node's pre-hooks); not when
    the backward delivers no gradient to ``tensor``. A tensor without ``grad_fn`` (a leaf)
    takes ``on_tensor_grad``. The same call rules as ``on_tensor_grad``; returns the handle."""
    node = tensor.grad_fn
    if node is None:
        return on_tensor_grad(tensor, function)
    index = tensor.output_nr

    def prehook(grad_outputs: tuple[Any, ...]) -> None:
        grad = grad_outputs[index]
        if grad is not None:
            function(grad)
    return node.register_prehook(prehook)


def on_node(node: Any, function: Callable[[tuple[Any, ...], tuple[Any, ...]], Any]) -> RemovableHandle:
    """Run ``function(grad_inputs, grad_outputs)`` after autograd node ``node`` (a
    ``tensor.grad_fn``) has computed its gradients; return the handle. As ``on_tensor_grad``:
    call it from code acting for a session, on a node its own forward made."""
    handle: RemovableHandle = node.register_hook(function)
    return handle


def on_optimizer_step(optimizer: torch.optim.Optimizer, function: Callable[[], Any], *,
                      pre: bool, record: Callable[[RemovableHandle], Any]) -> None:
    """Run ``function()`` before (``pre``) or after each ``optimizer.step()``; ``record(handle)``
    gets the handle before the hook exists (written as torch's ``register_step_(pre|post)_hook``
    write it, into the same table: an exception in between leaves nothing unrecorded); an
    optimizer that overrides those methods is asked through them, and raises what they raise.

    A step that a ``GradScaler`` skips (non-finite gradients) never calls ``optimizer.step``, so
    neither hook runs for it."""
    hook = lambda opt, args, kwargs: function()  # noqa: E731
    name = "register_step_pre_hook" if pre else "register_step_post_hook"
    if getattr(type(optimizer), name, None) is not getattr(torch.optim.Optimizer, name):
        record(getattr(optimizer, name)(hook))
        return
    table = optimizer._optimizer_step_pre_hooks if pre else optimizer._optimizer_step_post_hooks
    handle = RemovableHandle(table)
    record(handle)
    table[handle.id] = hook


def after_backward(function: Callable[[], Any]) -> None:
    """Run ``function()`` once at the end of the backward pass now running, after every
    gradient has been accumulated into ``.grad`` (the autograd engine's final callbacks, as DDP
    uses). Call it from a gradient hook. ``function`` still runs inside the backward: module
    hooks take a forward run from it for a checkpoint recompute (``in_recompute``), so it must
    not run forwards of its own; an exception it raises leaves ``backward()``."""
    torch.autograd.Variable._execution_engine.queue_callback(function)


# ------------------------------------------------------------------ torch's hook tables
#: kind -> the attribute of a module holding its ``{handle id: hook}`` (torch's private tables;
#: ``tests/test_hooks_inventory.py`` fails loudly if torch renames one)
MODULE_TABLES = {"forward_pre": "_forward_pre_hooks", "forward": "_forward_hooks",
                 "backward_pre": "_backward_pre_hooks", "backward": "_backward_hooks"}
#: kind -> the attribute of ``torch.nn.modules.module`` holding the global module hooks
GLOBAL_TABLES = {"global_forward_pre": "_global_forward_pre_hooks",
                 "global_forward": "_global_forward_hooks",
                 "global_backward_pre": "_global_backward_pre_hooks",
                 "global_backward": "_global_backward_hooks"}
#: tables keyed by the same ids that flag a hook (``with_kwargs=True``, ``always_call=True``)
MODULE_FLAGS: tuple[str, ...] = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called")
GLOBAL_FLAGS: tuple[str, ...] = ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")


def registered(module: nn.Module | None) -> list[tuple[str, int, Any]]:
    """``(kind, handle id, hook)`` of each hook in ``module``'s own tables (``None``: torch's
    global module hooks), table by table in ``MODULE_TABLES``/``GLOBAL_TABLES`` order. Reads
    only: who registered them is not asked (``hooks(model)`` lists them)."""
    owner_of, tables = (torch_module, GLOBAL_TABLES) if module is None else (module, MODULE_TABLES)
    return [(kind, hook_id, hook) for kind, attr in tables.items()
            for hook_id, hook in getattr(owner_of, attr).items()]


def unregister(module: nn.Module | None, kind: str, hook_id: int) -> None:
    """Remove hook ``hook_id`` of ``kind`` (a key of ``MODULE_TABLES``, or of ``GLOBAL_TABLES``
    when ``module`` is None) whose handle is lost, leaving torch's tables as they were before it
    was registered: its flags go too (torch's own ``RemovableHandle.remove`` leaves a global
    hook's ``with_kwargs`` flag behind), and once no backward hook is left the "full backward
    hook" mark goes back to unset (else a later ``register_backward_hook`` /
    ``register_module_backward_hook`` raises 'Cannot use both regular backward hooks and full
    backward hooks')."""
    locked(_unregister, module, kind, hook_id)  # as ModuleHooks: never under a trace


def _unregister(module: nn.Module | None, kind: str, hook_id: int) -> None:
    owner_of: Any = torch_module if module is None else module
    if module is None:
        table, flags, mark = GLOBAL_TABLES[kind], GLOBAL_FLAGS, "_global_is_full_backward_hook"
    else:
        table, flags, mark = MODULE_TABLES[kind], MODULE_FLAGS, "_is_full_backward_hook"
    hooks = getattr(owner_of, table)
    hooks.pop(hook_id, None)
    for flag in flags:
        getattr(owner_of, flag).pop(hook_id, None)
    if kind.endswith("backward") and not hooks:
        setattr(owner_of, mark, None)


#: a module's tables of its state-dict hooks (copied with the others by ``others_tables``)
_STATE_DICT_TABLES = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks")


def others_tables(module: nn.Module) -> dict[str, OrderedDict[int, Any]]:
    """``{attribute: table}``: a copy of each of ``module``'s hook tables (``MODULE_TABLES``, the
    state-dict hooks' and the flags ``MODULE_FLAGS``) holding the hooks others registered (a
    user's, ``weight_norm``'s), not hookscope's: the tables of a view of ``module``
    (``circuits.view``), so hooks registered on the view go into its tables only. Reads only."""
    ours = {key for attr in (MODULE_TABLES["forward_pre"], MODULE_TABLES["forward"])
            for key, hook in getattr(module, attr).items() if owner(hook) is not None}
    names = (*MODULE_TABLES.values(), *_STATE_DICT_TABLES, *MODULE_FLAGS)
    return {attr: OrderedDict((key, value) for key, value in getattr(module, attr).items() if key not in ours)
            for attr in names if hasattr(module, attr)}
