"""Row identity (issue 25): a store keeps each row's id and label, aligned with its activations
through resume; ``repr(store)``; a resume with other arguments names the flag that changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from hookscope.cli.main import main
from hookscope.errors import ExtractError, StoreCorruptError
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from hookscope.zoo.data import load_data
from hookscope.zoo.models import load_model
from tests.models import LeNet, MlpStack

X = torch.randn(11, 10, generator=torch.Generator().manual_seed(0))


def _fc1(rows: torch.Tensor) -> torch.Tensor:
    """What the store must hold for ``rows``: MlpStack's fc1 in plain PyTorch (seeded)."""
    torch.manual_seed(0)
    with torch.no_grad():
        return MlpStack().fc1(rows)


def _mlp() -> MlpStack:
    torch.manual_seed(0)
    return MlpStack()


class _Labelled(Dataset[tuple[torch.Tensor, Any]]):
    """Item ``i``: ``(X[i], labels[i])``; labels a tensor (default_collate stacks it) or strs."""

    def __init__(self, labels: Any):
        self.labels = labels

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        return X[i], self.labels[i]


_LABELS = {  # kind -> labels of the 11 rows, as a data set's items give them
    "int": torch.arange(11) % 3,
    "float vector": torch.linspace(0, 1, 22).reshape(11, 2),
    "str": [f"class-{i % 4}" for i in range(11)],
    "unicode str": ["chat é" if i % 2 else "" for i in range(11)],
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(_LABELS)), batch_size=st.integers(1, 5),
       order=st.permutations(range(11)).map(lambda p: p[:7]))
def test_ids_are_dataset_indices_and_labels_the_y_of_each_row(
        tmp_path_factory: pytest.TempPathFactory, kind: str, batch_size: int,
        order: list[int]) -> None:
    out = tmp_path_factory.mktemp("rows") / "s"
    labels = _LABELS[kind]
    data = DataLoader(_Labelled(labels), batch_size=batch_size, sampler=order)
    store = extract(_mlp(), data, "fc1", out, shard_bytes=200, progress=False)
    assert torch.equal(store.ids, torch.tensor(order))
    if isinstance(labels, list):
        assert store.labels == [labels[i] for i in order]
    else:
        assert torch.equal(store.labels, labels[order])  # type: ignore[arg-type]
    torch.testing.assert_close(store["fc1"][:], _fc1(X[order]))
    store.verify()


def test_batches_of_plain_tensors_are_known_by_row_number(tmp_path: Path) -> None:
    store = extract(_mlp(), [X[:4], X[4:]], "fc1", tmp_path / "s", progress=False)
    assert torch.equal(store.ids, torch.arange(11)) and store.labels is None
    assert store.columns == {}
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["columns"] == {}


def test_labels_that_are_not_one_per_row_are_refused_before_any_shard(tmp_path: Path) -> None:
    data = [(X[:4], [1.5, None, 2, 3])]
    with pytest.raises(ExtractError, match=r"labels of an \(inputs, labels\) batch are list .*4 "
                                           r"ints or 4 strs .*or yield the inputs alone"):
        extract(_mlp(), data, "fc1", tmp_path / "s", progress=False)
    with pytest.raises(ExtractError, match=r"labels .* tensor of shape \(3,\); .*dim 0 is the "
                                           r"batch \(4\)"):
        extract(_mlp(), [(X[:4], torch.zeros(3))], "fc1", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").glob("shard-*"))


class _Failing(_Labelled):
    """Raises at item ``fail_at`` (a crash mid-run), once."""

    def __init__(self, labels: Any, fail_at: int):
        super().__init__(labels)
        self.fail_at = fail_at

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        if i == self.fail_at:
            raise RuntimeError("disk gone")
        return super().__getitem__(i)


def test_resume_keeps_ids_and_labels_aligned_with_rows(tmp_path: Path) -> None:
    labels = _LABELS["str"]
    reference = extract(_mlp(), _Labelled(labels), "fc1", tmp_path / "ref", batch_size=2,
                        progress=False)
    with pytest.raises(RuntimeError, match="disk gone"):
        extract(_mlp(), _Failing(labels, 7), "fc1", tmp_path / "s", batch_size=2,
                shard_bytes=100, progress=False)
    assert 0 < json.loads((tmp_path / "s" / "manifest.json").read_text())["rows"] < 11
    store = extract(_mlp(), _Labelled(labels), "fc1", tmp_path / "s", batch_size=2,
                    shard_bytes=100, resume=True, progress=False)
    assert torch.equal(store.ids, reference.ids) and torch.equal(store.ids, torch.arange(11))
    assert store.labels == reference.labels == labels
    assert torch.equal(store["fc1"][:], reference["fc1"][:])
    store.verify()


def test_resume_says_what_it_kept_and_its_bar_counts_the_whole_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = _LABELS["str"]
    with pytest.raises(RuntimeError, match="disk gone"):
        extract(_mlp(), _Failing(labels, 7), "fc1", tmp_path / "s", batch_size=2,
                shard_bytes=100, progress=False)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    kept, shards = manifest["rows"], len(manifest["shards"])
    batches = manifest["shards"][-1]["batches"][1]
    assert capsys.readouterr().err == ""
    extract(_mlp(), _Labelled(labels), "fc1", tmp_path / "s", batch_size=2, shard_bytes=100,
            resume=True)
    err = capsys.readouterr().err
    assert f"extract: resume: kept {kept} rows in {shards} shards of {tmp_path / 's'} (batches 0 … " \
           f"{batches - 1}); extracting from batch {batches}\n" in err
    assert f"{kept}/11 " in err and "11/11 " in err  # the bar starts at the kept rows
    extract(_mlp(), _Labelled(labels), "fc1", tmp_path / "s", batch_size=2, resume=True)
    assert f"{tmp_path / 's'} is complete (11 rows in" in capsys.readouterr().err


def test_a_resume_with_another_batch_size_names_the_flag_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="disk gone"):
        extract(_mlp(), _Failing(_LABELS["int"], 6), "fc1", tmp_path / "s", batch_size=2,
                shard_bytes=100, progress=False)
    with pytest.raises(ExtractError, match=r"cannot resume: batch_size \(--batch-size\) was 2, "
                                           r"now 5\. .*rerun with --batch-size 2 \(batch_size=2\), "
                                           r"or start over with overwrite=True \(--overwrite\)"):
        extract(_mlp(), _Labelled(_LABELS["int"]), "fc1", tmp_path / "s", batch_size=5,
                resume=True, progress=False)
    with pytest.raises(ExtractError, match=r"reduce \(--reduce\) was None, now 'mean'; dtype "
                                           r"\(--dtype\) was None, now 'float16'\. .*rerun with "
                                           r"--reduce none \(reduce=None\) no --dtype "
                                           r"\(dtype=None\)"):
        extract(_mlp(), _Labelled(_LABELS["int"]), "fc1", tmp_path / "s", batch_size=2,
                reduce="mean", dtype=torch.float16, resume=True, progress=False)


def test_repr_shows_what_show_shows(tmp_path: Path) -> None:
    store = extract(_mlp(), _Labelled(_LABELS["str"]), ["fc1", "fc2"], tmp_path / "s",
                    batch_size=4, progress=False)
    assert repr(store).splitlines() == [
        f"Store({str(tmp_path / 's')!r}: 11 rows in 1 shard, {store.nbytes} bytes, complete)",
        "  fc1  20  float32",
        "  fc2  5   float32",
        "  ids: data-set indices; labels: text"]
    assert str(store) == repr(store)


def _write_class_folders(root: Path) -> list[tuple[str, str]]:
    image_module = pytest.importorskip("PIL.Image")
    names = [("dog", "b.png"), ("cat", "z.png"), ("cat", "a.png"), ("dog", "sub/c.png")]
    rng = np.random.default_rng(0)
    for label, name in names:
        (root / label / name).parent.mkdir(parents=True, exist_ok=True)
        image_module.fromarray(rng.integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(
            root / label / name)
    return sorted((f"{label}/{name}", label) for label, name in names)


def test_a_class_folder_gives_relative_paths_and_folder_labels(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = _write_class_folders(tmp_path / "photos")
    out = tmp_path / "s"
    argv = ["extract", "tests.models:LeNet", "--image-size", "32", "--data",
            str(tmp_path / "photos"), "--layers", "fc1", "--batch-size", "3", "--out", str(out),
            "--no-progress"]
    torch.manual_seed(0)  # LeNet's weights, here and below
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2:] == ["ids: cat/a.png, cat/z.png, dog/b.png, ...", "labels: cat (2), dog (2)"]
    store = open_store(out)
    assert store.ids == [name for name, _ in expected]
    assert store.labels == [label for _, label in expected]
    # the rows are the images in that order: the same batches through LeNet by hand
    torch.manual_seed(0)
    loaded = load_model("tests.models:LeNet", image_size=(32, 32))
    images, labels = next(iter(load_data(tmp_path / "photos", loaded, batch_size=4)))
    assert labels == store.labels
    with torch.no_grad():
        model = loaded.module
        hidden = model.pool(torch.relu(model.conv2(model.pool(torch.relu(model.conv1(images))))))
        torch.testing.assert_close(store["fc1"][:], model.fc1(hidden.flatten(1)))
    assert isinstance(model, LeNet)


def test_a_flat_folder_has_ids_but_no_labels(tmp_path: Path) -> None:
    _write_class_folders(tmp_path / "photos")
    (tmp_path / "photos" / "cat" / "a.png").rename(tmp_path / "photos" / "top.png")
    loaded = load_model("tests.models:LeNet", image_size=(32, 32))
    store = extract(loaded.module, load_data(tmp_path / "photos", loaded, batch_size=2), "fc1",
                    tmp_path / "s", progress=False)
    assert store.ids == ["cat/z.png", "dog/b.png", "dog/sub/c.png", "top.png"]
    assert store.labels is None


_COLUMN_DAMAGE = {  # a manifest edit -> what the error names
    "unknown column": (lambda c: c.update(extra=c["id"]), r"columns\['extra'\] is not a column"),
    "ragged, not text": (lambda c: c["label"].update(dtype="float32"),
                         r"columns\['label'\] is ragged, so it must be text"),
    "shape of another": (lambda c: c["id"].update(shape=[2]), r"header\['@id'\].shape"),
    "dtype of another": (lambda c: c["id"].update(dtype="int32"), r"header\['@id'\].dtype"),
    "not ragged": (lambda c: c["label"].update(ragged=False), r"columns\['label'\].ragged"),
    "dropped": (lambda c: c.pop("label"), r"holds tensors .*'@label'"),
}


@pytest.fixture(scope="module")
def labelled_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("labelled") / "s"
    extract(_mlp(), _Labelled(_LABELS["str"]), "fc1", out, batch_size=4, progress=False)
    return out


@pytest.mark.parametrize("damage", sorted(_COLUMN_DAMAGE))
def test_a_damaged_column_spec_is_refused_naming_the_field(labelled_store: Path, tmp_path: Path,
                                                            damage: str) -> None:
    out = tmp_path / "s"
    out.mkdir()
    for f in labelled_store.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((out / "manifest.json").read_text())
    edit, message = _COLUMN_DAMAGE[damage]
    edit(manifest["columns"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreCorruptError, match=message):
        open_store(out).verify()
    assert main(["show", str(out), "--verify"]) == 1
