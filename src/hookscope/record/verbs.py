"""The capture verbs: ``capture`` builds a recording session, ``run`` records one forward in one.

``capture`` checks its options at once, before any hook exists, and returns a ``Capture``
(``captures.py``, the session) that adds its hooks on entering the ``with`` block; ``run``
passes its inputs to the model inside such a block, its capture options in one dict.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hookscope.engine import (
    OnUnfired,
    as_patterns,
    check_device,
    check_dtype,
    check_flag,
    check_model,
    check_options,
    flat_patterns,
)
from hookscope.errors import CaptureError
from hookscope.record.captures import Capture, CaptureOptions
from hookscope.record.reductions import Reduce, reduction

__all__ = ["capture", "run", "capture_options"]


def capture(model: nn.Module, *layers: str | Sequence[str], inputs: bool = False, grads: bool = False,
            grad_inputs: bool = False, to: torch.device | str | None = None,
            dtype: torch.dtype | None = None, reduce: Reduce = None, clone: bool | None = None,
            early_stop: bool = False, on_unfired: OnUnfired = "warn") -> Capture:
    """Record the output of every call of each module that ``layers`` select.

    Use it as a context manager; hooks exist only inside the ``with`` block:

    ```python
    with hookscope.capture(model, "conv2", "pos_block.*.proj.0") as acts:
        model(x)
    acts["conv2"]          # (batch, 16, 10, 10) float32 for LeNet on (batch, 3, 32, 32)
    ```

    Args:
        model: root module; ``DataParallel``/``DDP``/``torch.compile`` wrappers are looked through.
        *layers: patterns: paths, ``state_dict()`` keys, globs, ``re:``/``type:`` patterns, optionally
            with output parts (``"lstm[0]"``); see ``hookscope.select``. A function-level
            address ``PATTERN::NAME`` records every call of function ``NAME`` made by the own
            forward of the modules selected (``"::relu"``, ``"h.*.attn::softmax"``;
            ``"::relu#1"`` for call 1 of each forward), each value copied unless ``clone=False``.
            A list of patterns stands for its patterns: ``capture(model, ["fc1", "fc2"])``.
        inputs: also keep each call's positional and keyword inputs (``acts.inputs(path, k)``);
            for a function-level address, its arguments bound to the function's parameters.
        grads: also keep d(loss)/d(output) of each call, filled in when ``backward()`` runs
            through it (``acts.grad(path, k)``); uses tensor hooks, so in-place ops after the
            module, tuple outputs and modules with a legacy backward hook work (``grads.py``).
            Several backward passes through one forward accumulate, as ``.grad`` does.
        grad_inputs: also keep d(loss)/d(input) of each call, the gradient through the module
            only (``acts.grad_input(path, k)``); inputs that do not require grad are marked
            ``NoGrad(reason)``. Each input that requires grad reaches the module as an alias
            (same values and memory) that carries the tensor hook.
        to: device to move captured tensors to (``"cpu"`` frees accelerator memory).
        dtype: floating dtype to cast captured floating tensors to (e.g. ``torch.float16``
            halves memory); integer dtypes are refused.
        reduce: applied to each captured tensor at capture time: a named reduction as
            ``extract`` takes (``"mean"``, ``"first"``, ``"last"``; ``hookscope.reductions`` says
            which axis each uses), which counts only the real tokens of the ``attention_mask``
            the model is called with (by keyword or position), so its rows equal ``extract``'s;
            or a function of the output, e.g. ``lambda t: t.mean(dim=(2, 3))`` keeps
            ``(batch, channels)``. With ``grads=True`` each gradient is reduced the same way
            (with the mask of its own forward), so ``acts.grad(path)`` has the shape of
            ``acts[path]``; inputs and their gradients (``grad_inputs``) are kept whole.
        clone: ``None`` (default) keeps each tensor copy-on-write: nothing is copied unless a
            later in-place op writes it, and then only that tensor, just before the write (the
            writer gets the copy; exact in every grad mode, see ``engine.values.copy_on_write``); ``True``
            copies every tensor at once; ``False`` keeps plain references: values overwritten
            later raise on reading, except under ``torch.inference_mode()``, whose tensors have
            no version counter (a warning says so).
        early_stop: stop the forward pass once every selected module has returned in it: the
            rest of the model does not run (faster in proportion), the forward call does not
            return, and the ``with`` block ends there, cleanly (hooks removed, model untouched,
            records kept): make the forward the block's last statement, or use
            ``run(..., options={"early_stop": True})``, which returns ``(None, acts)``. A module
            called again later in the same pass (shared weights) keeps its first call only.
        on_unfired: what to do on exit about selected modules that never ran: ``"warn"``
            (``HookNeverFiredWarning``), ``"error"`` (``HookNeverFiredError``, raised after the
            forward finished, records still in ``err.capture``) or ``"ignore"``.

    Returns:
        A ``Capture`` (not yet active: hooks are added by ``with``).

    The forwards in the block are the user's own: their effects stay (a model in training mode
    updates its BatchNorm statistics, advances spectral norm, draws dropout masks), as without
    the capture. The verbs that run forwards of their own (``tree``, ``stats``, ``gradcam`` ...)
    restore the model afterwards instead.

    Raises:
        SelectorError: at once, before any hook exists, when a pattern matches nothing or names a
            container (``ModuleList``) whose hook could never fire.
        CaptureError: on entering the block, with ``grads``/``grad_inputs``, under
            ``torch.no_grad()`` or ``torch.inference_mode()``: no gradient could be recorded
            there (the message gives the fix: ``torch.enable_grad()``, or leave inference
            mode; switching gradients off inside the block is allowed and marks ``NoGrad``).
        ReductionError: ``reduce`` is not a known name or a function (at once); a ``reduce``
            function that returns something other than a tensor (at its first call).
        ArgumentTypeError: at once, ``model`` is not an ``nn.Module``; a flag (``inputs``,
            ``grads``, ``grad_inputs``, ``clone``, ``early_stop``) is not a ``bool``
            (``grads="yes"`` is refused, not read as true); ``to``/``dtype`` of the wrong type.
        ArgumentValueError: at once, ``to`` is not a device this machine has
            (``"nodevice"``, ``"cuda:7"``); ``dtype`` is not floating (``torch.int8`` would
            truncate every activation).
        HookscopeError: the model cannot be hooked (TorchScript), or an option is invalid.
    """
    if early_stop and (grads or grad_inputs):
        raise CaptureError("early_stop=True ends the forward before the model's output exists, so "
                           "no loss and no backward pass can reach the captured modules: drop "
                           "early_stop to record gradients (grads=True / grad_inputs=True)")
    _check_options(inputs=inputs, grads=grads, grad_inputs=grad_inputs, early_stop=early_stop,
                   to=to, dtype=dtype, clone=clone)
    reducer = reduction(reduce)
    options = CaptureOptions(inputs=inputs, grads=grads, grad_inputs=grad_inputs, to=to, dtype=dtype,
                             reduce=reducer,
                             clone=clone, early_stop=early_stop)
    return Capture(model, flat_patterns(layers), options, on_unfired)


def _check_options(*, to: object, dtype: object, clone: object, **flags: object) -> None:
    """Refuse a bad capture option at construction (``engine.checks``): a flag that is not a
    bool, a device torch cannot parse or this machine lacks, a dtype that is not floating."""
    for name, value in flags.items():
        check_flag(name, value)
    if clone is not None:
        check_flag("clone", clone)
    check_device("to", to)
    check_dtype("dtype", dtype, floating=True)


def run(model: nn.Module, *args: Any, layers: str | Sequence[str],
        options: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Any, Capture]:
    """Run ``model(*args, **kwargs)`` once while capturing ``layers``; return (output, records).

    Args:
        model: the model to run.
        *args, **kwargs: passed to ``model``. A mapping given as the only input (a dict, the
            ``BatchEncoding`` a Hugging Face tokenizer returns) is passed as keyword arguments,
            ``model(**mapping)``, when its keys are parameters of ``model.forward``.
        layers: one pattern or a list of patterns (see ``capture``).
        options: keyword options of ``capture`` (``inputs``, ``grads``, ``grad_inputs``, ``to``,
            ``dtype``, ``reduce``, ``clone``, ``early_stop``, ``on_unfired``). They travel in
            one dict, not as keywords, because ``**kwargs`` belong to the model: a forward that
            takes ``inputs=``, ``to=`` or ``dtype=`` (Hugging Face models take
            ``inputs_embeds``, ``output_attentions``, ...) must get them untouched, and a capture
            option spelled as a keyword could silently shadow one of them.

    Returns:
        ``(output, acts)``: what the model returned (``None`` when ``early_stop`` cut it
        short), and the ``Capture``.

    Raises:
        As ``capture``; an exception inside the forward pass propagates with a note naming the
        innermost module where it happened.
        CaptureError: a keyword is a capture option (``grads=True``) that ``model.forward``
            does not name as a parameter: it would reach the model's ``**kwargs`` silently.
        ArgumentTypeError: ``options`` is not a dict, or ``layers`` is ``None``.
        ArgumentValueError: ``options`` holds a key that is not an option of ``capture``.
    """
    check_model(model)
    patterns = as_patterns(layers)
    check_options("options", options, capture_options())
    _refuse_options_as_keywords(model, kwargs)
    args, kwargs = _as_keywords(model, args, kwargs)
    output = None
    block = capture(model, *patterns, **(options or {}))
    with block as acts:
        output = model(*args, **kwargs)
    return output, acts


def capture_options() -> set[str]:
    """The names of ``capture``'s keyword options (what ``run(options=)`` and
    ``capture_generation(**options)`` may hold)."""
    return set(inspect.signature(capture).parameters) - {"model", "layers"}


def _refuse_options_as_keywords(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise when a keyword meant for ``capture`` would go to the model's ``**kwargs``."""
    options = capture_options()
    try:
        named = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        named = set()
    misplaced = sorted(k for k in kwargs if k in options and k not in named)
    if misplaced:
        given = ", ".join(f"{k}={kwargs[k]!r}" for k in misplaced)
        raise CaptureError(
            f"hookscope.run got {given} as a keyword: run passes keywords to the model, and "
            f"{type(model).__name__}.forward has no parameter {misplaced[0]!r} (it would reach "
            f"its **kwargs silently). For the capture option write options={{"
            f"{', '.join(f'{k!r}: {kwargs[k]!r}' for k in misplaced)}}}; for a keyword of the "
            f"model's own, call it inside the block: with hookscope.capture(model, ...) as acts: "
            f"model(..., {given})")


def _as_keywords(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A mapping given as the one input (a dict, a tokenizer's ``BatchEncoding``) becomes keyword
    arguments, as ``extract`` passes a dict batch, when its keys name ``forward``'s parameters;
    a model whose ``forward`` takes the mapping itself gets it unchanged."""
    if len(args) != 1 or kwargs or not isinstance(args[0], Mapping):
        return args, kwargs
    try:
        inspect.signature(model.forward).bind(**args[0])
    except (TypeError, ValueError):
        return args, kwargs
    return (), dict(args[0])
