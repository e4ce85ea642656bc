"""Checkpoints as objects in a store named by an fsspec URL (``s3://bucket/run``, ``memory://run``).

Object stores have no atomic rename, so a checkpoint counts only once a marker ``<name>.commit`` (its
size and BLAKE2b digest), written after the data, describes it; a marker is deleted before new bytes
replace its object and after its object is deleted (docs/checkpoints.md#object-storage).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import json
import logging
import zipfile
from typing import Any

from fitforge.checkpoint.format import checkpoint_bytes, parse_checkpoint
from fitforge.checkpoint.locations import EXTENSION, SINGLES, TEMP_SUFFIX, ObjectPath
from fitforge.exceptions import CheckpointError, FitforgeValueError

log = logging.getLogger("fitforge")

COMMIT_SUFFIX = ".commit"


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in it; a clear ImportError when a package is missing."""
    try:
        from fsspec.core import url_to_fs
    except ImportError as err:
        raise ImportError(f'a checkpoint URL ({url!r}) needs fsspec: pip install "fitforge[cloud]"') from err
    try:
        return url_to_fs(url, **(storage_options or {}))
    except ImportError as err:  # fsspec's message names the package the protocol needs (s3fs, gcsfs...)
        advice = 'pip install "fitforge[cloud]" (s3fs)' if url.startswith(("s3://", "s3a://")) else str(err)
        raise ImportError(f"the checkpoint URL {url!r} needs a package that is not installed: {advice}") from err
    except ValueError as err:  # "Protocol not known: s4"
        raise FitforgeValueError(
            f"the checkpoint URL {url!r} names no storage fsspec knows ({err}); use a local folder, or a URL such as "
            "s3://bucket/run, gs://bucket/run, memory://run or file:///path"
        ) from err


def upload(fs: Any, key: str, data: bytes) -> None:
    """Put ``data`` under ``key`` in one piece (the reliability tests replace it to kill mid-upload)."""
    fs.pipe_file(key, data)


def _commit(fs: Any, key: str, data: bytes) -> None:
    marker = {"size": len(data), "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}
    fs.pipe_file(key + COMMIT_SUFFIX, json.dumps(marker).encode())


def read_object(fs: Any, key: str, map_location: Any = "cpu") -> dict:
    """Load the committed checkpoint ``key``; a CheckpointError when uncommitted, unmatched or unloadable."""
    url = fs.unstrip_protocol(key)
    try:
        marker = json.loads(fs.cat_file(key + COMMIT_SUFFIX))
    except FileNotFoundError:
        fs.invalidate_cache(key)  # a listing cached before another process uploaded would hide the object
        if not fs.exists(key):
            raise FileNotFoundError(f"no checkpoint at {url}") from None
        raise CheckpointError(
            f"checkpoint {url} is not committed (no {key.rsplit('/', 1)[-1]}{COMMIT_SUFFIX}): its upload did not finish"
        ) from None
    except ValueError as err:
        raise CheckpointError(f"the commit marker of {url} is unreadable ({err})") from err
    if not isinstance(marker, dict):
        raise CheckpointError(f"the commit marker of {url} is not a fitforge marker")
    try:
        data = fs.cat_file(key)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {url} is committed but its object is gone") from None
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    if (len(data), digest) != (marker.get("size"), marker.get("blake2b")):
        raise CheckpointError(
            f"checkpoint {url} does not match its commit marker ({len(data)} bytes, {marker.get('size')} "
            "committed): an upload that did not finish, or bytes changed in the store"
        )
    return parse_checkpoint(io.BytesIO(data), url, map_location)


def remove(fs: Any, key: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(key)


def entries(fs: Any, folder: str) -> dict[str, str]:
    """The names of the objects in ``folder`` and their types ("file", "directory"; none when it does
    not exist), listed afresh: another process may have written since (fsspec caches listings)."""
    fs.invalidate_cache(folder)
    try:
        return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry["type"] for entry in fs.ls(folder, detail=True)}
    except FileNotFoundError:
        return {}


def load_url(url: str, storage_options: dict[str, Any] | None = None, map_location: Any = "cpu") -> dict:
    """Load the committed checkpoint at ``url`` (see :func:`read_object`)."""
    fs, key = open_store(url, storage_options)
    return read_object(fs, key, map_location)


class FsspecCheckpointIO:
    """A :class:`~fitforge.checkpoint.storage.CheckpointIO` of an object-store folder named by an fsspec URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.key = open_store(url, storage_options)
        self.key, self.storage_options = self.key.rstrip("/"), dict(storage_options or {})
        self.root = ObjectPath(self.fs.unstrip_protocol(self.key))
        self.foreign: set[str] = set()  # whole objects under checkpoint names that are no fitforge checkpoint

    def location(self, name: str) -> ObjectPath:
        return self.root / name

    def folder_path(self, name: str) -> str:
        return str(self.root / name)

    def names(self) -> list[str]:
        """The committed checkpoints, the foreign objects under checkpoint names and the shard folders."""
        present = entries(self.fs, self.key)
        return [
            name
            for name, kind in present.items()
            if kind == "directory" or name + COMMIT_SUFFIX in present or name in self.foreign
        ]

    def write(self, name: str, checkpoint: dict) -> None:
        key = f"{self.key}/{name}"
        try:
            data = checkpoint_bytes(checkpoint)  # built in memory first: the object goes up in one piece
            remove(self.fs, key + COMMIT_SUFFIX)  # an earlier marker must not vouch for the bytes going up now
            upload(self.fs, key, data)
            _commit(self.fs, key, data)
        except OSError as err:
            raise CheckpointError(
                f"cannot upload {self.root / name}: {err}; the checkpoints committed before are intact"
            ) from err

    def read(self, name: str) -> dict:
        if name in self.foreign:
            raise CheckpointError(
                f"{self.root / name} is not a fitforge checkpoint (a whole file without a fitforge checksum, "
                "not written by a fitforge save); it is left as it is"
            )
        return read_object(self.fs, f"{self.key}/{name}")

    def write_text(self, name: str, text: str) -> None:
        """Put a text object (the run's manifest): an object store replaces an object whole or not at all."""
        self.fs.pipe_file(f"{self.key}/{name}", text.encode())

    def read_text(self, name: str) -> str:
        """A text object's contents (FileNotFoundError when there is none)."""
        return bytes(self.fs.cat_file(f"{self.key}/{name}")).decode()

    def delete(self, name: str) -> None:
        key = f"{self.key}/{name}"
        if self.fs.isdir(key):  # the shards of a sharded checkpoint
            self.fs.rm(key, recursive=True)
        else:  # delete, then uncommit: the other order would leave a whole checkpoint the next start commits
            remove(self.fs, key)
            remove(self.fs, key + COMMIT_SUFFIX)

    def prepare(self, prefix: str) -> None:
        """Settle ``prefix``'s uncommitted objects (:meth:`settle_uncommitted`), check the store can be written."""
        patterns = (f"{prefix}-epoch*batch*{EXTENSION}", *(f"{prefix}-{kind}{EXTENSION}" for kind in SINGLES))
        committed, removed, foreign = self.settle_uncommitted(patterns)
        probe = f"{self.key}/.{prefix}-probe{TEMP_SUFFIX}"  # an OSError where the store cannot be written
        self.fs.pipe_file(probe, b"")
        self.fs.rm_file(probe)
        if committed:
            log.info(
                "CheckpointHandler: committed %d whole checkpoint(s) of prefix %r in %s that had no commit marker "
                "(copied in, or uploaded by a run stopped before its commit; their contents verified): %s",
                len(committed),
                prefix,
                self.root,
                committed,
            )
        if foreign:
            log.warning(
                "CheckpointHandler: %s holds %d file(s) under checkpoint names of prefix %r that are not fitforge "
                "checkpoints (no commit marker, no fitforge checksum): %s. They are left as they are, never resumed "
                "from, and count as an earlier run's files",
                self.root,
                len(foreign),
                prefix,
                foreign,
            )
        if removed:
            log.warning(
                "CheckpointHandler: removed %d uncommitted object(s) of prefix %r from %s (uploads cut short, or "
                "commit markers without their object; see docs/checkpoints.md#object-storage): %s",
                len(removed),
                prefix,
                self.root,
                removed,
            )

    def __repr__(self) -> str:
        return f"FsspecCheckpointIO({str(self.root)!r})"

    def settle_uncommitted(self, patterns: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
        """Settle the objects matching ``patterns`` that no marker commits: commit a whole fitforge checkpoint,
        delete an upload cut short (and markers without their object), leave a foreign file. Returns the
        (committed, deleted, foreign) names."""
        present = set(entries(self.fs, self.key))

        def ours(name: str) -> bool:  # of this prefix's names only: another run's objects are none of ours
            return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

        adopted: list[str] = []
        strays: list[str] = []
        for name in sorted(present):
            if ours(name) and name + COMMIT_SUFFIX not in present:
                key = f"{self.key}/{name}"
                data = self.fs.cat_file(key)
                if not zipfile.is_zipfile(io.BytesIO(data)):  # torch.save writes a zip, whose directory comes last
                    strays.append(name)
                    continue
                try:
                    parse_checkpoint(io.BytesIO(data), str(self.root / name), require_checksum=True)
                except CheckpointError:
                    self.foreign.add(name)
                    continue
                _commit(self.fs, key, data)
                adopted.append(name)
            elif name.endswith(COMMIT_SUFFIX):
                data_name = name.removesuffix(COMMIT_SUFFIX)
                if data_name not in present and ours(data_name):
                    strays.append(name)
        for name in strays:
            remove(self.fs, f"{self.key}/{name}")
        return adopted, strays, sorted(self.foreign)
