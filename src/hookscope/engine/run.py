"""Private: what one batch means to the model, the same in ``extract``, ``stats`` and the CLI.

A batch is what a ``DataLoader`` yields. A tensor is the input (``model(batch)``); a dict, such as
a tokenizer's output, holds keyword inputs (``model(**batch)``). A tuple or list is
``(inputs, labels, ...)``, as a DataLoader over a labelled data set yields it (torchvision's
``ImageFolder``, ``TensorDataset(x, y)``): its first item is the inputs (a tensor, a dict, or a
tuple/list of positional arguments, ``model(*inputs)``) and the rest is ignored.

``untouched(model)`` is what a verb that runs forwards of its own (``tree``, ``stats``,
``compare``, ``gradcam``, ``extract`` ...) promises: the model is left as it was found. It and the
training monitor (``train/``) take their copies the one way defined here: ``detached_clones``
(tensors), ``state_snapshot`` (a state dict) and ``RngState`` (the CPU and CUDA generators).

Where the batch goes (``input_device``) is where the model's first computation runs, which is not
always where its first parameter is: accelerate's ``cpu_offload``/``disk_offload``/
``dispatch_model`` keep parameters on ``meta`` (or spread over devices) and load them in their own
pre-forward hooks onto an execution device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hookscope.engine import interrupts
from hookscope.engine.checks import check_model
from hookscope.errors import HookscopeError

__all__ = ["RngState", "detached_clones", "input_device", "model_inputs", "state_snapshot",
           "untouched"]

Tensor = torch.Tensor


def model_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``(args, kwargs)`` to call the model with on ``batch`` (see the module docstring).

    Raises:
        HookscopeError: ``batch`` is none of a tensor, a dict, or a non-empty tuple/list whose
            first item is a tensor, dict, tuple or list.
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and batch:
        inputs = batch[0]
        if isinstance(inputs, (tuple, list)):
            return tuple(inputs), {}
        if isinstance(inputs, (torch.Tensor, Mapping)):
            return model_inputs(inputs)
    raise HookscopeError(
        f"a batch is a {type(batch).__name__}{_first_item(batch)}; a batch is a tensor "
        f"(model(batch)), a dict of keyword inputs (model(**batch)), or a tuple/list "
        f"(inputs, labels, ...) whose first item is a tensor, a dict, or a tuple of positional "
        f"inputs (model(*inputs))")


def _first_item(batch: Any) -> str:
    if isinstance(batch, (tuple, list)) and batch:
        return f" whose first item is a {type(batch[0]).__name__}"
    return ""


class untouched:  # noqa: N801 - used as a function: ``with untouched(model):``
    """Leave each model as it was found when the block ends: returned, raised or interrupted.

    A forward in training mode is not read-only: BatchNorm updates ``running_mean``,
    ``running_var`` and ``num_batches_tracked``, spectral norm advances its power iteration
    (``_u``, ``_v``), dropout draws from the global RNG. On exit every buffer holds its old
    values again (the same tensor object, refilled in place, so references to it stay valid),
    every module its ``training`` flag, every parameter its ``requires_grad`` and ``.grad``
    (the same tensor object, with the same values: each ``.grad`` is taken off the parameter
    for the block, so a backward inside accumulates into a fresh one, never into the user's),
    the CPU and CUDA RNGs their states, and autograd its grad mode (a KeyboardInterrupt inside
    a verb's ``torch.no_grad()`` exit would leave gradients off). The model's mode is not
    changed on entry: the block sees train-mode behaviour (dropout) if the model is in it. A
    KeyboardInterrupt (SIGINT) arriving while the state is restored is held back until the
    restore is done (``engine.interrupts``).

    Parameters are not copied, so a forward that writes its own weights in place (an
    ``.data.copy_`` in ``forward``, a codebook updated by the forward) keeps that write:
    restoring it would need a copy of every weight (twice the model's memory, 14 GB more for a
    7B model in bf16) in every verb, for a kind of forward that changes the model even without
    hookscope. ``.grad`` costs nothing: it is set aside, not copied.

    Cost: one clone of every buffer. Buffers of lazy modules that are not yet materialised are
    left alone (the forward materialises them, as any forward).

    Raises:
        ArgumentTypeError: a model is not an ``nn.Module`` (raised at the call, nothing read).
    """

    def __init__(self, *models: nn.Module):
        for model in models:
            check_model(model)  # a verb's bad model is refused before any state is read
        self._models = models
        self._kept: list[_State] = []
        self._rng: RngState | None = None
        self._grad = True

    def __enter__(self) -> None:
        with interrupts.deferred(undo=self._finish):  # interrupted: as if never entered
            self._grad = torch.is_grad_enabled()
            self._kept = [_State(model) for model in self._models]
            self._rng = RngState.now()
            interrupts.guard(self, self._finish)

    def __exit__(self, *exc: object) -> None:
        with interrupts.deferred():
            self._finish()

    def _finish(self) -> None:
        """Restore the state (idempotent) and stop guarding: also what an interrupt of
        ``__exit__`` runs before its KeyboardInterrupt leaves."""
        self._restore()
        interrupts.unguard(self)

    def _restore(self) -> None:
        for state in self._kept:
            state.restore()
        if self._rng is not None:
            self._rng.restore()
        torch.set_grad_enabled(self._grad)


class _State:
    """Buffers (object and a clone), training flags, ``requires_grad`` and ``.grad`` (set
    aside on entry: the parameter has none during the block).

    Every buffer is copied back, changed or not: BatchNorm's kernel updates its running
    statistics without bumping their version counter, so versions cannot tell."""

    def __init__(self, model: nn.Module):
        modules = list(model.modules())
        self.flags = [(m, m.training) for m in modules]
        kept = [(m, name, b) for m in modules for name, b in m._buffers.items()
                if b is not None and not isinstance(b, nn.parameter.UninitializedBuffer)]
        clones = detached_clones(b for _, _, b in kept)
        self.buffers = [(m, name, b, c) for (m, name, b), c in zip(kept, clones, strict=True)]
        self.params = [(p, p.requires_grad, p.grad) for p in model.parameters()]
        for p, _, grad in self.params:
            if grad is not None:
                p.grad = None  # set aside: a backward in the block never adds into the user's

    def restore(self) -> None:
        for module, training in self.flags:
            module.training = training
        with torch.inference_mode():  # writes a normal buffer, and one made in inference mode
            for module, name, buffer, values in self.buffers:
                module._buffers[name] = buffer
                buffer.copy_(values)
        for param, requires_grad, grad in self.params:
            if param.requires_grad != requires_grad:
                param.requires_grad_(requires_grad)
            if param.grad is not grad:
                param.grad = grad


class RngState:
    """The state of the CPU generator and, when CUDA is initialised, of every CUDA device's.

    Attributes:
        cpu: ``torch.get_rng_state()`` (a uint8 CPU tensor).
        cuda: ``torch.cuda.get_rng_state_all()`` (one uint8 CPU tensor per device), or None
            when CUDA was not initialised (nothing on CUDA has drawn random numbers).
    """

    def __init__(self, cpu: Tensor, cuda: list[Tensor] | None):
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def now(cls) -> RngState:
        """The generators' states at this moment."""
        cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)

    def restore(self) -> None:
        """Put the generators back into this state (CUDA's only when it was recorded)."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def detached_clones(tensors: Iterable[Tensor]) -> list[Tensor]:
    """A copy of each tensor, detached from autograd (same shape, dtype and device): what it
    holds now, kept when an in-place update (``optimizer.step``, BatchNorm) later changes it."""
    return [t.detach().clone() for t in tensors]


def state_snapshot(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every tensor a ``detached_clones`` copy: the parameters and
    buffers as they are now, for ``load_state_dict`` later (on this model or another)."""
    state = model.state_dict()
    return dict(zip(state, detached_clones(state.values()), strict=True))


def input_device(model: nn.Module) -> torch.device:
    """The device ``model``'s inputs belong on: the execution device of the first module that
    accelerate placed (``module._hf_hook.execution_device``, in ``named_modules()`` order), else
    the device of its first parameter or buffer that is not on ``meta``; ``meta`` when every one
    is on ``meta`` and no hook loads them (the model runs on meta inputs only, and what it
    returns holds no values: verbs refuse that by name); the CPU for a model without tensors."""
    for module in model.modules():
        device = _execution_device(getattr(module, "_hf_hook", None))
        if device is not None:
            return device
    tensors = [t for ts in (model.parameters(), model.buffers()) for t in ts]
    if tensors and all(t.is_meta for t in tensors):  # nothing loads it: it runs on meta only
        return torch.device("meta")
    return next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))


def _execution_device(hook: Any) -> torch.device | None:
    """The execution device of an accelerate hook (a ``SequentialHook``'s first that has one)."""
    for inner in (hook, *getattr(hook, "hooks", ())):
        device = getattr(inner, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None
