"""Linear probes on a store: does a layer's activation predict a label, more than chance?

For each chosen layer, a multinomial logistic regression (a linear map to class logits, softmax
cross-entropy, L2 penalty) is fitted on the training rows and scored on held-out rows. Memory
is bounded: rows are read ``chunk`` at a time, the objective and its gradient are summed over
the chunks, and ``torch.optim.LBFGS`` takes steps on that exact full-data objective, so the
fit is the same as scikit-learn's ``LogisticRegression(C=C)`` (lbfgs solver) on the same data,
which minimises ``C * sum(cross-entropy) + ||W||^2 / 2`` (the bias is not penalised). Features
are standardised with the training rows' mean and standard deviation (one streamed pass).

**Tokens.** With ``tokens=True`` each example is one token of a ragged (per-token) layer, read
through the store's token view (``store.tokens(layer)``, ``store.tokens``): a ``(d,)`` feature
vector per real token, a label per token (default: the label of the row it came from), the
split drawn over tokens. The control task's types are then the token ids when the store keeps
them (Hewitt and Liang's control task gives each *word type* one random label), else each token
its own.

Selectivity (Hewitt and Liang, "Designing and Interpreting Probes with Control Tasks", EMNLP
2019): the same probe is fitted to a *control task* whose labels carry no information about
the activation beyond what memorising a type gives. Each type (``control_types``; default:
each row its own type) gets a random label drawn from the task's label distribution, and
``selectivity = accuracy - control_accuracy`` on the held-out rows. A probe that only
memorises scores as high on the control task; a layer that encodes the label scores higher on
the real one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from hookscope.engine import check_flag, check_int, check_number
from hookscope.errors import ArgumentTypeError, ArgumentValueError, StoreError
from hookscope.store.reader import Store, open_store
from hookscope.store.tokens import TokenView, _packed_length

__all__ = ["LayerProbe", "ProbeResult", "probe"]

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class LayerProbe:
    """One layer's probe.

    Attributes:
        layer: the layer by the name it was extracted by (``"resid_post.1"``; the store's
            ``paths`` gives its module path).
        accuracy: held-out accuracy of the task probe, in [0, 1].
        control_accuracy: held-out accuracy of the same probe on the control task.
        selectivity: ``accuracy - control_accuracy``.
        train_accuracy: accuracy on the training rows.
        chance: accuracy of always answering the most frequent training label.
        features: number of features (the row's elements).
    """

    layer: str
    accuracy: float
    control_accuracy: float
    selectivity: float
    train_accuracy: float
    chance: float
    features: int


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """``probe``'s result: ``layers`` (one ``LayerProbe`` each, in the order asked), the
    class names, and the rows used for training and testing."""

    layers: list[LayerProbe]
    classes: list[Any]
    train_rows: int
    test_rows: int

    def __getitem__(self, layer: str) -> LayerProbe:
        return next(p for p in self.layers if p.layer == layer)

    def plot(self, out: str | Path) -> Path:
        """Draw held-out accuracy and control accuracy per layer as a PNG; return its path.

        Raises:
            MissingExtraError: matplotlib is not installed.
        """
        from hookscope.util import new_figure, save_figure
        figure = new_figure("hookscope probe")
        ax = figure.subplots()
        xs = range(len(self.layers))
        ax.plot(xs, [p.accuracy for p in self.layers], marker="o", label="task")
        ax.plot(xs, [p.control_accuracy for p in self.layers], marker="x", label="control task")
        ax.axhline(self.layers[0].chance if self.layers else 0, color="grey", linestyle=":",
                   label="majority class")
        ax.set_xticks(list(xs), [p.layer for p in self.layers], rotation=45, fontsize=6)
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1.05)
        ax.legend()
        return save_figure(figure, Path(out))


def probe(store: Store | str | Path, layers: Sequence[str] | None = None, *,
          labels: Sequence[Any] | Tensor | None = None, test_fraction: float = 0.2,
          C: float = 1.0, max_iter: int = 100, chunk: int = 4096,
          control_types: Sequence[Any] | Tensor | None = None, seed: int = 0,
          tokens: bool = False) -> ProbeResult:
    """Fit a logistic probe per layer of ``store`` and score it on held-out rows.

    Args:
        store: an open ``Store``, or its folder or URL (``open_store``).
        layers: layers to probe (default: every fixed-shape layer; with ``tokens``, every
            ragged one). Each row is flattened: a ``(d,)`` row has ``d`` features, a ``(seq,
            d)`` row ``seq * d``.
        labels: one label per row (ints or strings); default ``store.labels``. With
            ``tokens``: one per token of the token view, default each token's row's label.
        test_fraction: share of rows held out (a seeded random split, the same for every layer).
        C: inverse L2 strength, as scikit-learn's ``LogisticRegression(C=...)``.
        max_iter: LBFGS iterations (each one streamed pass over the training rows, or a few).
        chunk: rows read at once: the memory bound (``chunk * features`` float64 values).
        control_types: one key per row (token) for the control task (rows with the same key
            get the same random label); default each row its own, with ``tokens`` each token
            id its own (each token its own when the store keeps no ids).
        seed: the split's and the control labels' random seed.
        tokens: probe each token of ragged layers (module docstring) instead of each row.

    Returns:
        A ``ProbeResult`` (``result[layer].accuracy``, ``.selectivity``; ``result.plot(path)``).

    Raises:
        StoreError: the store has no labels and none are given, a layer is ragged (not ragged,
            with ``tokens``) or unknown, the number of labels is not the number of rows
            (tokens), two ragged layers hold different numbers of tokens, or a row read holds
            NaN or an infinity (named: a probe of it would score with the planted signal lost).
        ArgumentTypeError: ``C``, ``test_fraction`` not real numbers; ``max_iter``, ``chunk``,
            ``seed`` not ints; ``tokens`` not a bool; ``layers`` not strs.
        ArgumentValueError: ``test_fraction`` not in (0, 1), ``C`` not a finite number > 0,
            ``max_iter`` or ``chunk`` below 1, ``seed`` below 0, a label or control type that
            is NaN or infinite, fewer than 2 classes, or a split leaving no training or no
            test row.
    """
    _check_options(C=C, max_iter=max_iter, chunk=chunk, seed=seed, tokens=tokens)
    if isinstance(layers, str):
        layers = [layers]
    if layers is not None and (not isinstance(layers, (list, tuple))
                               or not all(isinstance(name, str) for name in layers)):
        raise ArgumentTypeError(f"layers must be None, a layer name or a list of them, e.g. "
                                f"layers=['fc1']; got {type(layers).__name__} {layers!r:.60}")
    if not isinstance(store, Store):  # opened here: closed here (its maps, a remote cache)
        with open_store(store) as opened:
            return probe(opened, layers, labels=labels, test_fraction=test_fraction, C=C,
                         max_iter=max_iter, chunk=chunk, control_types=control_types, seed=seed,
                         tokens=tokens)
    chosen = _layers(store, layers, tokens)
    examples = _examples(store, chosen, tokens)
    targets, classes = _label_ids(store, labels, examples)
    check_number("test_fraction", test_fraction)
    if not 0 < test_fraction < 1:
        raise ArgumentValueError(f"test_fraction={test_fraction}: pass a share in (0, 1), e.g. 0.2")
    if len(classes) < 2:
        raise ArgumentValueError(f"a probe needs at least 2 classes; the labels hold {classes!r}")
    n = len(targets)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    test, train = order[:n_test].sort().values, order[n_test:].sort().values
    if len(test) == 0 or len(train) == 0:
        raise ArgumentValueError(f"{n} rows with test_fraction={test_fraction}: the split leaves "
                                 "no test or no training row; use more rows")
    if control_types is None and examples is not None:
        control_types = examples.ids  # word types (Hewitt and Liang); None: each token its own
    control = _control_labels(targets, train, control_types, seed)
    fits = [_probe_layer(_reader(store, layer, tokens), layer, targets, control, train, test,
                         len(classes), C, max_iter, chunk) for layer in chosen]
    return ProbeResult(fits, classes, len(train), len(test))


def _check_options(*, C: Any, max_iter: Any, chunk: Any, seed: Any, tokens: Any) -> None:
    """Raise naming the first option of ``probe`` out of its domain (before any read)."""
    check_number("C", C)
    if not C > 0:
        raise ArgumentValueError(f"C={C}: the inverse L2 strength must be > 0 (C=0 would "
                                 f"ignore the data, C<0 reward large weights); pass e.g. C=1.0")
    check_int("max_iter", max_iter, minimum=1)
    check_int("chunk", chunk, minimum=1)
    check_int("seed", seed, minimum=0)
    check_flag("tokens", tokens)


def _finite_keys(what: str, values: list[Any]) -> None:
    """Raise ``ArgumentValueError`` when a float in ``values`` (labels, control types) is NaN
    or infinite: NaN != NaN, so each one would become a class of its own."""
    for i, value in enumerate(values):
        if isinstance(value, float) and not math.isfinite(value):
            raise ArgumentValueError(f"{what}[{i}] is {value}: each {what[:-1]} must be a "
                                     f"finite number or a str; drop that row or give it a label")


def _layers(store: Store, layers: Sequence[str] | None, tokens: bool) -> list[str]:
    """The layers to probe: fixed-shape ones for rows; for tokens, ragged ones and those of
    packed windows (fixed ``(seq, ...)`` rows beside ``(seq,)`` token ids: ``TokenView``); each by
    the name it was extracted by (``store.paths``: ``"resid_post.1"``, not ``"transformer.h.1"``)."""
    asked = {layer: name for name, layer in store.paths.items()}
    fitting = [asked[layer] for layer, info in store.layers.items()
               if (info.ragged or (tokens and _packed_length(store, info) is not None)) == tokens]
    chosen = ([asked.get(store.standard_names.get(layer, layer), layer) for layer in layers]
              if layers is not None else fitting)
    for layer in chosen:
        if layer not in fitting:
            raise StoreError(
                f"layer {layer!r}: probe(tokens={tokens}) reads "
                f"{'ragged (per-token)' if tokens else 'fixed-shape'} layers; the store has "
                f"{fitting}" + ("" if tokens else "; pass tokens=True to probe the tokens of a "
                                               "ragged layer"))
    return chosen


def _examples(store: Store, chosen: list[str], tokens: bool) -> TokenView | None:
    """The token view of the first layer (``None`` for rows), after checking that every chosen
    layer holds as many tokens."""
    if not tokens or not chosen:
        return None
    views = [store.tokens(layer) for layer in chosen]
    counts = {layer: len(view) for layer, view in zip(chosen, views, strict=True)}
    if len(set(counts.values())) > 1:
        raise StoreError(f"the ragged layers hold different numbers of tokens {counts}: probe "
                         f"them one call each, with labels for that layer's tokens")
    return views[0]


def _reader(store: Store, layer: str, tokens: bool) -> Callable[[Tensor], Tensor]:
    """``read(indices)``: the examples at ascending ``indices`` of ``layer`` (rows, or tokens of
    its token view), one tensor."""
    if tokens:
        view = store.tokens(layer)
        return lambda index: view.read(index.numpy())
    rows = store[layer]

    def read(index: Tensor) -> Tensor:
        block = rows[index]
        assert isinstance(block, Tensor)
        return block
    return read


def _label_ids(store: Store, labels: Sequence[Any] | Tensor | None,
               examples: TokenView | None) -> tuple[Tensor, list[Any]]:
    """``(class index per example (int64), class values sorted)``; an example is a row, or a
    token of ``examples`` (default label: its row's)."""
    given = store.labels if labels is None else labels
    if given is None:
        raise StoreError(f"store {store.path} has no labels: pass labels=[one per row] (or "
                         "extract from (inputs, labels) batches)")
    if isinstance(given, (str, bytes, dict)) or not hasattr(given, "__len__"):
        raise ArgumentTypeError(f"labels must be a tensor or a list of one label per row; got "
                                f"{type(given).__name__}")
    values = given.reshape(-1).tolist() if isinstance(given, Tensor) else list(given)
    _finite_keys("labels", values)
    count, what = (len(store), "row") if examples is None else (len(examples), "token")
    if labels is None and examples is not None:
        values = [values[r] for r in examples.rows.tolist()]
    if len(values) != count:
        raise StoreError(f"{len(values)} labels for {count} {what}s: pass one label per {what}")
    classes = sorted(set(values), key=str)
    lookup = {value: i for i, value in enumerate(classes)}
    return torch.tensor([lookup[v] for v in values], dtype=torch.int64), classes


def _control_labels(targets: Tensor, train: Tensor, types: Sequence[Any] | Tensor | None,
                    seed: int) -> Tensor:
    """A random label per type, drawn from the training labels' distribution (Hewitt and Liang
    2019), given to each row of that type."""
    keys = (list(range(len(targets))) if types is None else
            types.reshape(-1).tolist() if isinstance(types, Tensor) else list(types))
    if len(keys) != len(targets):
        raise StoreError(f"{len(keys)} control_types for {len(targets)} rows: pass one per row")
    _finite_keys("control_types", keys)
    distinct = list(dict.fromkeys(keys))
    g = torch.Generator().manual_seed(seed + 1)
    drawn = targets[train][torch.randint(len(train), (len(distinct),), generator=g)]
    label_of = dict(zip(distinct, drawn.tolist(), strict=True))
    return torch.tensor([label_of[k] for k in keys], dtype=torch.int64)


def _chunks(read: Callable[[Tensor], Tensor], rows: Tensor,
            chunk: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``(indices, float64 features (k, features))`` for ``rows``, ``chunk`` at a time.

    Raises:
        StoreError: a row holds NaN or an infinity (the example named).
    """
    for start in range(0, len(rows), chunk):
        index = rows[start:start + chunk]
        x = read(index).reshape(len(index), -1).double()
        finite = torch.isfinite(x).all(dim=1)
        if not bool(finite.all()):
            bad = int(index[int((~finite).nonzero()[0])])
            raise StoreError(f"example {bad} (a row, or a token with tokens=True) holds NaN or "
                             f"an infinity: a probe fitted on it would score with its signal "
                             f"lost. Leave such rows out (pass labels and a store without them), "
                             f"or find where they come from (hookscope nan)")
        yield index, x


def _probe_layer(read: Callable[[Tensor], Tensor], layer: str, targets: Tensor, control: Tensor,
                 train: Tensor, test: Tensor, classes: int, C: float, max_iter: int,
                 chunk: int) -> LayerProbe:
    try:
        return _fit_layer(read, layer, targets, control, train, test, classes, C, max_iter, chunk)
    except StoreError as err:
        raise StoreError(f"layer {layer!r}: {err}") from None


def _fit_layer(read: Callable[[Tensor], Tensor], layer: str, targets: Tensor, control: Tensor,
               train: Tensor, test: Tensor, classes: int, C: float, max_iter: int,
               chunk: int) -> LayerProbe:
    mean, std = _moments(read, train, chunk)

    def scaled(rows: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        for index, x in _chunks(read, rows, chunk):
            yield index, (x - mean) / std

    task = _fit(scaled, train, targets, classes, C, max_iter)
    ctrl = _fit(scaled, train, control, classes, C, max_iter)
    counts = torch.bincount(targets[train], minlength=classes)
    accuracy = _accuracy(task, scaled, test, targets)
    control_accuracy = _accuracy(ctrl, scaled, test, control)
    return LayerProbe(layer=layer, accuracy=accuracy, control_accuracy=control_accuracy,
                      selectivity=accuracy - control_accuracy,
                      train_accuracy=_accuracy(task, scaled, train, targets),
                      chance=float(counts.max()) / len(train), features=mean.numel())


def _moments(read: Callable[[Tensor], Tensor], rows: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Mean and population std of each feature over ``rows`` (float64, one streamed pass);
    a constant feature's std is 1 (it stays 0 after centring)."""
    total = count = square = None
    for _, x in _chunks(read, rows, chunk):
        total = x.sum(0) if total is None else total + x.sum(0)
        count = len(x) if count is None else count + len(x)
    assert total is not None and count is not None
    mean = total / count
    for _, x in _chunks(read, rows, chunk):
        part = (x - mean).square().sum(0)
        square = part if square is None else square + part
    assert square is not None
    std = (square / count).sqrt()
    return mean, torch.where(std > 0, std, torch.ones_like(std))


def _fit(scaled: Any, train: Tensor, targets: Tensor, classes: int, C: float,
         max_iter: int) -> tuple[Tensor, Tensor]:
    """``(W (features, classes), b (classes,))`` minimising ``C * sum(CE) + ||W||^2 / 2`` by
    LBFGS on the streamed full-data objective. Two classes are scikit-learn's binary model: one
    weight vector, the logit of class 1 over class 0 (class 0's column is zero); a softmax over
    two penalised vectors would put ``||w||^2 / 4`` on their difference ``w``, i.e. fit ``2 C``."""
    first = next(iter(scaled(train[:1])))[1]
    width = 1 if classes == 2 else classes
    weight = torch.zeros(first.shape[1], width, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(width, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter,
                                  tolerance_grad=1e-9, tolerance_change=1e-12,
                                  history_size=20, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        total = 0.5 * weight.square().sum()
        total.backward()  # type: ignore[no-untyped-call]
        value = float(total.detach())
        for index, x in scaled(train):
            loss = C * torch.nn.functional.cross_entropy(_logits(x @ weight + bias), targets[index],
                                                         reduction="sum")
            loss.backward()  # type: ignore[no-untyped-call]  # adds up chunk by chunk: bounded memory
            value += float(loss.detach())
        return torch.tensor(value, dtype=torch.float64)

    with torch.enable_grad():
        optimizer.step(closure)  # type: ignore[no-untyped-call]
    if classes == 2:  # class 0's logit is 0: W (features, 2), b (2,)
        return _logits(weight.detach()), _logits(bias.detach()[None])[0]
    return weight.detach(), bias.detach()


def _logits(z: Tensor) -> Tensor:
    """``(rows, classes)`` logits from ``(rows, width)``: two classes (width 1) get class 0's
    logit 0 in front."""
    return torch.cat([torch.zeros_like(z), z], 1) if z.shape[1] == 1 else z


def _accuracy(fit: tuple[Tensor, Tensor], scaled: Any, rows: Tensor, targets: Tensor) -> float:
    weight, bias = fit
    right = 0
    for index, x in scaled(rows):
        right += int(((x @ weight + bias).argmax(1) == targets[index]).sum())
    return right / len(rows) if len(rows) else math.nan
