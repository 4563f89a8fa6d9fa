"""extract(engine="ray") / extract --ray: Ray actors write the shards one process would write.

One local Ray cluster for the module (4 logical CPUs on the 2-core machine, no dashboard). A store
of fixed-size rows is compared byte for byte, every file, with the store one process writes from
the same model, data and options: both runs draw the same run id (``_same_run``), so no field is
left out of the comparison (a store's run id is otherwise random: it is in the manifest and each
shard). Stores at a URL go to moto's S3 server on 127.0.0.1 (``tests/s3_server.py``), with the
endpoint in ``storage_options`` (the CLI: fsspec's config) only: an actor reaches the server
only through what the job carries. The tests that start actors take seconds each (an actor imports
torch): marked slow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import fsspec.core
import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import Dataset

import hookscope.store.extraction as extract_module
from hookscope import RayEngine, extract
from hookscope.cli import extract as cli_extract
from hookscope.cli.main import main
from hookscope.errors import ExtractError
from tests.models import MaskedTokens, MlpStack
from tests.s3_server import KEY, SECRET

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
RUN = "0123456789abcdef0123456789abcdef"
LAYERS = ["fc1", "fc2"]
# 43 rows in 11 batches of 4; a batch's rows are 432 bytes (fc1 320, fc2 80, ids 32), so one
# process closes a shard every 2 batches: 6 shards, the last of 3 rows
OPTIONS = {"batch_size": 4, "shard_bytes": 600, "progress": False}


class Rows(Dataset[Any]):
    """43 fixed rows of 10 features; with ``crash_at``, the process reading that row dies once
    (``marker`` is created first, so its retry reads on), leaving in the folder ``leftover``
    (unless ``""``) the temporary file a worker killed while writing a shard leaves there;
    ``delay_s`` slows each row; with ``text_from``, rows are ``(x, label)``: 1 before that row,
    "cat" from it on."""

    def __init__(self, crash_at: int | None = None, marker: str = "", leftover: str = "",
                 delay_s: float = 0.0, text_from: int | None = None):
        self.x = torch.randn(43, 10, generator=torch.Generator().manual_seed(1))
        self.crash_at, self.marker, self.leftover = crash_at, marker, leftover
        self.delay_s, self.text_from = delay_s, text_from

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay_s)
        if i == self.crash_at and not os.path.exists(self.marker):
            Path(self.marker).touch()
            if self.leftover:
                name = f".shard-00002.safetensors.tmp-{RUN}-{os.getpid()}-0badf00d"
                (Path(self.leftover) / name).write_bytes(b"x")
            os._exit(1)
        if self.text_from is not None:
            return self.x[i], 1 if i < self.text_from else "cat"
        return self.x[i]


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """22 rows of 6 token ids, row ``i`` with ``i % 6 + 1`` real tokens (the rest padding)."""

    def __len__(self) -> int:
        return 22

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 50, (6,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": (torch.arange(6) <= i % 6).long()}


def model() -> MlpStack:
    torch.manual_seed(0)
    return MlpStack()


class _FixedRun:
    """Stands for ``secrets`` in ``hookscope.store.extraction``: the run id drawn is ``RUN``."""

    @staticmethod
    def token_hex(nbytes: int) -> str:
        return RUN


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    paths = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": paths, "OMP_NUM_THREADS": "1"}})
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


@pytest.fixture
def _same_run(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every store this test starts draws the run id ``RUN``; one thread, as each actor has."""
    monkeypatch.setattr(extract_module, "secrets", _FixedRun)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _one_process(folder: Path) -> dict[str, bytes]:
    extract(model(), Rows(), LAYERS, folder, **OPTIONS)
    return _files(folder)


def _s3(endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh folder on the test's S3 server, and the options to reach it (credentials too,
    as a user passes them; moto takes any, and the endpoint is the part an actor cannot guess)."""
    return (f"s3://hookscope/{uuid.uuid4().hex[:12]}",
            {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint}})


def _objects(url: str, options: dict[str, Any]) -> dict[str, bytes]:
    """Every object (or file) under ``url`` (or a folder's path), by name."""
    fs, root = fsspec.core.url_to_fs(url, **options)
    return {name.rsplit("/", 1)[-1]: fs.cat_file(name) for name in sorted(fs.ls(root, detail=False))}


@pytest.mark.slow
@pytest.mark.usefixtures("_same_run")
def test_cli_ray_writes_the_one_process_store_byte_for_byte(
        cluster: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights, rows = tmp_path / "mlp.safetensors", tmp_path / "rows.pt"
    save_file(model().state_dict(), str(weights))
    torch.save(Rows().x, rows)
    args = ["extract", f"tests.models:MlpStack@{weights}", "--data", str(rows), "--layers", "fc1",
            "--layers", "fc2", "--batch-size", "4", "--shard-bytes", "600", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--out", str(tmp_path / "ray"), "--ray", "--ray-actors", "2",
                 "--ray-address", cluster]) == 0
    one, on_ray = _files(tmp_path / "one"), _files(tmp_path / "ray")
    assert list(on_ray) == ["manifest.json", *(f"shard-{k:05d}.safetensors" for k in range(6))]
    assert on_ray == one
    url, options = _s3(s3_endpoint)  # the CLI has no storage_options: fsspec's own config
    monkeypatch.setitem(fsspec.config.conf, "s3", {"key": KEY, "secret": SECRET,
                                                   "endpoint_url": s3_endpoint})
    assert main([*args, "--out", url, "--ray", "--ray-actors", "1", "--ray-address",
                 cluster]) == 0  # as FSSPEC_S3_KEY, _SECRET and _ENDPOINT_URL give a process
    assert _objects(url, options) == one


@pytest.mark.slow
@pytest.mark.usefixtures("_same_run")
def test_ray_into_s3_is_the_one_process_store_despite_a_killed_worker_and_keeps_no_credential(
        cluster: str, s3_endpoint: str, tmp_path: Path) -> None:
    url, options = _s3(s3_endpoint)
    marker = tmp_path / "crashed"
    extract(model(), Rows(), LAYERS, f"{url}/one", storage_options=options, **OPTIONS)
    store = extract(model(), Rows(crash_at=21, marker=str(marker)), LAYERS, f"{url}/ray",
                    engine=RayEngine(actors=2), storage_options=options, **OPTIONS)
    assert marker.exists()  # died mid-shard: nothing of shard 2 was uploaded, its retry was
    on_ray = _objects(f"{url}/ray", options)  # every object once: no orphan, no duplicate
    assert on_ray == _objects(f"{url}/one", options) == _one_process(tmp_path / "one")
    store.verify()
    for data in on_ray.values():  # the manifest, and each shard with its metadata
        assert SECRET.encode() not in data and KEY.encode() not in data
        assert s3_endpoint.encode() not in data


@pytest.mark.slow
@pytest.mark.usefixtures("_same_run")
def test_killed_worker_is_retried_without_duplicate_or_orphan(cluster: str, tmp_path: Path) -> None:
    marker, out = tmp_path / "crashed", tmp_path / "ray"
    out.mkdir()
    store = extract(model(), Rows(crash_at=21, marker=str(marker), leftover=str(out)), LAYERS,
                    f"file://{out}", engine=RayEngine(actors=2), **OPTIONS)  # file://: a folder
    assert marker.exists()  # the worker holding shard 2 (batches 4, 5: rows 16..23) died
    assert _files(out) == _one_process(tmp_path / "one")  # its temporary file gone
    store.verify()


@pytest.mark.slow
@pytest.mark.usefixtures("_same_run")
@pytest.mark.parametrize("place", ["folder", "s3"])
def test_killed_driver_resumes_to_the_same_bytes(cluster: str, tmp_path: Path, place: str,
                                                 request: pytest.FixtureRequest) -> None:
    out, options = (str(tmp_path / "ray"), {}) if place == "folder" else \
        _s3(request.getfixturevalue("s3_endpoint"))
    code = (f"import ray, hookscope.store.extraction as e, tests.test_extract_ray as t\n"
            f"e.secrets = t._FixedRun\n"
            f"ray.init(address={cluster!r}, log_to_driver=False)\n"
            f"e.extract(t.model(), t.Rows(delay_s=0.1), t.LAYERS, {out!r},\n"
            f"          engine=t.RayEngine(actors=1), storage_options={options or None!r},\n"
            f"          **t.OPTIONS)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        listed = _wait_for_shards(out, options, 2, driver)
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    assert 2 <= listed < 6
    store = extract(model(), Rows(), LAYERS, out, resume=True, engine=RayEngine(actors=1),
                    storage_options=options or None, **OPTIONS)
    assert _objects(out, options) == _one_process(tmp_path / "one")
    store.verify()


@pytest.mark.slow
@pytest.mark.usefixtures("_same_run")
def test_a_relative_folder_is_this_processs_not_the_actors(cluster: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the actors' working directory stays the cluster's
    store = extract(model(), Rows(), LAYERS, "relative", engine=RayEngine(actors=1), **OPTIONS)
    assert sorted(os.listdir(tmp_path / "relative")) == \
        ["manifest.json", *(f"shard-{k:05d}.safetensors" for k in range(6))]
    store.verify()  # before: StoreCorruptError, the shards were in the cluster's folder
    mlp, x = model(), Rows().x
    with torch.no_grad():  # batches of 4, as extract runs them
        assert torch.equal(store["fc2"][:], torch.cat([mlp(x[i:i + 4]) for i in range(0, 43, 4)]))


@pytest.mark.slow
@pytest.mark.usefixtures("_same_run")
def test_ctrl_c_keeps_the_shards_listed_in_order_and_resume_finishes(cluster: str,
                                                                     tmp_path: Path) -> None:
    out = tmp_path / "ray"
    code = (f"import signal, sys, ray, hookscope.errors, hookscope.store.extraction as e, "
            f"tests.test_extract_ray as t\n"
            f"signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"e.secrets = t._FixedRun\n"
            f"ray.init(address={cluster!r}, log_to_driver=False)\n"
            f"try:\n"
            f"    e.extract(t.model(), t.Rows(delay_s=0.1), t.LAYERS, {str(out)!r},\n"
            f"              engine=t.RayEngine(actors=1), **t.OPTIONS)\n"
            f"except hookscope.errors.ExtractInterrupted as stopped:\n"
            f"    print('stopped:', stopped.rows, stopped)\n"
            f"    sys.exit(130)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_shards(str(out), {}, 1, driver)
        driver.send_signal(signal.SIGINT)
        stdout, stderr = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 130, stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and 1 <= len(manifest["shards"]) < 6
    # ray's raylet writes its own lines to the driver's stdout, even inside the print's line
    # (seen under load: 'stopped:\x1b[33m(raylet)\x1b[0m Task ... killed by `ray.kill`.\n 16 ...')
    stdout = re.sub(r"\x1b\[\d+m\(raylet\)\x1b\[0m[^\n]*\n", "", stdout)
    assert f"stopped: {manifest['rows']} extract interrupted: {manifest['rows']} rows" in stdout
    store = extract(model(), Rows(), LAYERS, out, resume=True, engine=RayEngine(actors=1),
                    **OPTIONS)
    assert _files(out) == _one_process(tmp_path / "one")
    store.verify()


def _wait_for_shards(out: str, options: dict[str, Any], count: int,
                     driver: subprocess.Popen[Any]) -> int:
    """Wait until the manifest at ``out`` lists ``count`` shards; return how many it lists then."""
    fs, root = fsspec.core.url_to_fs(out, **options)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if driver.poll() is not None:
            raise AssertionError(f"the driver ended first: {driver.stderr.read()[-3000:]!r}")
        try:
            text = fs.cat_file(f"{root}/manifest.json").decode()
        except FileNotFoundError:
            text = ""
        if text.count('"file"') >= count:
            return text.count('"file"')
        time.sleep(0.05)
    raise AssertionError("the driver listed no shards in 120 s")


@pytest.mark.slow
def test_an_actors_error_is_raised_as_one_process_raises_it(cluster: str, tmp_path: Path) -> None:
    data = Rows(text_from=28)  # batch 7 (rows 28..31) has text labels, the batches before ints
    with pytest.raises(ExtractError, match="in batch 7") as alone:
        extract(model(), data, LAYERS, tmp_path / "one", **OPTIONS)
    with pytest.raises(ExtractError, match="in batch 7") as on_ray:
        extract(model(), data, LAYERS, tmp_path / "ray", engine=RayEngine(actors=1), **OPTIONS)
    assert type(on_ray.value) is ExtractError and str(on_ray.value) == str(alone.value)
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert not manifest["complete"]  # shard 3 (batches 6, 7) failed: shards 0..2 at most listed
    assert [s["batches"] for s in manifest["shards"]] == [[0, 2], [2, 4], [4, 6]][:len(manifest["shards"])]


def test_the_resume_command_keeps_the_ray_options() -> None:
    parser = argparse.ArgumentParser()
    cli_extract.add_arguments(parser)
    args = parser.parse_args(["m.py:f", "--data", "d", "--layers", "fc1", "--out", "o", "--ray",
                              "--ray-actors", "3", "--ray-address", "ray://head:10001"])
    assert cli_extract.resume_command(args).endswith(
        " --ray --ray-actors 3 --ray-address ray://head:10001 --resume")
    # on CUDA each actor takes a GPU of its own and moves its copy of the model there
    assert cli_extract._ray_engine(args, "cuda:0") == RayEngine(3, "ray://head:10001", num_gpus=1)
    assert cli_extract._ray_engine(args, "cpu") == RayEngine(3, "ray://head:10001", num_gpus=0)


def test_ray_options_without_ray_are_a_usage_error(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["extract", "m.py:f", "--data", "d", "--layers", "fc1", "--out",
                 str(tmp_path / "o"), "--ray-actors", "3"]) == 2
    assert "add --ray, or leave them out" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("_same_run")
def test_ragged_rows_are_one_processs_rows_in_shards_of_a_batch_count(cluster: str,
                                                                        tmp_path: Path) -> None:
    torch.manual_seed(0)
    tokens = MaskedTokens()
    # a batch's rows take 496, 656, 816, 496, 656 and 328 bytes (8 floats and an id per token,
    # offsets and an id per row): one process closes a shard once it holds 1000, Ray cuts
    # shards of ceil(1000 / 496) = 3 batches
    options = {"batch_size": 4, "shard_bytes": 1000, "progress": False}
    alone = extract(tokens, Tokens(), "mix", tmp_path / "one", **options)
    on_ray = extract(tokens, Tokens(), "mix", tmp_path / "ray", engine=RayEngine(actors=1),
                     **options)
    assert [s.batches for s in alone.shards] == [(0, 2), (2, 4), (4, 6)]
    assert [s.batches for s in on_ray.shards] == [(0, 3), (3, 6)]
    assert len(on_ray) == len(alone) == 22 and on_ray.layers == alone.layers
    assert all(torch.equal(on_ray["mix"][i], alone["mix"][i]) for i in range(22))
    assert all(map(torch.equal, on_ray.token_ids, alone.token_ids))
    assert torch.equal(on_ray.ids, alone.ids)
    on_ray.verify()


def test_a_model_that_does_not_pickle_is_refused_before_any_file(cluster: str,
                                                                 tmp_path: Path) -> None:
    locked = model()
    locked.lock = threading.Lock()
    with pytest.raises(ExtractError, match=r"keep no locks, open files or threads on them"):
        extract(locked, Rows(), LAYERS, tmp_path / "out", engine=RayEngine(actors=1), **OPTIONS)
    assert not (tmp_path / "out").exists()


def test_ray_refuses_data_without_a_length_before_writing(tmp_path: Path) -> None:
    batches = (torch.randn(4, 10) for _ in range(3))
    with pytest.raises(ExtractError, match=r"needs data with a length \(a Dataset"):
        extract(model(), batches, LAYERS, tmp_path / "out", engine="ray", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("engine", ["rays", RayEngine(actors=0), RayEngine(num_cpus=-1)])
def test_bad_engine_is_named_with_the_fix(engine: object, tmp_path: Path) -> None:
    with pytest.raises(ExtractError, match=r"engine must be 'local', 'ray'|RayEngine\(actors=2"):
        extract(model(), Rows(), LAYERS, tmp_path / "out", engine=engine, progress=False)
    assert not (tmp_path / "out").exists()


def test_ray_into_memory_is_refused_before_anything_is_written() -> None:
    url = "memory://ray-refused/store"  # each actor, a process of its own, has its own memory://
    with pytest.raises(ExtractError, match=r"one file system per process.* URL every actor "
                                           r"reaches \(s3://, gs://\).* or leave engine out"):
        extract(model(), Rows(), LAYERS, url, engine="ray", progress=False)
    assert not fsspec.filesystem("memory").exists("/ray-refused")


def test_cli_ray_into_memory_is_refused_with_the_fix(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    weights, rows = tmp_path / "mlp.safetensors", tmp_path / "rows.pt"
    save_file(model().state_dict(), str(weights))
    torch.save(Rows().x, rows)
    assert main(["extract", f"tests.models:MlpStack@{weights}", "--data", str(rows), "--layers",
                 "fc1", "--out", "memory://ray-refused-cli/store", "--ray"]) == 1
    assert "or leave engine out to write memory:// from this process" in capsys.readouterr().err
    assert not fsspec.filesystem("memory").exists("/ray-refused-cli")


@pytest.mark.parametrize("engine", [RayEngine(num_cpus=1000), RayEngine(num_gpus=1),
                                    RayEngine(actors=5, num_cpus=1)])
def test_resources_the_cluster_lacks_are_refused_at_once(cluster: str, tmp_path: Path,
                                                          engine: RayEngine) -> None:
    """4 CPUs, no GPU: Ray would wait forever for these actors; refused before any file."""
    with pytest.raises(ExtractError, match=r"cannot start .* CPUs \[4\.0\] and GPUs \[0\.0\], "
                                           r"room for [0-4] such actor"):
        extract(model(), Rows(), LAYERS, tmp_path / "s", engine=engine, **OPTIONS)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


class FailsOnAnActor(Rows):
    """``Rows`` whose row 0 fails (after a wait, so other shards finish first) in any process
    but the driver's, which checks batch 0 itself."""

    def __init__(self) -> None:
        super().__init__()
        self.driver = os.getpid()

    def __getitem__(self, i: int) -> Any:
        if i == 0 and os.getpid() != self.driver:
            time.sleep(2.0)
            raise ValueError("row 0 cannot be read on this node")
        return super().__getitem__(i)


@pytest.mark.slow
def test_a_failed_run_leaves_only_what_its_manifest_lists(cluster: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row 0 cannot be read"):
        extract(model(), FailsOnAnActor(), LAYERS, tmp_path / "s", engine=RayEngine(actors=2),
                **OPTIONS)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["shards"] == [] and not manifest["complete"]
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["manifest.json"]
