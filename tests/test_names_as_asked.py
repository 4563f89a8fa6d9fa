"""Results answer to the names asked (issue 45, item 3): a sweep, an attribution, a capture, a
store and the CLI's tables are keyed and printed by the standard name a layer was selected by
(``attn.z.0``, ``resid_post.1``), with its module path beside it; a glob's matches and exact
paths answer as themselves. Values are checked against plain PyTorch hooks on a tiny GPT-2
built from its config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope
from hookscope.cli.main import main

transformers = pytest.importorskip("transformers")

SDPA = "attn::scaled_dot_product_attention"


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0,
        eos_token_id=0)).eval()


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.randint(0, 40, (1, 4), generator=torch.Generator().manual_seed(1))
    corrupted = clean.clone()
    corrupted[0, 1] = (clean[0, 1] + 7) % 40
    return clean, corrupted


def _metric(out: object) -> torch.Tensor:
    return out.logits[:, -1, 3].mean()  # type: ignore[attr-defined]


def _block_outputs(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each block's output by a plain forward hook."""
    seen: list[torch.Tensor] = []
    handles = [block.register_forward_hook(
        lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).detach()))
        for block in model.transformer.h]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _patched_metric(model: nn.Module, ids: torch.Tensor, block: int, position: int,
                    clean: torch.Tensor) -> float:
    """The metric with block ``block``'s output at ``position`` replaced, by a plain hook."""
    def hook(module: nn.Module, args: object, out: object) -> object:
        value = out[0] if isinstance(out, tuple) else out
        value = value.clone()
        value[:, position] = clean[:, position]
        return (value, *out[1:]) if isinstance(out, tuple) else value
    handle = model.transformer.h[block].register_forward_hook(hook)
    try:
        with torch.no_grad():
            return float(_metric(model(ids)))
    finally:
        handle.remove()


def test_a_sweep_by_standard_names_answers_under_them_with_the_paths_beside(gpt2: nn.Module) -> None:
    clean, corrupted = _ids()
    sweep = hookscope.patching_sweep(gpt2, clean, corrupted, layers="resid_post.*",
                                     metric=_metric, progress=False)
    assert sweep.layers == ["resid_post.0", "resid_post.1"]
    assert sweep.paths == {"resid_post.0": "transformer.h.0", "resid_post.1": "transformer.h.1"}
    sources = _block_outputs(gpt2, clean)
    expected = [[_patched_metric(gpt2, corrupted, block, p, sources[block]) for p in range(4)]
                for block in range(2)]
    torch.testing.assert_close(sweep.values, torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert [line.split()[0] for line in sweep.table().splitlines()[1:]] == sweep.layers


def test_a_sweep_of_attn_z_is_keyed_attn_z_not_the_function_address(gpt2: nn.Module) -> None:
    clean, corrupted = _ids()
    sweep = hookscope.patching_sweep(gpt2, clean, corrupted, layers="attn.z.*", metric=_metric,
                                     positions=[1], heads=True, progress=False)
    assert sweep.layers == ["attn.z.0", "attn.z.1"]
    assert sweep.paths == {f"attn.z.{i}": f"transformer.h.{i}.{SDPA}" for i in range(2)}
    assert sweep.table().splitlines()[1].startswith("attn.z.0 head 0")


def test_a_glob_answers_under_its_matches(gpt2: nn.Module) -> None:
    clean, corrupted = _ids()
    sweep = hookscope.patching_sweep(gpt2, clean, corrupted, layers="transformer.h.*.mlp",
                                     metric=_metric, positions=[1], progress=False)
    assert sweep.layers == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert sweep.paths == {p: p for p in sweep.layers}


def test_attribution_patching_answers_under_the_standard_names(gpt2: nn.Module) -> None:
    clean, corrupted = _ids()
    atp = hookscope.attribution_patching(gpt2, clean, corrupted, _metric, layers="resid_post.*",
                                         positions=[1, 3])
    assert atp.layers == ["resid_post.0", "resid_post.1"]
    assert atp.paths == {"resid_post.0": "transformer.h.0", "resid_post.1": "transformer.h.1"}
    # by hand: corrupted metric + sum over channels of (clean - corrupted) * d metric / d output
    sources = _block_outputs(gpt2, clean)
    kept: list[torch.Tensor] = []

    def hook(module: nn.Module, args: object, out: object) -> None:
        value = out[0] if isinstance(out, tuple) else out
        value.retain_grad()
        kept.append(value)
    handles = [block.register_forward_hook(hook) for block in gpt2.transformer.h]
    try:
        value = _metric(gpt2(corrupted))
        value.backward()
    finally:
        for handle in handles:
            handle.remove()
        gpt2.zero_grad(set_to_none=True)
    expected = [[float(value.detach()) + float(((sources[b][:, p] - kept[b][:, p].detach()).double()
                                       * kept[b].grad[:, p].double()).sum())  # type: ignore[index]
                 for p in (1, 3)] for b in range(2)]
    torch.testing.assert_close(atp.values, torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


def test_a_capture_names_its_records_as_asked_and_a_saved_file_keeps_them(
        gpt2: nn.Module, tmp_path: Path) -> None:
    clean, _ = _ids()
    with torch.no_grad(), hookscope.capture(gpt2, "resid_post.*", "attn.z.0",
                                            "transformer.h.1.mlp") as acts:
        gpt2(clean)
    names = {"resid_post.0": "transformer.h.0", "attn.z.0": f"transformer.h.0.{SDPA}",
             "resid_post.1": "transformer.h.1", "transformer.h.1.mlp": "transformer.h.1.mlp"}
    assert acts.names == names
    assert repr(acts).startswith("<hookscope.Capture resid_post.0 (transformer.h.0): 1x4x16, "
                                 f"attn.z.0 (transformer.h.0.{SDPA}): 1x2x4x8, ")
    plain = _block_outputs(gpt2, clean)
    for i in range(2):
        assert torch.equal(acts[f"resid_post.{i}"], plain[i])
    acts.save(tmp_path / "a.safetensors")
    assert hookscope.load(tmp_path / "a.safetensors").names == names


def test_a_store_lists_the_names_asked_with_the_paths_beside(gpt2: nn.Module, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    clean, _ = _ids()
    store = hookscope.extract(gpt2, [clean], ["resid_post.1", "transformer.h.0.mlp"],
                              tmp_path / "st", progress=False)
    assert store.paths == {"transformer.h.0.mlp": "transformer.h.0.mlp",
                           "resid_post.1": "transformer.h.1"}
    lines = repr(store).splitlines()
    assert lines[1].split() == ["transformer.h.0.mlp", "4x16", "float32"]
    assert lines[2].split() == ["resid_post.1", "(transformer.h.1)", "4x16", "float32"]
    assert torch.equal(store["resid_post.1"][0], _block_outputs(gpt2, clean)[1][0])
    assert main(["show", str(tmp_path / "st")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["layer", "path", "row", "shape", "dtype", "ragged"]
    assert table[2].split() == ["resid_post.1", "transformer.h.1", "4x16", "float32", "no"]
    assert main(["show", str(tmp_path / "st"), "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert [(row["layer"], row["path"]) for row in layers] == [
        ("transformer.h.0.mlp", "transformer.h.0.mlp"), ("resid_post.1", "transformer.h.1")]


def test_a_store_of_paths_only_lists_them_as_before(gpt2: nn.Module, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # a store written without standard names (by path, or before they were kept) reads as before
    clean, _ = _ids()
    store = hookscope.extract(gpt2, [clean], "transformer.h.1", tmp_path / "st", progress=False)
    manifest = json.loads((tmp_path / "st" / "manifest.json").read_text())
    assert "standard_names" not in manifest
    assert store.paths == {"transformer.h.1": "transformer.h.1"}
    assert main(["show", str(tmp_path / "st")]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["layer", "row", "shape", "dtype",
                                                                "ragged"]


def _write_tiny_gpt2(folder: Path) -> None:
    """``folder/tiny.py:build`` (a 2-block GPT-2 for the CLI) and ``folder/ids.pt`` (3 tokens)."""
    (folder / "tiny.py").write_text(
        "import torch, transformers\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=16, "
        "n_head=2, vocab_size=40, n_positions=16, bos_token_id=0, eos_token_id=0)).eval()\n")
    torch.save(torch.tensor([[1, 2, 3]]), folder / "ids.pt")


def test_the_capture_command_prints_the_names_asked_beside_the_paths(
        gpt2: nn.Module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_tiny_gpt2(tmp_path)
    args = ["capture", f"{tmp_path / 'tiny.py'}:build", "--input", str(tmp_path / "ids.pt"),
            "--layers", "resid_post.1", "h.0.mlp"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name"))
    assert lines[header].split()[:4] == ["name", "path", "call", "shape"]
    assert [line.split()[:2] for line in lines[header + 1:]] == [
        ["h.0.mlp", "h.0.mlp"], ["resid_post.1", "h.1"]]
    assert main([*args, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["records"]
    assert [(r["name"], r["path"]) for r in records] == [("h.0.mlp", "h.0.mlp"),
                                                         ("resid_post.1", "h.1")]


def test_a_probe_answers_under_the_names_a_store_was_extracted_by(gpt2: nn.Module,
                                                                  tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    ids = torch.randint(0, 40, (16, 4), generator=torch.Generator().manual_seed(2))
    labels = torch.arange(16) % 2
    store = hookscope.extract(gpt2, [(ids, labels)], ["transformer.h.0.mlp", "resid_post.1"],
                              tmp_path / "st", reduce="mean", progress=False)
    result = hookscope.probe(store)
    assert [p.layer for p in result.layers] == ["transformer.h.0.mlp", "resid_post.1"]
    by_path = hookscope.probe(store, ["transformer.h.1"])  # the path still reads
    assert [p.layer for p in by_path.layers] == ["resid_post.1"]


def test_stats_answer_under_the_names_asked(gpt2: nn.Module, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    clean, _ = _ids()
    result = hookscope.stats(gpt2, [clean], layers=["resid_post.1", "transformer.h.0.mlp"])
    assert list(result) == ["transformer.h.0.mlp", "resid_post.1"]
    assert result.paths == {"transformer.h.0.mlp": "transformer.h.0.mlp",
                            "resid_post.1": "transformer.h.1"}
    plain = _block_outputs(gpt2, clean)[1].double()
    assert result["resid_post.1"].as_dict()["mean"] == pytest.approx(float(plain.mean()), rel=1e-9)
    _write_tiny_gpt2(tmp_path)
    args = ["stats", f"{tmp_path / 'tiny.py'}:build", "--input", str(tmp_path / "ids.pt"),
            "--layers", "resid_post.1"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["name", "path", "count"]
    assert lines[1].split()[:3] == ["resid_post.1", "h.1", "48"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["resid_post.1"] and data["resid_post.1"]["path"] == "h.1"


def test_the_monitor_records_under_the_names_asked(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clean, _ = _ids()
    seen: list[torch.Tensor] = []
    handle = model.transformer.h[1].register_forward_hook(
        lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).detach()))
    try:
        with hookscope.monitor(model, ["resid_post.1", "transformer.h.0.mlp"], every=1,
                               optimizer=optimizer, run_dir=tmp_path / "run") as mon:
            optimizer.zero_grad()
            model(clean, labels=clean).loss.backward()
            optimizer.step()
    finally:
        handle.remove()
    assert list(mon.latest) == ["transformer.h.0.mlp", "resid_post.1"]
    record = mon.latest["resid_post.1"]
    assert (record["module"], record["path"]) == ("resid_post.1", "transformer.h.1")
    # the user's own hook saw the standard names' probe forward (engine.ground_truth, once per
    # model, docs/standard_names.md), then the training step's
    assert [tuple(value.shape[:2]) for value in seen] == [(1, 6), (1, 4)]
    assert record["activation"]["mean"] == pytest.approx(float(seen[-1].double().mean()), rel=1e-6)
    lines = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    assert [(r["module"], r["path"]) for r in lines if "path" in r] == [
        ("transformer.h.0.mlp", "transformer.h.0.mlp"), ("resid_post.1", "transformer.h.1")]
