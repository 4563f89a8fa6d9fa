"""Private: which files of an output folder belong to a store, and making the folder ready.

Nothing of the user's is ever deleted, and no file is taken for the store's from its name
alone. A store owns exactly:

- its manifests (``manifest.json``, or the ``manifest-rNNNN.json`` parts of an unfinished
  torchrun run) when they parse, pass the schema and carry one run id (``"run"``, 32 hex digits
  the writer draws when a store is started and keeps on resume);
- the shards a manifest lists, when the file there is a regular file whose size agrees with the
  manifest and, before anything is deleted, whose digest agrees too; before a resume appends to
  them, whose safetensors metadata carries the run id and, for the last shard a manifest lists
  (the one written last), whose final chunk agrees with its ``chunk_sum``: a few KiB per shard
  instead of every byte, so resuming a large store does not re-read it (damage elsewhere is
  caught by the read-time chunk checks and ``Store.verify()``);
- shards that a crash left unlisted, when their safetensors metadata carries the manifest's run
  id (the writer writes it into every shard);
- its temporary files ``.NAME.tmp-RUN-PID-RANDOM`` (``NAME`` a manifest's or a shard's), when
  ``RUN`` is the manifests' run id, or, for a manifest's temporary file in a folder whose first
  manifest was never renamed into place, when the file is a complete manifest of that run id.

``overwrite`` deletes those files one by one and never a folder; ``resume`` deletes only the
temporary files. Any other file or folder in the output makes either refuse, naming the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import struct
import warnings
from collections.abc import Iterator
from typing import Any

from hookscope.errors import StoreCorruptError, StoreExistsError
from hookscope.store.fs import RemotePath, StorePath, listdir, open_read, read_range
from hookscope.store.manifest import (
    DIGESTS,
    FORMAT,
    MAX_MANIFEST_BYTES,
    SHARD_NAME,
    check_manifest,
    parse_json,
    read_regular,
)
from hookscope.store.shards import MANIFEST, chunk_sums

__all__ = ["check_output", "listed_shards", "owned_files", "prepare_output", "writing"]

_MANIFEST_NAME = re.compile(r"manifest(-r[0-9]{4})?\.json")  # ASCII digits: see SHARD_NAME
TEMPORARY = re.compile(r"\.(?P<target>.+)\.tmp-(?P<run>[0-9a-f]{32})-[0-9]+-[0-9a-f]{8}")


def check_output(folder: StorePath, *, resume: bool, overwrite: bool) -> None:
    """Raise unless ``folder`` may receive a store with these options (writes nothing).

    Raises:
        StoreExistsError: ``folder`` is a file; or it holds files and neither ``resume`` nor
            ``overwrite`` is set (a folder that holds no store: the message names another
            folder as the fix); or it holds a file or folder that is not the store's
            (named; a listed shard is the store's only while its size and digest agree with the
            manifest), or no valid store at all, with ``resume`` or ``overwrite``.
        StoreFaultError: ``folder`` is at a URL whose bucket does not exist (it is never
            created), or whose object store cannot be reached (``hookscope.store.faults``).
    """
    if isinstance(folder, RemotePath):
        folder.check_bucket()  # a missing bucket is refused, never created
    if folder.exists() and not folder.is_dir():
        raise StoreExistsError(f"output {folder} exists and is a file, not a store folder; "
                               f"choose another output path.")
    names = listdir(folder) if folder.is_dir() else []
    if not names:
        return
    files = [n for n in names if not _is_temporary(folder, n, None)]
    if not resume and not overwrite and files and not any(map(_MANIFEST_NAME.fullmatch, names)):
        raise StoreExistsError(  # resume or overwrite would be refused too: not suggested
            f"output folder {folder} already exists and is not a hookscope store (no {MANIFEST}; "
            f"it holds {_listing(files)}); nothing was written. hookscope never deletes or "
            f"writes beside files it did not write, so neither resume nor overwrite would use "
            f"it: choose another output folder (a new or empty one), or move those files away.")
    if not resume and not overwrite:
        raise StoreExistsError(
            f"output folder {folder} already exists and is not empty; nothing was written. To "
            f"continue an interrupted run pass resume=True (--resume); to replace the store in "
            f"it pass overwrite=True (--overwrite); or choose another output folder.")
    flag = "resume=True (--resume)" if resume else "overwrite=True (--overwrite)"
    owned = owned_files(folder, flag, deleting=overwrite, resuming=resume)
    foreign = [n for n in names if n not in owned]
    changed = [n for n in foreign if n in listed_shards(folder)]
    note = (f" ({_listing(changed)}: listed by the manifest, but a link, or its size, digest, "
            f"run id or final chunk differ: edited or replaced since it was written; restore it "
            f"from a copy)"
            if changed else "")
    if foreign:
        raise StoreExistsError(
            f"refusing {flag} on {folder}: {_listing(foreign)} "
            f"{'is' if len(foreign) == 1 else 'are'} not part of the hookscope store there, and "
            f"hookscope never deletes or writes beside what it did not write{note}. Move "
            f"{'it' if len(foreign) == 1 else 'them'} away, or choose another output folder.")


def prepare_output(folder: StorePath, *, resume: bool, overwrite: bool) -> None:
    """Check as ``check_output`` does, then make ``folder`` ready to write: create it, delete
    the old store's files with ``overwrite``, its leftover temporary files with ``resume``."""
    check_output(folder, resume=resume, overwrite=overwrite)
    if resume and not (folder.is_dir() and any(_MANIFEST_NAME.fullmatch(n)
                                               for n in listdir(folder))):
        what = "holds no store" if folder.is_dir() and listdir(folder) else \
            "is empty or does not exist"  # the run's lock has created it by now
        warnings.warn(f"resume: {folder} {what}, so there is nothing to resume; starting afresh",
                      UserWarning, stacklevel=3)
    folder.mkdir(parents=True, exist_ok=True)
    for name in sorted(owned_files(folder, "", deleting=overwrite)):
        if overwrite or TEMPORARY.fullmatch(name):
            (folder / name).unlink()


@contextlib.contextmanager
def writing(folder: StorePath) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if missing) while one process writes a store
    into it: an advisory ``flock`` on the folder itself, so no lock file is left behind and a
    killed run releases it. A second extraction into the same folder meanwhile is refused. A
    store at a URL has no lock (``hookscope.store.fs``).

    Raises:
        StoreExistsError: another process holds the lock (an extraction into ``folder`` runs).
    """
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(folder, RemotePath):  # an object store has no lock (hookscope.store.fs)
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise StoreExistsError(
                f"another process is extracting into {folder} right now; two runs into one "
                f"folder would mix their shards. Wait for it to end, or choose another output "
                f"folder.") from err
        yield
    finally:
        os.close(fd)  # releases the lock


def owned_files(folder: StorePath, flag: str, *, deleting: bool = False,
                resuming: bool = False) -> set[str]:
    """Return the names in ``folder`` that its store owns (see the module docstring).

    Args:
        flag: the option asking (for the error); ``""`` when the folder was checked already.
        deleting: the files are to be deleted (overwrite): a listed shard is the store's only
            when its digest agrees with the manifest too (reads it; the digest is kept while the
            file's inode, size and mtime stay the same).
        resuming: a resume is to append to the listed shards: a listed shard is the store's
            only when its metadata carries the run id, and the last one a manifest lists only
            when its final chunk agrees with its ``chunk_sum`` too (reads the header and one
            chunk, ``CHUNK_BYTES`` at most, not the shards).

    Raises:
        StoreExistsError: ``folder`` holds files but no manifest, a manifest that is not a valid
            hookscope manifest, or manifests of different runs (the store's own files cannot
            then be known).
    """
    names = set(listdir(folder))
    manifests = {n: _manifest(folder, n, flag) for n in sorted(names) if _MANIFEST_NAME.fullmatch(n)}
    run = _run_id(folder, manifests, flag)
    if names and not manifests and flag:
        files = sorted(n for n in names if not _is_temporary(folder, n, None))
        if files:
            raise StoreExistsError(
                f"refusing {flag} on {folder}: it is not a hookscope store (no {MANIFEST}; it "
                f"holds {_listing(files)}). Choose another output folder.")
    listed = {entry["file"]: (entry, m["version"]) for m in manifests.values() for entry in m["shards"]}
    owned = {n for n in names - set(listed) if _regular(folder / n) and (
        n in manifests or _is_temporary(folder, n, run) or _is_run_shard(folder / n, run))}
    last = {m["shards"][-1]["file"]: int(m["chunk_bytes"]) for m in manifests.values()
            if m["shards"]}
    owned.update(n for n, (entry, version) in listed.items()
                 if _is_listed_shard(folder / n, entry, version, deleting) and
                 (not resuming or _resumable(folder / n, entry, run, last.get(n))))
    return owned


def listed_shards(folder: StorePath) -> set[str]:
    """The shard names the manifests in ``folder`` list (``owned_files`` has checked them)."""
    return {entry["file"] for name in listdir(folder) if _MANIFEST_NAME.fullmatch(name)
            for entry in _manifest(folder, name, "")["shards"]}


def _manifest(folder: StorePath, name: str, flag: str) -> dict[str, Any]:
    try:
        if (folder / name).is_symlink():
            raise StoreCorruptError(f"{folder / name} is a symbolic link")
        manifest = parse_json(read_regular(folder / name, max_bytes=MAX_MANIFEST_BYTES))
        check_manifest(manifest, folder / name)
    except (OSError, ValueError) as err:
        raise StoreExistsError(
            f"refusing {flag or 'to touch'} {folder}: {name} there is not a valid hookscope "
            f"manifest ({str(err).split(';')[0]}), so which files are the store's is "
            f"unknown. Move the folder away, or delete it yourself.") from err
    return manifest  # type: ignore[no-any-return]


def _run_id(folder: StorePath, manifests: dict[str, dict[str, Any]], flag: str) -> str | None:
    """The run id all ``manifests`` carry (``None``: none, or written before run ids)."""
    runs = {name: m.get("run") for name, m in manifests.items()}
    if len(set(runs.values())) > 1:
        raise StoreExistsError(
            f"refusing {flag or 'to touch'} {folder}: its manifests come from different runs "
            f"({', '.join(f'{n}: {r}' for n, r in runs.items())}), so one of them is a copy from "
            f"another store and which files are this store's is unknown. Move the copy away, or "
            f"choose another output folder.")
    return next(iter(runs.values()), None)


def _regular(path: StorePath) -> bool:
    return not path.is_symlink() and path.is_file()


def _is_listed_shard(path: StorePath, entry: dict[str, Any], version: int, deleting: bool) -> bool:
    """True when ``path`` is the shard the manifest ``entry`` (of a store of ``version``) lists:
    size (and the digest when ``deleting``) agree."""
    if not _regular(path):
        return False
    status = path.stat()
    if status.st_size != entry["bytes"]:
        return False
    digest = DIGESTS[version]
    return not deleting or _digest(path, status.st_ino, status.st_size, status.st_mtime_ns,
                                   version) == entry[digest.name]


def _resumable(path: StorePath, entry: dict[str, Any], run: str | None,
               chunk_bytes: int | None) -> bool:
    """True when a listed shard (its size agreeing) may be appended to: its metadata carries
    run id ``run`` (when the store has one) and, with ``chunk_bytes`` (the manifest's last
    shard), its final chunk agrees with the manifest's last ``chunk_sum``. Reads the header
    and at most one chunk."""
    if run is not None and not _is_run_shard(path, run):
        return False
    if chunk_bytes is None:
        return True
    status = path.stat()
    return _tail_sum(path, status.st_ino, status.st_size, status.st_mtime_ns,
                     chunk_bytes) == str(entry["chunk_sum"][-1])


@functools.lru_cache(maxsize=256)
def _tail_sum(path: StorePath, inode: int, size: int, mtime_ns: int, chunk_bytes: int) -> str:
    """``chunk_sum`` of the final chunk of the ``size``-byte file at ``path`` (cached while its
    inode, size and mtime stay the same: a resume checks the folder twice)."""
    begin = (size - 1) // chunk_bytes * chunk_bytes
    tail = read_range(path, begin, size)
    return chunk_sums(tail, len(tail), chunk_bytes)[0] if len(tail) == size - begin else ""


@functools.lru_cache(maxsize=256)
def _digest(path: StorePath, inode: int, size: int, mtime_ns: int, version: int) -> str:
    """The digest of a version-``version`` store (``DIGESTS``) of the file at ``path`` (cached
    while its inode, size and mtime stay the same)."""
    hashed = DIGESTS[version].new()
    with open_read(path) as f:
        while block := f.read(16 * 2**20):
            hashed.update(block)
    return str(hashed.hexdigest())


def remove_temporary(folder: StorePath, run: str) -> None:
    """Delete the temporary files of run ``run`` in ``folder``: those a writer killed while
    writing left behind (a Ray actor killed mid-shard; its shard is written again)."""
    for name in listdir(folder):
        if _is_temporary(folder, name, run):
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()


def _is_temporary(folder: StorePath, name: str, run: str | None) -> bool:
    """True for a temporary file this store's writer made (see the module docstring)."""
    match = TEMPORARY.fullmatch(name)
    if match is None or not (_MANIFEST_NAME.fullmatch(match["target"])
                             or SHARD_NAME.fullmatch(match["target"])):
        return False
    if run is not None:
        return match["run"] == run
    if not _MANIFEST_NAME.fullmatch(match["target"]) or not _regular(folder / name):
        return False
    try:  # the first manifest, written but not yet renamed: its content proves it
        manifest = parse_json(read_regular(folder / name, max_bytes=MAX_MANIFEST_BYTES))
        check_manifest(manifest, folder / name)
    except (OSError, ValueError):
        return False
    return bool(manifest.get("run") == match["run"])


def _is_run_shard(path: StorePath, run: str | None) -> bool:
    """True for a shard of run ``run`` (one a crash left unlisted, or a listed one before a
    resume): a regular file named as a shard whose safetensors metadata says it is a hookscope
    shard of that run. Reads the header only."""
    if run is None or not SHARD_NAME.fullmatch(path.name) or not _regular(path):
        return False
    try:
        (length,) = struct.unpack("<Q", read_range(path, 0, 8))
        header = parse_json(read_range(path, 8, 8 + min(length, 2**20)))
        metadata = header["__metadata__"]
        return bool(metadata["format"] == FORMAT and metadata["run"] == run)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
