"""Private: keep captured values equal to what modules returned, despite later in-place writes.

A later in-place write (``ReLU(inplace=True)``, ``x += y``, ``x[i] = v``, ``out=``) changes a
tensor kept by reference. Copying every output costs a copy of every activation; hookscope
copies only the tensors that really get written, and only when the write happens.

It keeps each captured tensor as a *lazy clone* (``torch._lazy_clone``): a new tensor sharing
the same memory as copy-on-write storage (PyTorch's ``c10::impl::cow``; design in
https://github.com/pytorch/pytorch/pull/100818, operator in
https://github.com/pytorch/pytorch/pull/100821). Reading either tensor copies nothing; the
first write to either one, by any op, view, ``out=`` argument or ``.numpy()`` array, first gives
the writer its own copy, so the kept value never changes. This holds under
``torch.inference_mode()``, ``torch.no_grad()`` and grad mode alike (it needs no version
counter), decides nothing in advance (no learning pass) and holds no state outside the tensors.

A lazy clone costs about what ``detach()`` costs. Some CPU kernels still ask for a writable
pointer to an input they only read (torch 2.13: the 1x1, stride-1 ``Conv2d`` path,
``aten::_slow_conv2d_forward``), which copies that input once, as a write would; PR 100821 above
names this audit as unfinished. Its one visible effect: a tensor that is
written after capture moves to new memory, so a raw pointer taken *before* capture
(``data_ptr()``) no longer sees its writes. Layouts without plain storage (sparse, nested) are
copied at once instead, and so are tensors in hooks that ``torch.compile`` traces (dynamo
cannot trace a lazy clone; inside a compiled graph the copy is planned with the rest).

``clone=False`` keeps plain references (``detach()``) and checks their version counters when the
capture ends: a value overwritten in between is reported and raises on reading. Inference tensors
have no version counter, so there the check cannot be made (a warning says so).
"""

from __future__ import annotations

import torch

__all__ = ["eager_copy", "lazy_copy", "shares_memory", "version_of"]

Tensor = torch.Tensor

lazy_clone = torch._lazy_clone
compiling = torch.compiler.is_dynamo_compiling  # True only where dynamo traces (is_compiling: any thread)


def lazy_copy(t: Tensor) -> Tensor:
    """A detached tensor equal to ``t`` now and unchanged by later in-place writes to ``t``."""
    if t.requires_grad:
        t = t.detach()
    if compiling():  # hooks traced by torch.compile: dynamo cannot trace a lazy clone
        return t.clone()
    try:
        return lazy_clone(t)
    except (NotImplementedError, RuntimeError):  # sparse, nested: no copy-on-write storage
        return t.clone()


def eager_copy(t: Tensor) -> Tensor:
    """A detached copy of ``t`` made now (``clone=True``)."""
    return t.detach().clone()


def version_of(t: Tensor) -> int | None:
    """``t._version``, or None for inference tensors, which have no version counter."""
    return None if t.is_inference() else t._version


def shares_memory(kept: Tensor, original: Tensor) -> bool:
    """True when ``kept`` (a detached, converted or reduced ``original``) aliases its memory."""
    if kept is original or kept._base is original or kept._base is original._base is not None:
        return True
    try:  # the storage objects themselves: data_ptr() would materialize a copy-on-write one
        return bool(kept.untyped_storage()._cdata == original.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, some subclasses)
        return False
