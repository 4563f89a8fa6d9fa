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

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hookscope.engine import interrupts
from hookscope.engine.checks import check_model
from hookscope.engine.door.hooks import OwnedHook
from hookscope.engine.door.sharing import ModuleHooks
from hookscope.errors import ConcurrentModelError, HookscopeError

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
    """Leave each model as it was found when the block ends: returned, raised or interrupted,
    without ever writing into what another thread changes meanwhile.

    A forward in training mode is not read-only: BatchNorm updates ``running_mean``,
    ``running_var`` and ``num_batches_tracked``, spectral norm advances its power iteration
    (``_u``, ``_v``), dropout draws from the global RNG. On exit each buffer whose values changed
    holds its old values again (the same tensor object, refilled in place, so references to it
    stay valid), each module whose ``training`` flag changed gets it back, each parameter whose
    ``requires_grad`` changed too; the CPU and CUDA RNGs get their states back (unless another
    thread may have drawn from them meanwhile, see Threads) and autograd its
    grad mode (a KeyboardInterrupt inside a verb's ``torch.no_grad()`` exit would leave
    gradients off). Only what changed is written: an unchanged model is only read. The model's
    mode is not changed on entry: the block sees train-mode behaviour (dropout) if the model is
    in it. A signal arriving while the state is restored is held back until the restore is
    done (``engine.interrupts``).

    ``.grad`` is never touched: every verb's backward is ``torch.autograd.grad``, which writes no
    ``.grad``, so a thread training the model (``zero_grad``, ``backward``, ``optimizer.step``)
    while another runs ``stats``/``tree``/``find_nonfinite`` on it keeps its own gradients
    (setting them aside and back raced with its backward and crashed the process: issue 35).

    Threads: a buffer changed during the block may be another thread's doing (a trainer's
    forward updating BatchNorm statistics). An owned forward pre-hook on each module holding
    buffers counts the calls of other threads (``hooks.OwnedHook.foreign_calls``); a changed
    buffer of a module another thread ran is left as it is (restoring it would overwrite that
    thread's updates), and leaving the block raises ``ConcurrentModelError`` naming the modules
    when the verb's own forward ran in training mode there too (the statistics then hold both
    threads' updates). In eval mode a forward changes no buffer, so nothing is refused.

    The RNG is one for the process: putting it back would make a thread that drew from it
    during the block (a trainer's dropout) draw the same numbers again (the same masks twice).
    So it is put back only when no other thread ran the model (its root module's calls are
    counted too) and no other thread had such a block open at any moment of this one; else it
    is left as it is, as any two threads drawing from one generator leave it. A thread drawing
    from the RNG without running the model or a hookscope block is beyond what hookscope sees.

    Parameters are not copied, so a forward that writes its own weights in place (an
    ``.data.copy_`` in ``forward``, a codebook updated by the forward) keeps that write:
    restoring it would need a copy of every weight (twice the model's memory, 14 GB more for a
    7B model in bf16) in every verb, for a kind of forward that changes the model even without
    hookscope.

    Cost: one clone of every buffer, one comparison per buffer on exit. Buffers of lazy modules
    that are not yet materialised are left alone (the forward materialises them, as any
    forward).

    Raises:
        ArgumentTypeError: a model is not an ``nn.Module`` (raised at the call, nothing read).
        ConcurrentModelError: on exit, see Threads above.
    """

    def __init__(self, *models: nn.Module):
        for model in models:
            check_model(model)  # a verb's bad model is refused before any state is read
        self._models = models
        self._kept: list[_State] = []
        self._rng: RngState | None = None
        self._rng_shared = False  # another thread's block was open during this one
        self._rng_thread = 0
        self._grad: bool | None = None  # the grad mode on entry, until restored
        self._finished = True  # nothing to finish: not opened, or _finish ran (exit, interrupt)

    def __enter__(self) -> None:
        # an exception anywhere in entering restores and unhooks: every state is kept before
        # its hooks exist, and _finish undoes whatever is there
        try:
            self._open()
            interrupts.release_signals()  # a signal held back so far: a failed entry
        except BaseException:
            try:
                self._finish()
            finally:
                interrupts.release_signals()  # one held back while the entry was undone
            raise

    def _open(self) -> None:
        self._finished = False
        interrupts.guard(self)  # signals wait during entry and exit; _finish unguards
        self._grad = torch.is_grad_enabled()
        self._rng = RngState.now()
        _open_rng(self)
        for model in self._models:  # kept before its hooks exist: _finish removes them
            state = _State(model)
            self._kept.append(state)
            state.watch()

    @interrupts.never_skipped(lambda block: block._finished or block._finish())  # exit cut short
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        try:
            self._close(exc)
        except BaseException:
            self._finish()
            raise
        finally:
            interrupts.release_signals()  # a signal held back during the exit surfaces here

    def _close(self, exc: BaseException | None) -> None:
        shared = self._finish()
        if shared and exc is None:
            raise ConcurrentModelError(
                f"another thread ran {', '.join(repr(p) for p in shared[:4])}"
                f"{' …' if len(shared) > 4 else ''} while this verb ran a training-mode forward "
                "of it: the buffers there (BatchNorm statistics) now hold both threads' updates, "
                "and hookscope left them as they are rather than overwrite the other thread's. "
                "Run the verb on model.eval() (a forward in eval mode changes no buffer) or on "
                "copy.deepcopy(model) while another thread trains it")

    def _finish(self) -> list[str]:
        """Restore the state and stop guarding (idempotent: a pass that an exception stopped
        is completed by running it again, here at once). Returns the paths of modules with
        changed buffers that another thread ran (left as they are)."""
        try:
            return self._finish_once()
        except BaseException:
            self._finish_once()
            raise

    def _finish_once(self) -> list[str]:
        shared = []
        foreign = any(state.foreign_calls() for state in self._kept)
        for state in self._kept:  # each restore is idempotent; the list is cleared after all
            shared += state.restore()
        self._kept = []
        self._finished = True
        if self._grad is not None and torch.is_grad_enabled() != self._grad:
            torch.set_grad_enabled(self._grad)
        self._grad = None
        if self._rng is not None:
            if not (_close_rng(self) or foreign):
                self._rng.restore()
            self._rng = None
        interrupts.unguard(self)
        return shared


_rng_lock = threading.Lock()
_rng_blocks: dict[int, untouched] = {}  # id(block) -> block: the open blocks, every thread's


def _open_rng(block: untouched) -> None:
    """Note ``block`` as open; it and every open block of another thread share the RNG now."""
    block._rng_thread = threading.get_ident()
    with _rng_lock:
        _share_rng(block)


def _share_rng(block: untouched) -> None:
    for other in _rng_blocks.values():
        if other._rng_thread != block._rng_thread:
            other._rng_shared = block._rng_shared = True
    _rng_blocks[id(block)] = block


def _close_rng(block: untouched) -> bool:
    """Forget ``block``; True when another thread's block was open at some moment of it."""
    with _rng_lock:
        _rng_blocks.pop(id(block), None)
    return block._rng_shared


class _State:
    """Buffers (object and a clone), training flags and ``requires_grad``, and owned pre-hooks
    counting other threads' calls of each module holding buffers.

    Every buffer is compared on exit, not only those whose version changed: BatchNorm's kernel
    updates its running statistics without bumping their version counter."""

    def __init__(self, model: nn.Module):
        self.flags: list[tuple[nn.Module, bool]] = []
        self.buffers: list[tuple[nn.Module, str, Tensor, Tensor]] = []
        self.params: list[tuple[nn.Parameter, bool]] = []
        self.counters: dict[nn.Module, OwnedHook] = {}
        self.hooks = ModuleHooks()
        self.paths = {m: p for p, m in model.named_modules(remove_duplicate=False)}
        modules = list(model.modules())
        self.flags = [(m, m.training) for m in modules]
        kept = [(m, name, b) for m in modules for name, b in m._buffers.items()
                if b is not None and not isinstance(b, nn.parameter.UninitializedBuffer)]
        clones = detached_clones(b for _, _, b in kept)
        self.buffers = [(m, name, b, c) for (m, name, b), c in zip(kept, clones, strict=True)]
        self.params = [(p, p.requires_grad) for p in model.parameters()]
        self.trained: set[nn.Module] = set()  # modules this thread ran in training mode
        self.watched = list(dict.fromkeys([model, *(m for m, _, _ in kept)]))  # the root: RNG

    def watch(self) -> None:
        """Register the owned pre-hooks counting other threads' calls (``restore`` removes
        them, also those of a ``watch`` that an interrupt stopped halfway)."""
        for module in self.watched:
            counter = OwnedHook(self._ran, module, traceable=True)
            self.counters[module] = counter
            self.hooks.add(counter, pre=True)  # written down before it is registered

    def foreign_calls(self) -> int:
        """Calls of the watched modules (the root's included) from other threads so far."""
        return sum(counter.foreign_calls for counter in self.counters.values())

    def _ran(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self.trained.add(module)

    def restore(self) -> list[str]:
        """Put back what changed (idempotent); return the paths of modules whose changed
        buffers were left because another thread ran them."""
        self.hooks.remove()
        shared: dict[str, None] = {}
        for module, training in self.flags:
            if module.training != training:
                module.training = training
        with torch.inference_mode():  # writes a normal buffer, and one made in inference mode
            for module, name, buffer, values in self.buffers:
                if module._buffers.get(name) is buffer and _same(buffer, values):
                    continue
                counter = self.counters.get(module)
                if counter is not None and counter.foreign_calls:  # maybe the other's doing
                    if module in self.trained:  # and ours: both updates are in it
                        shared[self.paths.get(module, "?")] = None
                    continue
                module._buffers[name] = buffer
                buffer.copy_(values)
        for param, requires_grad in self.params:
            if param.requires_grad != requires_grad:
                param.requires_grad_(requires_grad)
        self.buffers, self.flags, self.params = [], [], []
        return list(shared)


def _same(tensor: Tensor, values: Tensor) -> bool:
    """Whether ``tensor`` still holds ``values`` (NaN equal to NaN: nothing to write back; a
    ``meta`` tensor holds no values)."""
    if tensor.is_meta or values.is_meta:
        return tensor.shape == values.shape
    if tensor.shape != values.shape or tensor.dtype != values.dtype or tensor.device != values.device:
        return False
    return bool(torch.equal(tensor, values)) or (tensor.is_floating_point() and bool(
        torch.allclose(tensor, values, rtol=0, atol=0, equal_nan=True)))


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
