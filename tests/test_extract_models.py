"""Real models on real data, no download: efficientnet-lite0 on scikit-image's photos (CLI), and
minilm on paragraphs of the Python documentation (pydoc_data.topics), stored ragged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import hookscope
from hookscope.cli.main import main
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from hookscope.zoo.data import load_data
from hookscope.zoo.models import load_model

PHOTOS = ("chelsea", "astronaut", "coffee", "rocket", "camera")  # camera: grayscale


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    image_module = pytest.importorskip("PIL.Image")
    skimage_data = pytest.importorskip("skimage.data")
    folder = tmp_path_factory.mktemp("photos")
    for i, name in enumerate(PHOTOS):
        image_module.fromarray(getattr(skimage_data, name)()).save(folder / f"{i}-{name}.png")
    return folder


@pytest.fixture(scope="module")
def paragraphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pydoc_data.topics import topics

    texts = [p.strip().replace("\n", " ") for key in sorted(topics)[:6]
             for p in topics[key].split("\n\n") if 40 < len(p.strip()) < 300][:8]
    file = tmp_path_factory.mktemp("text") / "paragraphs.txt"
    file.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return file


def test_efficientnet_photos_through_the_cli(photo_folder: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    out = tmp_path / "features"
    argv = ["extract", "efficientnet-lite0", "--data", str(photo_folder), "--layers", "_blocks.15",
            "--layers", "_fc", "--reduce", "mean", "--batch-size", "2", "--out", str(out),
            "--no-progress"]
    assert main(argv) == 0
    assert "_blocks.15  320" in capsys.readouterr().out  # the summary table
    store = open_store(out)
    assert len(store) == 5 and store.layers["_blocks.15"].shape == (320,)
    assert int(store["_fc"][0].argmax()) == 285  # 0-chelsea.png: Egyptian cat

    loaded = load_model("efficientnet-lite0")
    for start, images in zip(range(0, 5, 2), load_data(photo_folder, loaded, batch_size=2)):
        with torch.no_grad(), hookscope.capture(loaded.module, "_blocks.15", "_fc") as acts:
            loaded.module(images)
        assert torch.equal(store["_blocks.15"][start:start + 2], acts["_blocks.15"].mean(dim=(2, 3)))
        assert torch.equal(store["_fc"][start:start + 2], acts["_fc"])


def test_unreadable_image_fails_before_any_shard(photo_folder: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    folder = tmp_path / "photos"
    folder.mkdir()
    for file in photo_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "9-broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (folder / "0-empty.png").write_bytes(b"")
    (folder / "sub").mkdir()
    (folder / "sub" / "5-text.jpeg").write_text("hello")
    out = tmp_path / "features"
    assert main(["extract", "efficientnet-lite0", "--data", str(folder), "--layers", "_fc",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot read 3 of the {len(list(photo_folder.iterdir())) + 3} images" in err
    assert all(name in err for name in ("9-broken.jpg", "0-empty.png", "5-text.jpeg"))
    assert not out.exists()


def test_minilm_paragraphs_stored_as_tokens_without_padding(paragraphs: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    loaded = load_model("minilm")
    data = load_data(paragraphs, loaded, batch_size=4)
    store = extract(loaded.module, data, "encoder.layer.5", tmp_path / "tokens", progress=False,
                    model_spec="minilm")
    lines = paragraphs.read_text(encoding="utf-8").splitlines()
    assert len(store) == len(lines) == 8 and store.layers["encoder.layer.5"].shape == (None, 384)
    rows = store["encoder.layer.5"][:]
    lengths = [len(loaded.tokenizer(line, truncation=True)["input_ids"]) for line in lines]
    assert [len(r) for r in rows] == lengths and len(set(lengths)) > 3
    for start, batch in zip(range(0, 8, 4), data):  # bitwise: the real tokens of each batch
        with torch.no_grad(), hookscope.capture(loaded.module, "encoder.layer.5") as acts:
            loaded.module(**batch)
        output = acts["encoder.layer.5"]
        hidden = output[0] if isinstance(output, tuple) else output  # (batch, seq, 384)
        mask = batch["attention_mask"].bool()
        for i in range(len(mask)):
            assert torch.equal(rows[start + i], hidden[i][mask[i]])
    alone = loaded.tokenizer(lines[1], return_tensors="pt", truncation=True)
    with torch.no_grad():  # no padding at all: same values up to float rounding
        single = loaded.module(**alone).last_hidden_state[0]
    final = extract(loaded.module, data, "encoder.layer.5", tmp_path / "mean", reduce="mean",
                    progress=False)
    np.testing.assert_allclose(final["encoder.layer.5"][1].numpy(), single.mean(0).numpy(),
                               atol=1e-4)
