"""What the model itself computed: one probe forward per model, for verbs that check themselves.

A verb that derives something from the model's structure (which module's output is
``hidden_states[i]``, what follows the last block before the logits) can ask the model: a
Hugging Face model returns its hidden states (``output_hidden_states=True``) and its logits. The
probe is one forward, at first use, on a small input made from the config (six token ids; a
decoder start for an encoder-decoder; one image of ``config.image_size`` for a vision model),
under ``torch.no_grad()``, with the model left as found (``engine.run.untouched``), in a thread
of its own (``unowned``) that the door marks as no one's (``door.hooks.unowned_threads``): every
open block's hooks, of this thread or any other, skip the probe's calls (it is none of their
forwards) and do not count them, and go on acting for their own threads' calls meanwhile;
nothing is taken out of torch's tables (issue 47: setting hookscope's hooks aside for the probe
silenced every other thread's blocks on the model while it ran). A user's own hook sees the
probe forward, in that thread. A forward hook on every module keeps the first tensor of each
call's output and input (a copy, as the call returned it: a later in-place write does not reach
it), and the order in which calls began and ended. The forwards of the modules that own a block list (a
``ModuleList``'s parent: the model's own code between its blocks) are watched too
(``engine.function_mode``): each torch function they call themselves keeps the first tensor it
returned, so a value the model computes inline (token embeddings scaled and positions added
outside any module) is found where it is computed. The probe is kept per model object
(weakly: it goes with the model) and made again only when the model's module set changed.

A model the probe cannot run (no ``config``, a forward without ``output_hidden_states``, an
input kind it does not make, a forward that raises) has no probe: ``probe_of`` returns the
reason (a string), and each verb says what that means for it.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope.engine.door.hooks import register, unowned_threads
from hookscope.engine.function_mode import FunctionCall, FunctionWatcher
from hookscope.engine.naming.names import ModuleIndex
from hookscope.engine.run import input_device, untouched

__all__ = ["Probe", "probe_of", "first_tensor", "same_values", "unowned"]

Tensor = torch.Tensor
R = TypeVar("R")
PROBE_TOKENS, PROBE_DECODER_TOKENS = 6, 4


@dataclass
class Probe:
    """One forward's ground truth.

    Attributes:
        output: what the model returned (a ``ModelOutput``: ``hidden_states``, ``logits``, ...).
        outputs: ``{module path: [first tensor of each call's output]}``.
        inputs: ``{module path: [first tensor argument of each call]}``.
        calls: ``[(path, begin, end)]``: each call's rank when it began and when it ended, in one
            count of events (a call nested in another begins after it and ends before it).
        feed: the keyword inputs the model was called with.
        functions: ``[(path, op, rank, first tensor returned)]``: the torch function calls made
            by the own forward of each module that owns a block list, ``op`` as an address
            writes it (``"dropout#0"``: its call 0 in the forward), ``rank`` in the count of
            ``calls`` (the call began after the events of lower rank).
        memo: what verbs derived from this probe (``{verb: result}``), kept with it.
    """

    output: Any
    outputs: dict[str, list[Tensor]]
    inputs: dict[str, list[Tensor]]
    calls: list[tuple[str, int, int]]
    feed: dict[str, Any]
    functions: list[tuple[str, str, int, Tensor]] = field(default_factory=list)
    memo: dict[str, Any] = field(default_factory=dict)

    def once(self, path: str) -> Tensor | None:
        """The output of ``path`` when it ran exactly once, else None."""
        values = self.outputs.get(path, [])
        return values[0] if len(values) == 1 else None


_PROBES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], Probe | str]] = \
    weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def probe_of(names: ModuleIndex) -> Probe | str:
    """The probe of ``names.root`` (run at first use, then kept), or why there is none."""
    model = names.root
    with _LOCK:
        kept = _PROBES.get(model)
        if kept is not None and kept[0] == _module_set(names):
            return kept[1]
    result = _run_probe(names, watch=True)
    if isinstance(result, str):  # a forward the function watch breaks: the modules alone
        result = _run_probe(names, watch=False)
    with _LOCK:
        _PROBES[model] = (_module_set(names), result)
    return result


def _module_set(names: ModuleIndex) -> tuple[int, ...]:
    """What the kept probe is valid for: the model's modules themselves (a module swapped for
    another of the same count is a new model to the probe, not only a changed count)."""
    return tuple(map(id, names.modules.values()))


def first_tensor(value: Any) -> Tensor | None:
    """``value`` itself, or the first tensor of a tuple/list/ModelOutput (depth first), else None."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def same_values(a: Any, b: Any, *, tolerance: float = 1e-5) -> bool:
    """Whether ``a`` and ``b`` hold the same values: equal shape, and equal within ``tolerance``
    relative to the larger magnitude (float32; the same computation run twice differs only by
    the last bits)."""
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.shape != b.shape \
            or not a.is_floating_point() or a.is_meta:  # a hidden state that is a tuple (PegasusX)
        return False
    x, y = a.detach().float(), b.detach().float().to(a.device)
    scale = max(float(y.abs().max()), 1.0) if y.numel() else 1.0
    return bool(((x - y).abs() <= tolerance * scale).all())


def _run_probe(names: ModuleIndex, *, watch: bool) -> Probe | str:
    model = names.root
    feed = _probe_inputs(model)
    if isinstance(feed, str):
        return feed
    outputs: dict[str, list[Tensor]] = {}
    inputs: dict[str, list[Tensor]] = {}
    begun: dict[str, list[int]] = {}
    calls: list[tuple[str, int, int]] = []
    counter = [0]

    def pre(path: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            begun.setdefault(path, []).append(counter[0])
            counter[0] += 1
        return hook

    def post(path: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            calls.append((path, begun[path].pop(), counter[0]))
            counter[0] += 1
            for table, value in ((outputs, out), (inputs, args)):
                found = first_tensor(value)
                if found is not None:
                    # a copy: the forward may write into it later (CTRL's `inputs_embeds *= ...`)
                    table.setdefault(path, []).append(found.detach().clone())
        return hook

    functions: list[tuple[str, str, int, Tensor]] = []
    watcher = FunctionWatcher()
    if watch:
        for path in _block_owners(names):
            watcher.watch(names.modules[path], _keeper(path, functions, counter))

    def forward() -> Any:  # in the probe's own thread (unowned)
        handles: list[RemovableHandle] = []
        try:
            with torch.no_grad():
                for path, module in names.modules.items():
                    register(module, pre(path), pre=True, record=handles.append)
                    register(module, post(path), record=handles.append)
                watcher.install(handles)
                output = model(**feed, output_hidden_states=True, return_dict=True)
                _synchronize(feed)
                return output
        finally:
            for handle in handles:
                handle.remove()
            watcher.close()

    try:
        with untouched(model):  # in this thread: the model (RNG included) as this thread found it
            output = unowned(forward)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a reason, not an error
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return f"the probe forward raised {type(exc).__name__}: {first}"
    return Probe(output, outputs, inputs, calls, feed, functions)


def _block_owners(names: ModuleIndex) -> list[str]:
    """The paths of the modules that own a non-empty ``ModuleList`` (its parent)."""
    owners = {path.rsplit(".", 1)[0] if "." in path else "" for path, module in names.modules.items()
              if path and isinstance(module, nn.ModuleList) and len(module) > 0}
    return [path for path in names.modules if path in owners]


def _keeper(path: str, kept: list[tuple[str, str, int, Tensor]], counter: list[int]) -> Any:
    """``on_call`` of a watch: keeps the first float tensor a call of the forward's first run
    returned (a copy), with its address and rank."""
    def on_call(call: FunctionCall) -> None:
        found = first_tensor(call.output)
        if call.module_call == 0 and found is not None and found.is_floating_point():
            kept.append((path, f"{call.name}#{call.occurrence}", counter[0], found.detach().clone()))
            counter[0] += 1
    return on_call


def unowned(function: Callable[[], R]) -> R:
    """Return ``function()`` run in a new thread that no block owns (``door.hooks.unowned_threads``):
    each of hookscope's hooks skips the calls it makes, without counting them as another
    thread's, while acting as before for every other thread. The caller waits (also through a
    ``KeyboardInterrupt``, which is raised once the thread ended: it is one short forward), and
    gets what ``function`` raised. Thread-local state is the new thread's own: grad mode,
    autocast, torch's function-mode stack, the current CUDA stream."""
    done: list[R] = []
    failed: list[BaseException] = []

    def body() -> None:
        ident = threading.get_ident()
        unowned_threads.add(ident)
        try:
            done.append(function())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            failed.append(exc)
        finally:
            unowned_threads.discard(ident)

    thread = threading.Thread(target=body, name="hookscope-probe", daemon=True)
    thread.start()
    try:
        thread.join()
    finally:
        thread.join()  # an interrupt of the first wait: still nothing runs on after the probe
    if failed:
        raise failed[0]
    return done[0]


def _synchronize(feed: dict[str, Any]) -> None:
    """Wait for the probe's kernels on each CUDA device of its inputs (the thread's own current
    stream, not the caller's: the caller reads the results on its stream)."""
    for value in feed.values():
        if isinstance(value, Tensor) and value.is_cuda:
            torch.cuda.synchronize(value.device)


def _probe_inputs(model: nn.Module) -> dict[str, Any] | str:
    """The probe's keyword inputs, made from the config (module docstring), or why none."""
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no Hugging Face config to make a probe input from"
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return f"{type(model).__name__}.forward has no signature to read"
    if "output_hidden_states" not in parameters and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return f"{type(model).__name__}.forward takes no output_hidden_states"
    device = input_device(model)
    generator = torch.Generator().manual_seed(0)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids":
        vocab = _vocabulary(model, config)
        if vocab is None:
            return "no vocabulary size found (get_input_embeddings(), config.vocab_size)"
        low = min(4, vocab - 1)
        ids = torch.randint(low, vocab, (1, PROBE_TOKENS), generator=generator).to(device)
        feed: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if getattr(config, "is_encoder_decoder", False):
            feed["decoder_input_ids"] = ids[:, :PROBE_DECODER_TOKENS]
        if "use_cache" in parameters:
            feed["use_cache"] = False
        return feed
    if main == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size, channels = getattr(vision, "image_size", None), getattr(vision, "num_channels", 3)
        if isinstance(size, (tuple, list)):
            size = size[0]
        if not isinstance(size, int) or not isinstance(channels, int):
            return "no image size found in the config (image_size, num_channels)"
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        pixels = torch.randn(1, channels, size, size, generator=generator).to(device, dtype)
        return {"pixel_values": pixels}
    return f"its main input is {main!r}; the probe makes input_ids and pixel_values only"


def _vocabulary(model: nn.Module, config: Any) -> int | None:
    get_embed = getattr(model, "get_input_embeddings", None)
    try:
        embed = get_embed() if callable(get_embed) else None
    except (NotImplementedError, AttributeError):
        embed = None
    size = getattr(embed, "num_embeddings", None)
    if isinstance(size, int) and size > 0:
        return size
    text = getattr(config, "text_config", None)
    size = getattr(config, "vocab_size", None) or getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None
