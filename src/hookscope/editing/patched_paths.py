"""Path patching: the effect of senders on a metric through chosen receivers only.

Wang et al., "Interpretability in the Wild: a Circuit for Indirect Object Identification in GPT-2
small" (2022, arXiv:2211.00593), section 3.1 and appendix B. A path from senders ``S`` to
receivers ``R`` is measured in three runs on the clean input:

1. the clean and the corrupted run, recording every head's ``attn.z`` (its output before the
   output projection) and every MLP's output;
2. the clean input again, the senders' outputs set to their corrupted values and every other
   attention head frozen to its clean value (MLPs recomputed, so paths through MLPs count, as in
   the paper; ``direct=True`` freezes them too), recording what the receivers read: a receiver
   head's query, key or value (``through``), a receiver MLP's input;
3. the clean input once more with only the receivers' inputs patched to the values of run 2;
   ``metric`` of its output is the path-patched metric. With ``logits`` as the receiver (the
   final residual stream), run 2's output is already that run.

The senders' effect thus reaches the metric only through the receivers' chosen inputs (and,
between senders and receivers, through MLPs). Nodes are named as in edge attribution:
``a{l}.h{h}`` (head ``h`` of block ``l``), ``m{l}`` (MLP ``l``), ``logits``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookscope.editing.edits import edit
from hookscope.editing.sweep import Metric, _forward, _number, _plain, check_metric
from hookscope.engine import (
    ModuleIndex,
    blocks_of,
    check_flag,
    check_model,
    index,
    one_index_per_call,
    untouched,
    warn_if_dropout_trains,
)
from hookscope.errors import ArgumentTypeError, ArgumentValueError, EditError, SelectorError
from hookscope.record import capture

__all__ = ["PathPatch", "path_patching"]

Tensor = torch.Tensor
_NODE = re.compile(r"a(\d+)\.h(\d+)|m(\d+)|logits")


@dataclass(frozen=True)
class PathPatch:
    """``path_patching``'s result: ``value`` (the metric with the path patched), ``clean`` and
    ``corrupted`` (the metric of the two runs unpatched)."""

    value: float
    clean: float
    corrupted: float

    def normalized(self) -> float:
        """``(value - clean) / (corrupted - clean)``: 0 where the path carries nothing of the
        corruption's effect, 1 where it carries all of it (Wang et al.'s figures read this way).

        Raises:
            EditError: the clean and corrupted metrics are equal.
        """
        if self.corrupted == self.clean:
            raise EditError(f"the clean and corrupted metrics are both {self.clean:.6g}: the "
                            f"corruption changes nothing to carry; choose inputs or a metric on "
                            f"which the runs differ")
        return (self.value - self.clean) / (self.corrupted - self.clean)


@dataclass(frozen=True)
class _Node:
    kind: str      # "head", "mlp", "logits"
    layer: int
    head: int = -1

    @property
    def place(self) -> int:
        """Where it runs: block ``l``'s heads ``2l``, its MLP ``2l + 1``, the logits last."""
        return 1 << 30 if self.kind == "logits" else 2 * self.layer + (self.kind == "mlp")


@one_index_per_call
def path_patching(model: nn.Module, clean: Any, corrupted: Any, *, senders: Sequence[str],
                  receivers: Sequence[str], metric: Metric, through: str = "qkv",
                  direct: bool = False) -> PathPatch:
    """Patch the path from ``senders`` to ``receivers`` (Wang et al. 2022; module docstring).

    ```python
    # how much do the heads 0.1 and 0.3 change the logit difference through the queries of 1.2?
    found = hookscope.path_patching(gpt2, clean_ids, corrupt_ids, senders=["a0.h1", "a0.h3"],
                                    receivers=["a1.h2"], through="q", metric=logit_diff)
    found.value, found.normalized()
    ```

    Four forwards under ``torch.no_grad()`` (three with ``logits`` as the only receiver); the
    model is left as it was found (``engine.run.untouched``). Call ``model.eval()`` first.

    Args:
        model: a transformer whose standard names ``attn.z.{l}``, ``attn.q/k/v.{l}`` and
            ``mlp_out.{l}`` resolve and whose blocks have an ``mlp`` (GPT-2, GPT-NeoX, Llama,
            Mistral, Qwen2, Gemma, Phi, a ``HookedTransformer``).
        clean, corrupted: model inputs of the same shape (tensor, dict, tuple); every position
            is patched.
        senders: ``"a{l}.h{h}"`` heads and ``"m{l}"`` MLPs whose corrupted outputs are sent.
        receivers: ``"a{l}.h{h}"`` heads (read through ``through``), ``"m{l}"`` MLPs (their
            input) or ``"logits"`` (the final residual stream); each after some sender.
        metric: ``metric(output) -> number`` (a float or a one-element tensor).
        through: the receiver heads' inputs the path goes through: ``"q"``, ``"k"``, ``"v"`` or
            several (``"qk"``, ``"qkv"``). Under grouped-query attention a key-value head is read
            by a group of query heads: with ``k`` or ``v``, name the whole group as receivers.
        direct: freeze the MLPs to the clean run too, so only direct paths (through the residual
            stream alone) count.

    Returns:
        A ``PathPatch`` (``value``, ``clean``, ``corrupted``, ``normalized()``).

    Raises:
        ArgumentTypeError, ArgumentValueError: a node not named as above or outside the model,
            no receiver after a sender, ``through`` not letters of ``"qkv"``, a k/v receiver
            without its whole group; ``metric`` not callable.
        SelectorError: a standard name does not resolve; a block has no ``mlp``.
        EditError: the two inputs give activations of different shapes; ``metric`` does not
            return one number; a head output runs more than once.
    """
    check_model(model)
    check_metric(metric)
    check_flag("direct", direct)
    names = index(model)
    layers = blocks_of(names, "path_patching").count
    sending = [_parse("senders", node, layers, allow=("head", "mlp")) for node in _listed("senders", senders)]
    receiving = [_parse("receivers", node, layers, allow=("head", "mlp", "logits"))
                 for node in _listed("receivers", receivers)]
    _check_through(through)
    _check_order(sending, receiving)
    heads = _configured_heads(model)
    for node in (*sending, *receiving):
        if heads is not None and node.kind == "head":
            _check_head(node, heads)
    warn_if_dropout_trains(model, "path_patching")
    clean, corrupted = _plain(clean), _plain(corrupted)
    with untouched(model), torch.no_grad():
        found = _patch(model, names, layers, clean, corrupted, sending, receiving, metric, through,
                       direct)
    return found


def _listed(name: str, nodes: object) -> list[str]:
    if isinstance(nodes, str) or not isinstance(nodes, Sequence) or not nodes \
            or not all(isinstance(n, str) for n in nodes):
        raise ArgumentTypeError(f"{name} must be a non-empty list of node names such as "
                                f"['a0.h1', 'm0']; got {nodes!r:.60}")
    return list(nodes)


def _parse(name: str, node: str, layers: int, allow: tuple[str, ...]) -> _Node:
    match = _NODE.fullmatch(node)
    kind = None if match is None else "head" if match.group(1) else "mlp" if match.group(3) else "logits"
    if match is None or kind not in allow:
        shown = {"head": "'a{l}.h{h}' (a head)", "mlp": "'m{l}' (an MLP)", "logits": "'logits'"}
        raise ArgumentValueError(f"{name}: {node!r} is not a node; name "
                                 f"{' or '.join(shown[k] for k in allow)}")
    if kind == "logits":
        return _Node("logits", layers)
    layer = int(match.group(1) or match.group(3))
    if layer >= layers:
        raise ArgumentValueError(f"{name}: {node!r} names block {layer}; the model has {layers} "
                                 f"blocks (0 … {layers - 1})")
    return _Node(kind, layer, int(match.group(2)) if kind == "head" else -1)


def _check_through(through: object) -> None:
    if not isinstance(through, str) or not through or any(c not in "qkv" for c in through) \
            or len(set(through)) != len(through):
        raise ArgumentValueError(f"through={through!r}: give the receiver heads' inputs as letters "
                                 f"of 'qkv', each once: 'q', 'k', 'v', 'qk', 'qkv'")


def _check_order(senders: list[_Node], receivers: list[_Node]) -> None:
    if any(node.kind == "logits" for node in receivers) and len(receivers) > 1:
        raise ArgumentValueError("receivers: 'logits' receives everything that reaches the final "
                                 "residual stream; measure it in a call of its own")
    first = min(node.place for node in senders)
    for node in receivers:
        if node.place <= first:
            raise ArgumentValueError(f"receiver {_name(node)} runs before or with every sender "
                                     f"(first: {_name(min(senders, key=lambda n: n.place))}), so "
                                     f"no path reaches it: name receivers in later blocks")


def _name(node: _Node) -> str:
    return {"head": f"a{node.layer}.h{node.head}", "mlp": f"m{node.layer}", "logits": "logits"}[node.kind]


def _patch(model: nn.Module, names: ModuleIndex, layers: int, clean: Any, corrupted: Any,
           senders: list[_Node], receivers: list[_Node], metric: Metric, through: str,
           direct: bool) -> PathPatch:
    """The runs of the module docstring."""
    keys = [*(f"attn.z.{i}" for i in range(layers)), *(f"mlp_out.{i}" for i in range(layers))]
    clean_acts, clean_metric = _run(model, keys, clean, metric)
    corrupted_acts, corrupted_metric = _run(model, keys, corrupted, metric)
    _check_same_masks(clean_acts.layout(keys[0]).tokens.mask, corrupted_acts.layout(keys[0]).tokens.mask)
    frozen = _frozen(layers, clean_acts, corrupted_acts, senders, direct)
    if receivers[0].kind == "logits":  # run 2 is the answer
        with edit(model, frozen, on_unfired="error"):
            output = _forward(model, clean)
        return PathPatch(_number(metric(output)), clean_metric, corrupted_metric)
    outputs, inputs = _receivers_read(model, names, clean, frozen, receivers, through, clean_acts)
    with contextlib.ExitStack() as stack:
        if outputs:
            stack.enter_context(edit(model, outputs, on_unfired="error"))
        if inputs:
            stack.enter_context(edit(model, inputs, inputs=True, on_unfired="error"))
        value = _number(metric(_forward(model, clean)))
    return PathPatch(value, clean_metric, corrupted_metric)


def _run(model: nn.Module, keys: list[str], inputs: Any, metric: Metric) -> tuple[Any, float]:
    """One forward of ``inputs``: a capture of ``keys`` and the metric."""
    with capture(model, *keys, on_unfired="error") as acts:
        output = _forward(model, inputs)
    return acts, _number(metric(output))


def _frozen(layers: int, clean: Any, corrupted: Any, senders: list[_Node],
            direct: bool) -> dict[str, Callable[[Any], Any]]:
    """Run 2's output edits: each ``attn.z.{l}`` set to the clean run's, the sender heads' to
    the corrupted run's; each sender MLP's output to the corrupted run's, with ``direct`` every
    other MLP's to the clean run's."""
    found: dict[str, Callable[[Any], Any]] = {}
    for layer in range(layers):
        key = f"attn.z.{layer}"
        axis = _heads_axis(clean, key)
        value = clean[key].clone()
        other = _same_shape(key, clean[key], corrupted[key])
        for node in senders:
            if node.kind == "head" and node.layer == layer:
                _check_head(node, value.shape[axis])
                value.select(axis, node.head).copy_(other.select(axis, node.head))
        found[key] = _replace_with(value)
        key = f"mlp_out.{layer}"
        if any(node.kind == "mlp" and node.layer == layer for node in senders):
            found[key] = _replace_with(_same_shape(key, clean[key], corrupted[key]))
        elif direct:
            found[key] = _replace_with(clean[key])
    return found


def _receivers_read(model: nn.Module, names: ModuleIndex, clean: Any,
                    frozen: dict[str, Callable[[Any], Any]], receivers: list[_Node], through: str,
                    clean_acts: Any) -> tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]]]:
    """Run 2 with ``frozen``: what each receiver reads, returned as run 3's edits ``(output
    edits of attn.{q,k,v}.{l} setting the receiver heads, input edits of the receiver MLPs)``."""
    heads = [node for node in receivers if node.kind == "head"]
    mlps = {_mlp_path(names, node.layer): node for node in receivers if node.kind == "mlp"}
    read = [f"attn.{x}.{i}" for i in sorted({n.layer for n in heads}) for x in through]
    seen: dict[str, Tensor] = {}
    recorders = {path: _record_input(seen, path) for path in mlps}
    with contextlib.ExitStack() as stack:
        stack.enter_context(edit(model, frozen, on_unfired="error"))
        if recorders:
            stack.enter_context(edit(model, recorders, inputs=True, on_unfired="error"))
        acts: Any = stack.enter_context(capture(model, *read, on_unfired="error")) if read else None
        _forward(model, clean)
    outputs: dict[str, Callable[..., Any]] = {}
    for key in read:
        letter, layer = key.split(".")[1], int(key.rsplit(".", 1)[1])
        axis = _heads_axis(acts, key)
        query_heads = clean_acts[f"attn.z.{layer}"].shape[_heads_axis(clean_acts, f"attn.z.{layer}")]
        chosen = _kv_heads([n for n in heads if n.layer == layer], letter, acts[key].shape[axis],
                           query_heads)
        outputs[key] = _set_heads(acts[key], axis, chosen)
    return outputs, {path: _set_input(seen[path]) for path in mlps}


def _heads_axis(acts: Any, key: str) -> int:
    axis = acts.layout(key).heads
    assert isinstance(axis, int)  # attn.q/k/v/z are heads values (the layout table)
    return axis


def _mlp_path(names: ModuleIndex, layer: int) -> str:
    structure = blocks_of(names, "path_patching")
    path = f"{structure.blocks}.{layer}.mlp"
    if path not in names.modules:
        raise SelectorError(f"receiver m{layer}: block '{structure.blocks}.{layer}' has no 'mlp' "
                            f"module whose input path patching could set; name heads or 'logits' "
                            f"as receivers")
    return path


def _configured_heads(model: nn.Module) -> int | None:
    """The query heads per block its config names (checked again on the values), if any."""
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    for field in ("num_attention_heads", "n_head", "n_heads"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check_head(node: _Node, count: int) -> None:
    if node.head >= count:
        raise ArgumentValueError(f"{_name(node)}: block {node.layer} has {count} heads "
                                 f"(h0 … h{count - 1})")


def _kv_heads(receivers: list[_Node], letter: str, count: int, query_heads: int) -> list[int]:
    """The heads of ``attn.{letter}`` to set: the receivers' own for q (or without grouped-query
    attention); under it, for k and v, the key-value head of each receiver, whose whole group
    of query heads must be receivers (else other heads would read the patched key or value).

    Raises:
        ArgumentValueError: a receiver head outside the model, or a group only partly named.
    """
    for node in receivers:
        _check_head(node, query_heads)
    chosen = sorted({node.head for node in receivers})
    if count == query_heads:
        return chosen
    group = query_heads // count
    layer = receivers[0].layer
    for kv in sorted({h // group for h in chosen}):
        members = list(range(kv * group, (kv + 1) * group))
        if not set(members) <= set(chosen):
            named = ", ".join(f"a{layer}.h{h}" for h in members)
            raise ArgumentValueError(
                f"through='{letter}': block {layer} has {count} key-value heads for {query_heads} "
                f"query heads, so key-value head {kv} is read by {named} together; patching it for "
                f"some of them would reach the others too: name all of {named} as receivers, or "
                f"go through 'q' only")
    return sorted({h // group for h in chosen})


def _check_same_masks(clean: Tensor | None, corrupted: Tensor | None) -> None:
    """The runs' values are set into each other position by position, so their real tokens
    must sit at the same positions: the same attention mask, or none.

    Raises:
        EditError: the masks differ.
    """
    same = (clean is None and corrupted is None) or (
        clean is not None and corrupted is not None and clean.shape == corrupted.shape
        and torch.equal(clean.bool(), corrupted.bool()))
    if not same:
        raise EditError("path patching sets the corrupted run's values into the clean run position "
                        "by position, but their attention masks differ, so a real token would be "
                        "set against padding or another token: pad both inputs the same way "
                        "(the same attention_mask)")


def _same_shape(key: str, clean: Tensor, corrupted: Tensor) -> Tensor:
    if clean.shape != corrupted.shape:
        raise EditError(f"'{key}' is {tuple(clean.shape)} on the clean input and "
                        f"{tuple(corrupted.shape)} on the corrupted one; path patching sets one "
                        f"run's values into the other position by position: give two inputs of "
                        f"the same shape")
    return corrupted


def _replace_with(value: Tensor) -> Callable[[Any], Tensor]:
    def fn(old: Any) -> Tensor:
        return value.to(device=old.device, dtype=old.dtype) if isinstance(old, Tensor) else value
    return fn


def _set_heads(recorded: Tensor, axis: int, heads: list[int]) -> Callable[[Any], Tensor]:
    """An output edit setting ``heads`` (on ``axis``) to ``recorded``'s, the rest as computed."""
    def fn(old: Tensor) -> Tensor:
        new = old.clone()
        for h in heads:
            new.select(axis, h).copy_(recorded.select(axis, h))
        return new
    return fn


def _record_input(seen: dict[str, Tensor], path: str) -> Callable[..., Any]:
    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not args or not isinstance(args[0], Tensor):
            raise EditError(f"'{path}' was called without its input as the first positional "
                            f"argument; path patching sets an MLP called as mlp(x)")
        seen[path] = args[0].detach().clone()
        return args, kwargs
    return fn


def _set_input(value: Tensor) -> Callable[..., Any]:
    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (value.to(device=args[0].device, dtype=args[0].dtype), *args[1:]), kwargs
    return fn
