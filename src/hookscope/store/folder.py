"""Private: which files of an output folder belong to a store, and making the folder ready.

Nothing of the user's is ever deleted. A store owns exactly: its manifests (``manifest.json``, or
the ``manifest-rNNNN.json`` parts of an unfinished torchrun run) when they parse and pass the
schema; the shard files, listed or left unlisted by the crash of a run, that have a shard's exact
name and are regular files whose safetensors metadata says ``hookscope.store`` (a user's file
that a manifest lists is not the store's); and hookscope's own temporary files
(``.NAME.tmp-PID...`` of one of those names). ``overwrite`` deletes those files one by one
and never a folder; any other file or folder in the output makes it refuse, naming the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

from hookscope.errors import StoreCorruptError, StoreExistsError
from hookscope.store.manifest import FORMAT, SHARD_NAME, check_manifest, parse_json, read_regular
from hookscope.util.files import TEMPORARY

MANIFEST = "manifest.json"
_MANIFEST_NAME = re.compile(r"manifest(-r\d{4})?\.json")


def check_output(folder: Path, *, resume: bool, overwrite: bool) -> None:
    """Raise unless ``folder`` may receive a store with these options (writes nothing).

    Raises:
        StoreExistsError: ``folder`` is a file; or it holds files and neither ``resume`` nor
            ``overwrite`` is set; or it holds a file or folder that is not the store's
            (named), or no valid store at all, with ``resume`` or ``overwrite``.
    """
    if folder.exists() and not folder.is_dir():
        raise StoreExistsError(f"output {folder} exists and is a file, not a store folder; "
                               f"choose another output path.")
    names = sorted(os.listdir(folder)) if folder.is_dir() else []
    if not names:
        return
    if not resume and not overwrite:
        raise StoreExistsError(
            f"output folder {folder} already exists and is not empty; nothing was written. To "
            f"continue an interrupted run pass resume=True (--resume); to replace the store in "
            f"it pass overwrite=True (--overwrite); or choose another output folder.")
    flag = "resume=True (--resume)" if resume else "overwrite=True (--overwrite)"
    owned = owned_files(folder, flag)
    foreign = [n for n in names if n not in owned]
    if foreign:
        raise StoreExistsError(
            f"refusing {flag} on {folder}: {_listing(foreign)} "
            f"{'is' if len(foreign) == 1 else 'are'} not part of the hookscope store there, and "
            f"hookscope never deletes or writes beside what it did not write. Move "
            f"{'it' if len(foreign) == 1 else 'them'} away, or choose another output folder.")


def prepare_output(folder: Path, *, resume: bool, overwrite: bool) -> None:
    """Check as ``check_output`` does, then make ``folder`` ready to write: create it, delete
    the old store's files with ``overwrite``, its leftover temporary files with ``resume``."""
    check_output(folder, resume=resume, overwrite=overwrite)
    if resume and not (folder.is_dir() and any(_MANIFEST_NAME.fullmatch(n)
                                               for n in os.listdir(folder))):
        what = "holds no store" if folder.is_dir() and os.listdir(folder) else \
            "is empty or does not exist"  # the run's lock has created it by now
        warnings.warn(f"resume: {folder} {what}, so there is nothing to resume; starting afresh",
                      UserWarning, stacklevel=3)
    folder.mkdir(parents=True, exist_ok=True)
    for name in sorted(owned_files(folder, "")):
        if overwrite or TEMPORARY.fullmatch(name):
            (folder / name).unlink()


@contextlib.contextmanager
def writing(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if missing) while one process writes a store
    into it: an advisory ``flock`` on the folder itself, so no lock file is left behind and a
    killed run releases it. A second extraction into the same folder meanwhile is refused.

    Raises:
        StoreExistsError: another process holds the lock (an extraction into ``folder`` runs).
    """
    folder.mkdir(parents=True, exist_ok=True)
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


def owned_files(folder: Path, flag: str) -> set[str]:
    """Return the names in ``folder`` that its store owns (see the module docstring).

    Raises:
        StoreExistsError: ``folder`` holds files but no manifest, or a manifest that is not a
            valid hookscope manifest (the store's own files cannot then be known).
    """
    names = set(os.listdir(folder))
    manifests = sorted(n for n in names if _MANIFEST_NAME.fullmatch(n))
    owned = set(manifests)
    for name in manifests:
        try:
            if (folder / name).is_symlink():
                raise StoreCorruptError(f"{folder / name} is a symbolic link")
            manifest = parse_json(read_regular(folder / name))
            check_manifest(manifest, folder / name)
        except (OSError, ValueError) as err:
            raise StoreExistsError(
                f"refusing {flag or 'to touch'} {folder}: {name} there is not a valid hookscope "
                f"manifest ({str(err).split(';')[0]}), so which files are the store's is "
                f"unknown. Move the folder away, or delete it yourself.") from err
    if names and not manifests and flag:
        files = sorted(names - {n for n in names if _is_temporary(n)})
        if files:
            raise StoreExistsError(
                f"refusing {flag} on {folder}: it is not a hookscope store (no {MANIFEST}; it "
                f"holds {_listing(files)}). Choose another output folder.")
    owned.update(n for n in names if SHARD_NAME.fullmatch(n) and _is_store_shard(folder / n))
    owned.update(n for n in names if _is_temporary(n))
    return {n for n in owned if n in names and not (folder / n).is_symlink()
            and (folder / n).is_file()}


def _is_temporary(name: str) -> bool:
    match = TEMPORARY.fullmatch(name)
    if match is None:
        return False
    return bool(_MANIFEST_NAME.fullmatch(match["target"]) or SHARD_NAME.fullmatch(match["target"]))


def _is_store_shard(path: Path) -> bool:
    """True for a regular file whose safetensors metadata says it is a hookscope shard."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = parse_json(f.read(min(length, 2**20)))
        return bool(header["__metadata__"]["format"] == FORMAT)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
