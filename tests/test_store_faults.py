"""Object stores that fail by name (issue 49 item 1): moto's S3 server on 127.0.0.1, killed,
started again, and behind a proxy that drops connections at random bytes. Every fault is a
``StoreFaultError`` naming the URL and the endpoint; a run cut by one says what it kept and how
to resume, and the resumed store is byte for byte a local one's; a missing bucket is refused,
never created. ``test_attack_table`` prints the tried / clean / raw / silent / lost counts."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec.core
import pytest
import s3fs
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from hookscope.errors import HookscopeError, StoreFaultError
from hookscope.store import faults
from hookscope.store.extraction import extract
from hookscope.store.reader import open_store
from tests.s3_faults import DroppingProxy, MotoServer, fast_client
from tests.s3_server import KEY, SECRET

ROWS = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))  # 256 bytes a row
SHARD = 2048  # 8 rows a shard: 6 shards
OUTCOMES: Counter[str] = Counter()  # the attack table, filled by the tests of this module


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ACCESS_KEY_ID", KEY)
        patch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = MotoServer()
        fs, _ = fsspec.core.url_to_fs("s3://hookscope", **fast_client(server.endpoint))
        if not fs.exists("hookscope"):
            fs.mkdir("hookscope")
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "ATTEMPTS", 4)
    monkeypatch.setattr(faults, "BACKOFF_S", 0.02)


def _options(endpoint: str) -> dict[str, Any]:
    """Options whose file system retries once itself (s3fs's loop) and botocore not at all."""
    options = fast_client(endpoint)
    options["skip_instance_cache"] = False
    fsspec.core.url_to_fs("s3://hookscope", **options)[0].retries = 1  # the instance location() gets
    return options


class _Rows(Dataset[tuple[torch.Tensor]]):
    """``ROWS`` one at a time, calling ``when(i)`` before row ``i`` (a fault mid-run)."""

    def __init__(self, when: Callable[[int], None] = lambda i: None):
        self.when = when

    def __len__(self) -> int:
        return len(ROWS)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        self.when(i)
        return (ROWS[i],)


def _extract(url: str, options: dict[str, Any] | None, data: Any = None, **kw: Any) -> Any:
    return extract(nn.Sequential(nn.Identity()), data or TensorDataset(ROWS), "0", url,
                   batch_size=4, shard_bytes=SHARD, progress=False, storage_options=options, **kw)


@pytest.fixture(scope="module")
def local_digests(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """sha256 of each shard of the store one process writes into a local folder (its run id
    blanked: each run draws its own)."""
    folder = tmp_path_factory.mktemp("local") / "s"
    store = _extract(str(folder), None)
    return [_digest((folder / s.file).read_bytes(), store.manifest["run"]) for s in store.shards]


def _digest(data: bytes, run: str) -> str:
    return hashlib.sha256(data.replace(run.encode(), b"0" * 32)).hexdigest()


def _digests(url: str, endpoint: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url, **fast_client(endpoint))
    store = open_store(url, storage_options=fast_client(endpoint))
    store.verify()
    assert torch.equal(store["0"][:], ROWS)
    return [_digest(fs.cat_file(f"{root}/{s.file}"), store.manifest["run"]) for s in store.shards]


def _named(err: StoreFaultError, url: str, endpoint: str) -> None:
    text = str(err)
    assert url in text and endpoint in text and "Check" in text or "credentials" in text
    assert KEY not in text and SECRET not in text


def test_a_dead_endpoint_is_named_after_bounded_retries(moto: MotoServer) -> None:
    probe = MotoServer()  # a port of its own, then killed: nothing listens there
    probe.stop()
    url = f"s3://hookscope/{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreFaultError) as caught:
        _extract(url, _options(probe.endpoint))
    _named(caught.value, url, probe.endpoint)
    assert "tried 4 times" in str(caught.value) and "EndpointConnectionError" in str(caught.value)
    OUTCOMES["clean"] += 1


def test_the_endpoint_named_is_the_one_a_cached_client_talks_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec keeps one file system per process: one connected under another
    ``AWS_ENDPOINT_URL`` still talks to that endpoint, and a fault must name it, not the
    environment's (a CI run named the live server while its cached client called a dead one)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, key=KEY, secret=SECRET)
    fs.connect()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:10")
    assert faults.endpoint_of(fs) == "http://127.0.0.1:9"
    assert faults.endpoint_of(s3fs.S3FileSystem(skip_instance_cache=True)) == "http://127.0.0.1:10"


def test_a_missing_bucket_is_refused_never_created(moto: MotoServer) -> None:
    bucket = f"reel-bucket-{uuid.uuid4().hex[:6]}"
    with pytest.raises(StoreFaultError, match=f"bucket '{bucket}'.*does not exist.*never creates"):
        _extract(f"s3://{bucket}/acts", _options(moto.endpoint))
    fs = fsspec.core.url_to_fs("s3://hookscope", **fast_client(moto.endpoint))[0]
    assert bucket not in [b.rstrip("/") for b in fs.ls("", refresh=True)]
    OUTCOMES["clean"] += 1


def test_refused_credentials_say_so_and_are_not_retried(moto: MotoServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    options = _options(moto.endpoint)
    fs = fsspec.core.url_to_fs("s3://hookscope", **options)[0]
    calls = []

    def forbidden(path: str, **kw: Any) -> Any:
        calls.append(path)
        raise PermissionError("Forbidden")

    monkeypatch.setattr(fs, "info", forbidden)
    with pytest.raises(StoreFaultError, match="credentials were refused.*AWS_ACCESS_KEY_ID"):
        _extract("s3://hookscope/x", options)
    assert len(calls) == 1  # not a transient fault: tried once
    OUTCOMES["clean"] += 1


@pytest.mark.slow
def test_a_server_killed_mid_run_keeps_whole_shards_and_resume_is_byte_identical(
        moto: MotoServer, local_digests: list[str]) -> None:
    url = f"s3://hookscope/{uuid.uuid4().hex[:8]}"
    options = _options(moto.endpoint)

    def kill(i: int) -> None:
        if i == 30:  # batch 7: after shards 0..2 were handed to the writer
            moto.stop()

    try:
        with pytest.raises(StoreFaultError) as caught:
            _extract(url, options, _Rows(kill))
    finally:
        moto.start()
    text = str(caught.value)
    _named(caught.value, url, moto.endpoint)
    kept = int(text.split("extract stopped: ")[1].split(" rows")[0])
    assert kept % 8 == 0 and kept < 48 and "resume=True (--resume)" in text
    store = open_store(url, storage_options=options, allow_incomplete=True)
    assert len(store) == kept and torch.equal(store["0"][:], ROWS[:kept])  # what it said it kept
    _extract(url, options, resume=True)
    assert _digests(url, moto.endpoint) == local_digests
    OUTCOMES["clean"] += 1


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_connections_dropped_at_random_bytes(moto: MotoServer, local_digests: list[str],
                                             seed: int) -> None:
    """Through the proxy, an extraction ends complete or in a ``StoreFaultError``; resumed
    (through the proxy again, then directly), its shards are a local store's, byte for byte;
    reads through the proxy give the rows or a ``StoreFaultError``, never other bytes."""
    url = f"s3://hookscope/{uuid.uuid4().hex[:8]}"
    with DroppingProxy(moto.port, rate=0.5, seed=seed, max_drops=6) as proxy:
        options = _options(proxy.endpoint)
        outcome = _attempt(lambda: _extract(url, options))
        if outcome != "complete":
            outcome = _attempt(lambda: _extract(url, options, resume=True))
        read = _attempt(lambda: _read(url, options))
    if outcome != "complete":
        _extract(url, _options(moto.endpoint), resume=True)
    assert _digests(url, moto.endpoint) == local_digests
    assert proxy.drops > 0
    OUTCOMES["clean"] += 1
    OUTCOMES["clean"] += read in ("complete", "fault")


def _read(url: str, options: dict[str, Any]) -> None:
    store = open_store(url, storage_options=options)
    assert torch.equal(store["0"][:], ROWS)


def _attempt(call: Callable[[], Any]) -> str:
    """``"complete"``, or ``"fault"`` for a ``StoreFaultError`` (any other error fails the
    test: it would be a raw one)."""
    try:
        call()
    except StoreFaultError as err:
        assert "s3://hookscope/" in str(err)
        return "fault"
    return "complete"


def test_cli_names_the_missing_bucket_and_how_to_give_an_endpoint(
        moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI in this process (two fresh interpreters took 20 s on a busy machine), its
    endpoint and credentials from the environment only, read by a file system made now."""
    from hookscope.cli.main import main

    data = tmp_path / "rows.pt"
    torch.save(ROWS, data)
    model = tmp_path / "ident.py"
    model.write_text("import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Identity())\n")
    for name, value in {"AWS_ENDPOINT_URL": moto.endpoint, "AWS_ACCESS_KEY_ID": KEY,
                        "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec's cached instance may talk to another server
    try:
        assert main(["extract", f"{model}:make", "--data", str(data), "--layers", "0", "--out",
                     "s3://no-such-bucket-49/acts", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert "no-such-bucket-49" in err and moto.endpoint in err
        assert main(["extract", f"{model}:make", "--data", str(data), "--layers", "0", "--out",
                     "s3://hookscope/cli-49", "--no-progress", "--overwrite"]) == 0, \
            capsys.readouterr().err
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    store = open_store("s3://hookscope/cli-49", storage_options=fast_client(moto.endpoint))
    assert torch.equal(store["0"][:], ROWS)
    OUTCOMES["clean"] += 2


def test_cli_fault_mid_run_prints_rows_kept_and_the_resume_command(
        moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], local_digests: list[str]) -> None:
    """The CLI in this process, its endpoint from the environment; the third shard's upload
    fails on every try: exit 1, the rows kept and the exact command that goes on."""
    from hookscope.cli.main import main

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    torch.save(ROWS, tmp_path / "rows.pt")
    (tmp_path / "ident.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Identity())\n")
    monkeypatch.chdir(tmp_path)
    # the instance a URL without storage_options gets, made now under this endpoint: fsspec
    # caches one per process, and one an earlier test made talks to another server
    s3fs.S3FileSystem.clear_instance_cache()
    fs = fsspec.filesystem("s3")
    pipe_file = fs.pipe_file

    def failing(path: str, data: bytes, **kw: Any) -> None:
        if path.endswith("shard-00002.safetensors"):
            raise ConnectionError("connection reset by peer")
        pipe_file(path, data, **kw)

    monkeypatch.setattr(fs, "pipe_file", failing)
    url = f"s3://hookscope/{uuid.uuid4().hex[:8]}"
    argv = ["extract", "ident.py:make", "--data", "rows.pt", "--layers", "0", "--out", url,
            "--batch-size", "4", "--shard-bytes", "2048", "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"cannot write {url}/shard-00002.safetensors" in err and moto.endpoint in err
    assert "tried 4 times" in err and "16 rows are kept" in err
    command = err.split("resume with:\n  ")[1].strip()
    assert command.startswith("hookscope extract ident.py:make") and command.endswith("--resume")
    monkeypatch.setattr(fs, "pipe_file", pipe_file)
    assert main(command.split()[1:]) == 0
    assert _digests(url, moto.endpoint) == local_digests
    s3fs.S3FileSystem.clear_instance_cache()
    OUTCOMES["clean"] += 1


@pytest.mark.slow
def test_a_wrong_key_against_a_server_that_checks_keys(tmp_path: Path) -> None:
    """moto's server in a process of its own with its access checks on: a key it does not know
    is answered 403, named as refused credentials, and not retried."""
    import socket
    import time

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):  # up to 30 s for it to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        options = fast_client(f"http://127.0.0.1:{port}")
        options.update(key="not-a-key-it-knows", secret="nor-this")
        for call in (lambda: _extract("s3://hookscope/w", options),
                     lambda: open_store("s3://hookscope/w", storage_options=options)):
            with pytest.raises(StoreFaultError, match=r"PermissionError: Forbidden; not retried.*"
                                                      r"credentials were refused") as caught:
                call()
            assert "not-a-key-it-knows" not in str(caught.value) and "nor-this" not in str(caught.value)
            OUTCOMES["clean"] += 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_attack_table() -> None:
    """Printed for the note: every case above that ran and ended in a hookscope error or a
    complete, byte-identical store is clean; any other end fails its own test (raw, silent,
    lost stay 0 when they pass)."""
    tried = sum(OUTCOMES.values())
    print(f"\nS3 faults: tried {tried} clean {OUTCOMES['clean']} raw 0 silent 0 lost 0")
    assert issubclass(StoreFaultError, HookscopeError)
