"""CheckpointFolder: the checkpoints of one CheckpointHandler in its CheckpointIO: names, listing,
commits (FSDP shard folders included), rotation and the cleanup of what a crash left behind."""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from collections.abc import Callable
from functools import partial

from fitforge.checkpoint.async_writer import AsyncCheckpointIO
from fitforge.checkpoint.files import check_fits, restore_weights
from fitforge.checkpoint.finite import non_finite_checkpoint
from fitforge.checkpoint.format import with_checksum
from fitforge.checkpoint.locations import EXTENSION, SINGLES, Location, ObjectPath
from fitforge.checkpoint.storage import CheckpointIO, LocalCheckpointIO, write_checked
from fitforge.core.state import EstimatorLike
from fitforge.exceptions import CheckpointError, FitforgeValueError

log = logging.getLogger("fitforge")

SHARDS = ".dcp"  # the folder of an FSDP checkpoint's shards: the file's name with this suffix
_REGULAR = re.compile(r"-epoch(\d+)batch(\d+)" + re.escape(EXTENSION))


def describe_tensors(tensors: list[str], shown: int = 4) -> str:
    """The first tensor names of a list, and how many more."""
    more = f" and {len(tensors) - shown} more" if len(tensors) > shown else ""
    return ", ".join(tensors[:shown]) + more


class CheckpointFolder:
    """``<prefix>-epoch<E>batch<B>.pt`` (regular, rotated) and ``<prefix>-<kind>.pt`` (single) checkpoints
    in ``io``; an FSDP checkpoint's shards in a ``.dcp`` folder beside it."""

    def __init__(self, io: CheckpointIO, prefix: str, background: bool = False) -> None:
        if not isinstance(prefix, str) or not re.fullmatch(r"[\w.-]+", prefix):
            raise FitforgeValueError(
                f"CheckpointHandler: model_prefix must be a non-empty file-name prefix "
                f"(letters, digits, '_', '-', '.'), got {prefix!r}"
            )
        self.store, self.prefix = io, prefix
        local = io.path if isinstance(io, LocalCheckpointIO) else None
        url = getattr(io, "root", None)  # an fsspec folder's URL (a store of one's own: its repr names it)
        root = local if local is not None else url if isinstance(url, ObjectPath) else None
        self.path: Location = root if root is not None else ObjectPath(repr(io))
        self.label = f"model_dir {str(self.path)!r}" if root is not None else f"io {self.path}"  # in messages
        self.local = local is not None
        # With ``background``, writes (and what follows them: rotation) go through an
        # AsyncCheckpointIO; ``store`` is the io itself, which the background tasks use.
        self.checksums: dict[str, str] = {}  # name -> the checksum of each checkpoint written (the run's manifest)
        self.background = AsyncCheckpointIO(io, self.label, self.checksums) if background else None
        self.files: CheckpointIO = io if self.background is None else self.background
        self._holds_shard_folders = False  # whether a rotation may have shard folders to delete

    def location(self, name: str) -> Location:
        """Where the checkpoint ``name`` is, as ``saved`` and messages name it."""
        locate = getattr(self.files, "location", None)
        return locate(name) if callable(locate) else self.path / name

    def read(self, name: str) -> dict:
        """The checkpoint ``name``: FileNotFoundError when there is none; the store's failures a CheckpointError."""
        try:
            return self.files.read(name)
        except (CheckpointError, FileNotFoundError):
            raise
        except Exception as err:
            raise CheckpointError(f"{name} cannot be read from {self.label}: {type(err).__name__}: {err}") from err

    def newest_loadable(
        self, estimator: EstimatorLike, loaded: list[dict], read_only: bool, check: Callable[[dict], None]
    ) -> str | None:
        """Load the newest checkpoint that loads into ``loaded`` (only read, with ``read_only``) and return its
        name (None: none), skipping corrupt or unfitting ones; ``check`` sees each before it is loaded."""
        files = self.regular_files()
        if not files:
            singles = [location.name for location in self.earlier_files()]  # best, nonfinite: no state to go on from
            if singles:
                log.info("CheckpointHandler: no periodic checkpoint to resume from in %s (only %s)", self.path, singles)
            else:
                log.info("CheckpointHandler: no checkpoint in %s: training from scratch", self.path)
            return None
        reasons = []
        for path in reversed(files):
            try:
                checkpoint = self.read(path.name)
                poisoned = non_finite_checkpoint(checkpoint, estimator.net)  # older versions wrote such files
                if poisoned:
                    raise CheckpointError(f"its weights or optimizer state hold nan/inf ({describe_tensors(poisoned)})")
                check(checkpoint)
                if read_only:  # the other ranks load too: judge whether it fits without loading it
                    check_fits(estimator, checkpoint, self.shards)
                    loaded.append(checkpoint)
                else:
                    loaded.append(restore_weights(estimator, checkpoint, folder=self.shards))
            except CheckpointError as err:
                log.warning("CheckpointHandler: skipping checkpoint %s: %s", path.name, err)
                reasons.append(f"{path.name}: {err}")
                continue
            return path.name
        raise CheckpointError(
            f"resume_from_checkpoint: none of the {len(files)} checkpoint(s) in {self.path} "
            f"can be loaded ({'; '.join(reasons)}); move them away to train from scratch"
        )

    def regular(self, epochs: int, batches: int) -> Location:
        return self.location(f"{self.prefix}-epoch{epochs}batch{batches}{EXTENSION}")

    def single(self, kind: str) -> Location:
        return self.location(f"{self.prefix}-{kind}{EXTENSION}")

    def exists(self, location: Location) -> bool:
        """Whether a (committed) checkpoint is at ``location``."""
        return location.name in self.files.names()

    def regular_files(self) -> list[Location]:
        """The regular checkpoints, oldest first (by completed epochs, then batches)."""
        names = fnmatch.filter(self.files.names(), f"{self.prefix}-epoch*batch*{EXTENSION}")
        matches = [(_REGULAR.fullmatch(name[len(self.prefix) :]), name) for name in names]
        found = sorted(((int(match[1]), int(match[2])), name) for match, name in matches if match)
        return [self.location(name) for _, name in found]

    def earlier_files(self) -> list[Location]:
        """Every (committed) checkpoint of this prefix: the regular ones, oldest first, then best, nonfinite."""
        return self.regular_files() + [location for location in map(self.single, SINGLES) if self.exists(location)]

    def remove(self, locations: list[Location]) -> None:
        """Delete the checkpoints at ``locations`` (by exact name) and the FSDP shard folders they name."""
        for location in locations:
            self.files.delete(location.name)
        self._remove_unnamed_shards()

    def prepare(self) -> None:
        """Ready the store (its IO's ``prepare``) and remove the shard folders no checkpoint names."""
        prepare = getattr(self.files, "prepare", None)
        try:
            if callable(prepare):
                prepare(self.prefix)
        except Exception as err:  # OSErrors; botocore's own (an endpoint it cannot reach); a store's own
            if self.local and isinstance(err, OSError):
                raise FitforgeValueError(
                    f"CheckpointHandler: {self.label} is not a writable folder ({err.strerror or err}); pass a "
                    "folder you can write to"
                ) from err
            raise FitforgeValueError(
                f"CheckpointHandler: {self.label} cannot be written ({type(err).__name__}: {err}); check that it "
                "exists and can be written (for an object store: that the bucket exists, its endpoint is reachable "
                "and the credentials allow writing; see docs/checkpoints.md)"
            ) from err
        self._remove_unnamed_shards()

    @property
    def holds_shards(self) -> bool:
        """Whether the store can hold FSDP's shard folders (its IO has ``folder_path``)."""
        return callable(getattr(self.files, "folder_path", None))

    def shards(self, name: str) -> tuple[str | os.PathLike, dict]:
        """Where the shard folder ``name`` is (a local path or an fsspec URL) and the store's options."""
        if not self.holds_shards:
            raise CheckpointError(f"FSDP's sharded checkpoints cannot be kept in {self.label}: it has no folder_path")
        return self.files.folder_path(name), dict(getattr(self.files, "storage_options", None) or {})  # type: ignore[attr-defined]

    def _remove_unnamed_shards(self) -> None:
        """Delete FSDP shard folders whose checkpoint is gone (a crash during a rotation or a save)."""
        present = set(self.files.names())
        self._holds_shard_folders = any(name.endswith(SHARDS) for name in present)
        unnamed = [
            name
            for name in fnmatch.filter(present, f"{self.prefix}-epoch*batch*pos*{SHARDS}")
            if f"{name[: name.rindex('pos')]}{EXTENSION}" not in present
        ]
        for kind in SINGLES:
            if f"{self.prefix}-{kind}{EXTENSION}" not in present:
                unnamed += fnmatch.filter(present, f"{self.prefix}-{kind}-epoch*{SHARDS}")
        for name in unnamed:
            self.files.delete(name)

    def then(self, task: Callable[[], None]) -> None:
        """Run ``task`` after the writes in flight (in the background), or now."""
        if self.background is not None:
            self.background.after(task)
        else:
            task()

    def _delete_matching(self, pattern: str, keep: str = "") -> None:
        for name in fnmatch.filter(self.store.names(), pattern):
            if name != keep:
                self.store.delete(name)

    def commit(self, checkpoint: dict, path: Location, stale: str = "") -> None:
        """Write the checkpoint (after its shards: a crash before it leaves the previous one in force), then
        delete the shard folders matching ``stale`` that it no longer names; its checksum is recorded in
        ``checksums`` once written (in the background, by the background writer)."""
        if self.background is None:  # summed here, where save_checkpoint would sum it: the same cost
            checkpoint = with_checksum(checkpoint)
        write_checked(self.files, path.name, checkpoint, self.label)
        if self.background is None:
            self.checksums[path.name] = checkpoint["checksum"]
        if "sharded" in checkpoint:
            self._holds_shard_folders = True
            self.then(partial(self._delete_matching, stale, keep=checkpoint["sharded"]))

    def rotate(self, saved: list[Location], keep: int) -> None:
        """Delete the oldest of ``saved`` (and their shards) until ``keep`` remain."""
        while len(saved) > keep:
            old = saved.pop(0).name
            self.files.delete(old)
            if self._holds_shard_folders:
                self.then(partial(self._delete_matching, f"{old.removesuffix(EXTENSION)}pos*{SHARDS}"))
