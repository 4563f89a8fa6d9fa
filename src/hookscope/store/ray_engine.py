"""Extraction on Ray Data: actors write whole shards, this process (the driver) the manifest.

``extract(..., engine="ray")`` runs the code one process runs (``hookscope.store.extraction``,
``shard_loop``, ``batch_rows``: the first batch is checked by the driver, then each batch goes
through ``_rows`` and ``_keep_batch`` and each shard through ``writer.write_shard``); only who
runs which batches changes. The driver cuts the remaining batches into shards of a fixed number
of batches, names each shard file as one process would (``shard-00000.safetensors`` ...), and hands
``(file, first batch, stop batch)`` to a Ray Data ``map_batches`` over a pool of actors. Each actor holds
a copy of the model and the data (pickled once, with cloudpickle), loads its own batches by
index (``BatchSource``) and writes its shard by the writer's protocol (``fs.write_atomic``:
in a folder, temporary name, fsync, rename; at a URL such as ``s3://``, a local temporary file
uploaded in one PUT, so an object appears whole or not at all). The driver lists a shard in
``manifest.json`` once it and every shard before it are written, so after any crash the manifest
lists complete shards from the first on, as one process's does, and ``resume`` goes on from
there.

Before any actor starts, the cluster's nodes must hold every actor's ``num_cpus`` and
``num_gpus`` (``check_resources``): Ray would otherwise wait for them forever. A run that fails
(an actor's error, raised here as one process raises it) deletes the shards finished out of
order that no manifest lists, so the folder keeps only what its manifest lists.

A worker killed mid-shard is restarted by Ray and its shard computed and written again under
the same name (Ray Data's policy for actor pools: an actor that dies is restarted, without a
limit; an error the code raises is not retried but raised by the driver). No shard is written
under two names, and the temporary file a killed worker left in a folder is deleted when the
run ends (at a URL nothing of a shard is there before its one PUT).
Shards hold ``ceil(shard_bytes / first batch's bytes)`` batches (on resume, as many as the
interrupted run's first shard): where one process closes its shards when every batch has the
same bytes, so the store is then byte for byte one process's, run id aside (each run draws its
own, kept in its manifest and every shard's metadata), when that process runs torch with the
threads an actor has (Ray gives it ``num_cpus``; ``torch.set_num_threads(1)`` for the default):
torch's CPU kernels may sum in another order with other thread counts, and the rows then
differ in their last bits (2.4e-7 apart seen in float32). With ragged rows (tokens) the rows, ids
and order are one process's and the shards are cut by batch count.

``out`` must be a place every actor can write: a folder (one machine, or a file system all nodes
mount at the same path; a relative one is made absolute here) or a URL of a shared service
(``s3://``, ``gs://``); ``memory://`` is refused (``check_reachable``). The folder goes to the
actors with the job, pickled through Ray, and with it fsspec's file system and its
``storage_options`` (credentials included; never written into the store); credentials taken
from the environment must be in the actors' environment too.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from hookscope.errors import ExtractError
from hookscope.store.folder import remove_temporary
from hookscope.store.fs import StorePath, in_this_process
from hookscope.store.writer import StoreWriter

__all__ = ["Engine", "RayEngine", "ShardMade", "Work", "as_engine", "check_data", "check_reachable",
           "share", "write_on_ray"]

ShardMade = tuple[int, int, str, tuple[str, ...]]  # rows, bytes, digest, chunk sums
# what an actor runs for a shard: (function, reference of its shared first argument, the
# arguments after it); it calls function(shared, *arguments, file name, first, stop batch)
Work = tuple[Callable[..., ShardMade], Any, tuple[Any, ...]]


@dataclass(frozen=True)
class RayEngine:
    """How ``extract(..., engine=RayEngine(...))`` uses Ray (``engine="ray"``: the defaults).

    Attributes:
        actors: Ray actors, each holding a copy of the model (default 2).
        address: the cluster to join when Ray is not initialized yet (``ray.init(address)``;
            ``None``: a running cluster named by ``RAY_ADDRESS``, else a new local one).
        num_cpus: CPUs each actor reserves (Ray sets its torch threads to this; default 1).
        num_gpus: GPUs each actor reserves (default 0); above 0 an actor moves its copy of
            the model to ``cuda`` (its own GPU: Ray sets ``CUDA_VISIBLE_DEVICES``).
    """

    actors: int = 2
    address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0


Engine = str | RayEngine


def as_engine(engine: Any) -> RayEngine | None:
    """Return the Ray options that ``engine`` asks for, ``None`` for ``"local"``.

    Raises:
        ExtractError: ``engine`` is neither ``"local"``, ``"ray"`` nor a ``RayEngine`` with
            positive counts; or Ray (``ray[data]``) is not installed.
    """
    if isinstance(engine, str) and engine == "local":
        return None
    if isinstance(engine, str) and engine == "ray":
        engine = RayEngine()
    if not isinstance(engine, RayEngine):
        raise ExtractError(f"extract(engine={engine!r:.60}): engine must be 'local', 'ray' or a "
                           f"hookscope.RayEngine(actors=...)")
    if type(engine.actors) is not int or engine.actors < 1 or not engine.num_cpus >= 0 or \
            not engine.num_gpus >= 0:
        raise ExtractError(f"{engine}: actors must be a positive int, num_cpus and num_gpus "
                           f"numbers >= 0, e.g. RayEngine(actors=2, num_cpus=1)")
    try:
        import ray.data  # noqa: F401  (the optional extra; imported here only)
    except ImportError as err:
        raise ExtractError("engine='ray' needs Ray Data: pip install 'hookscope[ray]'") from err
    return engine


def check_data(count: int | None) -> None:
    """Raise ``ExtractError`` unless the data has a length (Ray cuts it into shards up front)."""
    if count is None:
        raise ExtractError("engine='ray' needs data with a length (a Dataset, or a DataLoader "
                           "over one) so that the batches can be handed out by index")


def check_reachable(folder: StorePath) -> None:
    """Raise ``ExtractError`` unless the actors, other processes, can write into ``folder``.

    Raises:
        ExtractError: ``folder`` is in this process's memory (``memory://``).
    """
    if in_this_process(folder):
        raise ExtractError(
            f"engine='ray' has its actors, processes of their own, upload the shards, and "
            f"{folder} is in this process's memory (fsspec's memory:// is one file system per "
            f"process): each actor would write into its own memory, out of this store's reach. "
            f"Extract into a URL every actor reaches (s3://, gs://) or a folder they all can "
            f"write, or leave engine out to write memory:// from this process")


def check_resources(engine: RayEngine, nodes: list[dict[str, Any]]) -> None:
    """Raise unless the cluster's live ``nodes`` (``ray.nodes()``) can hold every actor: each
    asks ``num_cpus`` CPUs and ``num_gpus`` GPUs of one node, and all of them at once (Ray
    Data starts the whole pool before the first shard). Ray would otherwise wait for them
    forever. Nodes an autoscaler may add later are not counted.

    Raises:
        ExtractError: no node has an actor's CPUs or GPUs, or the nodes together cannot hold
            ``actors`` of them; the message gives what the cluster has and the fix.
    """
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    fits = sum(_actors_on(node, engine) for node in alive)
    if fits >= engine.actors:
        return
    cpus = [float(n.get("CPU", 0)) for n in alive]
    gpus = [float(n.get("GPU", 0)) for n in alive]
    raise ExtractError(
        f"the Ray cluster cannot start {engine.actors} actor(s) of num_cpus={engine.num_cpus:g}, "
        f"num_gpus={engine.num_gpus:g}: its {len(alive)} node(s) have CPUs {cpus} and GPUs "
        f"{gpus}, room for {fits} such actor(s), and Ray would wait for the rest forever. Ask "
        f"for less (RayEngine(actors={max(fits, 1)}, num_cpus=..., num_gpus=...); --ray-actors), "
        f"or join a larger cluster (address=..., --ray-address)")


def _actors_on(node: dict[str, Any], engine: RayEngine) -> int:
    """How many actors of ``engine`` one node of ``node`` resources holds."""
    counts = [int(float(node.get(name, 0)) // need + 1e-9) if need > 0 else 10**9
              for name, need in (("CPU", engine.num_cpus), ("GPU", engine.num_gpus))]
    return min(counts)


def share(engine: RayEngine, value: Any) -> Any:
    """Put ``value`` (the model and the data inside) in Ray's object store once, for every
    actor, joining the cluster first (``ray.init(engine.address)`` unless Ray is initialized)
    and checking that it can give the actors what they ask (``check_resources``); return its
    reference.

    Raises:
        ExtractError: the cluster lacks the actors' resources, or ``value`` does not pickle
            (nothing is written yet).
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=engine.address)
    check_resources(engine, ray.nodes())  # type: ignore[no-untyped-call]
    try:
        return ray.put(value)
    except Exception as err:  # noqa: BLE001  (cloudpickle raises TypeError, PicklingError, ...)
        raise ExtractError(
            f"engine='ray' sends the model and the data to the actors pickled, and they do not "
            f"pickle ({type(err).__name__}: {str(err).strip().splitlines()[0][:200]}): keep no "
            f"locks, open files or threads on them, or extract in this process "
            f"(engine='local')") from err


def write_on_ray(engine: RayEngine, work: Work, writer: StoreWriter, start: int,
                 per_shard: int, count: int, *, progress: bool, stop: Any) -> bool:
    """Write batches ``start:count`` as shards of ``per_shard`` batches on Ray actors, each
    listed in ``writer``'s manifest once it and the ones before it are written.

    Args:
        work: what an actor runs for one shard (``shard_loop.write_batch_range`` over the
            shared job, ``share``): ``... (file name, first batch, stop batch) -> (rows,
            bytes, digest, sums)``.
        stop: the run's graceful stop (its ``asked`` ends the run after the next shard).

    Returns:
        ``True`` when every shard is listed, ``False`` when a Ctrl-C stopped the run first.

    Raises:
        Exception: the one an actor raised, as one process raises it (e.g. ``ExtractError``
            for a batch whose rows change shape, or the model's own error).
        ExtractError: Ray itself failed (the cluster is gone).
    """
    plan = [(writer.shard_name(j), first, min(first + per_shard, count))
            for j, first in enumerate(range(start, count, per_shard))]
    bar = tqdm(total=sum(b1 - b0 for _, b0, b1 in plan), unit="batch", desc="extract (ray)",
               disable=not progress, dynamic_ncols=True)
    done: dict[int, ShardMade] = {}
    listed = 0  # shards of ``plan`` listed in the manifest
    results = _run(engine, work, plan)
    try:
        for index, made in results:
            done[index] = made
            while listed in done:  # in order: a manifest lists shards from the first on
                (name, b0, b1), (rows, size, digest, sums) = plan[listed], done.pop(listed)
                writer.add(name, rows, (b0, b1), size, digest, sums)
                bar.update(b1 - b0)
                listed += 1
            if stop is not None and stop.asked:
                return False
    except BaseException:
        results.close()  # Ray Data's run ends (its actors are killed) before the clean-up
        _remove_unlisted(writer, [name for name, _, _ in plan[listed:]])
        raise
    finally:
        results.close()  # a stop or an error ends Ray Data's run too
        bar.close()
    remove_temporary(writer.folder, writer.run)
    return True


def _remove_unlisted(writer: StoreWriter, names: list[str]) -> None:
    """Delete the shards ``names`` of a failed run (finished out of order, never listed) and
    its temporary files: the folder keeps what the manifest lists."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (writer.folder / name).unlink()
    remove_temporary(writer.folder, writer.run)


def _run(engine: RayEngine, work: Work, plan: list[tuple[str, int, int]]
         ) -> Generator[tuple[int, ShardMade], None, None]:
    """Yield ``(index in plan, made)`` as the actors finish shards, in any order."""
    import ray
    import ray.data

    if not plan:
        return
    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False  # ours is shown
    try:
        items = [{"index": j, "file": f, "start": b0, "stop": b1}
                 for j, (f, b0, b1) in enumerate(plan)]
        shards = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _ShardWorker, fn_constructor_args=(work,), batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=min(engine.actors, len(plan))),  # no idle one
            num_cpus=engine.num_cpus,
            num_gpus=engine.num_gpus)
        for row in shards.iter_rows():
            if row["error"]:
                raise pickle.loads(row["error"])
            sums = tuple(str(row["chunk_sum"]).split(",")) if row["chunk_sum"] else ()
            yield int(row["index"]), (int(row["rows"]), int(row["bytes"]), str(row["digest"]),
                                      sums)
    except ray.exceptions.RayError as err:
        raise ExtractError(f"the Ray run failed ({type(err).__name__}: "
                           f"{str(err).strip().splitlines()[0][:300]}); the shards finished in "
                           f"order are listed: continue with resume=True (--resume)") from err
    finally:
        context.enable_progress_bars = bars


def _pickled(err: Exception) -> bytes:
    """``err`` pickled for the driver to raise (an ``ExtractError`` saying it, when it does not
    pickle): Ray Data sends a task's exception back as text only."""
    try:
        text = pickle.dumps(err)
        pickle.loads(text)
        return text
    except Exception:  # noqa: BLE001  (any error's text still reaches the driver)
        return pickle.dumps(ExtractError(f"a Ray actor raised {type(err).__name__}: {err}"))


class _ShardWorker:
    """A Ray actor's state: the run's work (model and data inside), unpickled once."""

    def __init__(self, work: Work):
        import ray

        function, shared, arguments = work
        if isinstance(shared, ray.ObjectRef):
            shared = ray.get(shared)
        self.work = functools.partial(function, shared, *arguments)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        made, errors = [], []
        for f, b0, b1 in zip(batch["file"], batch["start"], batch["stop"]):
            try:  # the error one process would raise, raised again by the driver
                made.append(self.work(str(f), int(b0), int(b1)))
                errors.append(b"")
            except Exception as err:  # noqa: BLE001  (sent to the driver, not retried)
                made.append((0, 0, "", ()))
                errors.append(_pickled(err))
        return {"index": batch["index"], "error": np.array(errors, dtype=object),
                "rows": np.array([m[0] for m in made], dtype=np.int64),
                "bytes": np.array([m[1] for m in made], dtype=np.int64),
                "digest": np.array([m[2] for m in made]),
                "chunk_sum": np.array([",".join(m[3]) for m in made])}
