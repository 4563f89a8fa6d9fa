"""What the model itself computed: one probe forward per model, for verbs that check themselves.

A verb that derives something from the model's structure (which module's output is
``hidden_states[i]``, what follows the last block before the logits) can ask the model: a
Hugging Face model returns its hidden states (``output_hidden_states=True``) and its logits. The
probe is one forward, at first use, on a small input made from the config (six token ids; a
decoder start for an encoder-decoder; one image of ``config.image_size`` for a vision model),
under ``torch.no_grad()``, with the model left as found (``engine.run.untouched``) and with
hookscope's own open sessions' hooks set aside (``tables.set_aside``: the probe is not one of
their forwards). A forward hook on every module keeps the first tensor of each call's output
and input (a copy, as the call returned it: a later in-place write does not reach it), and the
order in which calls began and ended. The probe is kept per model object
(weakly: it goes with the model) and made again only when the model's module set changed.

A model the probe cannot run (no ``config``, a forward without ``output_hidden_states``, an
input kind it does not make, a forward that raises) has no probe: ``probe_of`` returns ``None``
with the reason, and each verb says what that means for it.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookscope.engine.door.hooks import register
from hookscope.engine.door.tables import set_aside
from hookscope.engine.naming.names import ModuleIndex
from hookscope.engine.run import input_device, untouched

__all__ = ["Probe", "probe_of", "first_tensor", "same_values"]

Tensor = torch.Tensor
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
        memo: what verbs derived from this probe (``{verb: result}``), kept with it.
    """

    output: Any
    outputs: dict[str, list[Tensor]]
    inputs: dict[str, list[Tensor]]
    calls: list[tuple[str, int, int]]
    feed: dict[str, Any]
    memo: dict[str, Any] = field(default_factory=dict)

    def once(self, path: str) -> Tensor | None:
        """The output of ``path`` when it ran exactly once, else None."""
        values = self.outputs.get(path, [])
        return values[0] if len(values) == 1 else None


_PROBES: weakref.WeakKeyDictionary[nn.Module, tuple[int, Probe | str]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def probe_of(names: ModuleIndex) -> Probe | str:
    """The probe of ``names.root`` (run at first use, then kept), or why there is none."""
    model = names.root
    with _LOCK:
        kept = _PROBES.get(model)
        if kept is not None and kept[0] == len(names.modules):
            return kept[1]
    result = _run_probe(names)
    with _LOCK:
        _PROBES[model] = (len(names.modules), result)
    return result


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


def _run_probe(names: ModuleIndex) -> Probe | str:
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

    handles: list[RemovableHandle] = []
    try:
        with set_aside(model), untouched(model), torch.no_grad():
            for path, module in names.modules.items():
                register(module, pre(path), pre=True, into=handles)
                register(module, post(path), into=handles)
            output = model(**feed, output_hidden_states=True, return_dict=True)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a reason, not an error
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return f"the probe forward raised {type(exc).__name__}: {first}"
    finally:
        for handle in handles:
            handle.remove()
    return Probe(output, outputs, inputs, calls, feed)


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
