"""CheckpointFolder: the files of one CheckpointHandler in its ``model_dir`` — names, listing, atomic
commits (FSDP shard folders included), rotation and the cleanup of what a crash left behind."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from fitforge.checkpoint.files import TEMP_SUFFIX, check_fits, load_checkpoint, restore_weights, save_checkpoint
from fitforge.core.finite import non_finite_checkpoint
from fitforge.core.state import EstimatorLike
from fitforge.exceptions import CheckpointError, FitforgeValueError

log = logging.getLogger("fitforge")

EXTENSION = ".pt"
SHARDS = ".dcp"  # the folder of an FSDP checkpoint's shards: the file's name with this suffix
SINGLES = ("best", "nonfinite")  # one file each, replaced at each save: <prefix>-best.pt, <prefix>-nonfinite.pt
_REGULAR = re.compile(r"-epoch(\d+)batch(\d+)" + re.escape(EXTENSION))


def describe_tensors(tensors: list[str], shown: int = 4) -> str:
    """The first tensor names of a list, and how many more."""
    more = f" and {len(tensors) - shown} more" if len(tensors) > shown else ""
    return ", ".join(tensors[:shown]) + more


class CheckpointFolder:
    """``<prefix>-epoch<E>batch<B>.pt`` (regular, rotated) and ``<prefix>-<kind>.pt`` (single) files
    in ``path``; an FSDP checkpoint's shards in a ``.dcp`` folder its file names, beside it."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path, self.prefix = path, prefix

    def newest_loadable(
        self,
        estimator: EstimatorLike,
        loaded: list[dict],
        read_only: bool,
        check: Callable[[dict], None] | None = None,
    ) -> str | None:
        """Load the newest checkpoint that loads into ``loaded`` (only read it, with ``read_only``);
        its file name (None: there is none). A corrupt or unfitting file is skipped with a warning;
        if there are files and none loads, a CheckpointError lists every file and why. ``check``
        sees the newest readable one before anything is loaded from it: an error it raises (other
        than a CheckpointError) refuses the resume with nothing changed."""
        files = self.regular_files()
        if not files:
            log.info("CheckpointHandler: no checkpoint in %s: training from scratch", self.path)
            return None
        reasons = []
        for path in reversed(files):
            try:
                checkpoint = load_checkpoint(path)
                poisoned = non_finite_checkpoint(checkpoint, estimator.net)  # older versions wrote such files
                if poisoned:
                    raise CheckpointError(f"its weights or optimizer state hold nan/inf ({describe_tensors(poisoned)})")
                if check is not None:
                    check(checkpoint)
                if read_only:  # the other ranks load too: judge whether it fits without loading it
                    check_fits(estimator, checkpoint, self.path)
                    loaded.append(checkpoint)
                else:
                    loaded.append(restore_weights(estimator, checkpoint, folder=self.path))
            except CheckpointError as err:
                log.warning("CheckpointHandler: skipping checkpoint %s: %s", path.name, err)
                reasons.append(f"{path.name}: {err}")
                continue
            return path.name
        raise CheckpointError(
            f"resume_from_checkpoint: none of the {len(files)} checkpoint(s) in {self.path} "
            f"can be loaded ({'; '.join(reasons)}); move them away to train from scratch"
        )

    def regular(self, epochs: int, batches: int) -> Path:
        return self.path / f"{self.prefix}-epoch{epochs}batch{batches}{EXTENSION}"

    def single(self, kind: str) -> Path:
        return self.path / f"{self.prefix}-{kind}{EXTENSION}"

    def regular_files(self) -> list[Path]:
        """The regular checkpoints, oldest first (by completed epochs, then batches)."""
        found = []
        for path in self.path.glob(f"{self.prefix}-epoch*batch*{EXTENSION}"):
            match = _REGULAR.fullmatch(path.name[len(self.prefix) :])
            if match:
                found.append(((int(match[1]), int(match[2])), path))
        return [path for _, path in sorted(found)]

    def earlier_files(self) -> list[Path]:
        """Every checkpoint file of this prefix in the folder: the regular ones, oldest first, then the
        single ones (best, nonfinite)."""
        return self.regular_files() + [path for path in map(self.single, SINGLES) if path.is_file()]

    def remove(self, files: list[Path]) -> None:
        """Delete ``files`` and the FSDP shard folders they name."""
        for path in files:
            path.unlink(missing_ok=True)
        self._remove_unnamed_shards()

    def prepare(self) -> None:
        """Create the folder, remove what an interrupted save left, and check it is writable."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for pattern in (f"{self.prefix}-epoch", *(f"{self.prefix}-{kind}" for kind in SINGLES)):
                for leftover in self.path.glob(f".{pattern}*{TEMP_SUFFIX}"):
                    if leftover.is_dir():  # the shards of an interrupted FSDP save
                        shutil.rmtree(leftover)
                    else:  # a temporary file of a save interrupted by a crash
                        leftover.unlink(missing_ok=True)
            self._remove_unnamed_shards()
            probe = self.path / f".{self.prefix}-probe{TEMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise FitforgeValueError(
                f"CheckpointHandler: model_dir {str(self.path)!r} is not a writable folder "
                f"({err.strerror or err}); pass a folder you can write to"
            ) from err

    def _remove_unnamed_shards(self) -> None:
        """Delete FSDP shard folders whose checkpoint file is gone (a crash during a rotation)."""
        for folder in self.path.glob(f"{self.prefix}-epoch*batch*pos*{SHARDS}"):
            if not (self.path / f"{folder.name[: folder.name.rindex('pos')]}{EXTENSION}").exists():
                shutil.rmtree(folder)
        for kind in SINGLES:
            if not self.single(kind).exists():
                for folder in self.path.glob(f"{self.prefix}-{kind}-epoch*{SHARDS}"):
                    shutil.rmtree(folder)

    def temporary_shards(self, name: str) -> Path:
        """Where the shards a checkpoint will name ``name`` are written before :meth:`commit`."""
        return self.path / f".{name}{TEMP_SUFFIX}"

    def commit(self, checkpoint: dict, path: Path, shards: Path | None, stale: str = "") -> None:
        """Put the shards under their name, then write the file that names them (atomic: the file is
        the last thing written, so a crash before it leaves the previous checkpoint in force), then
        delete the folders matching ``stale`` that the file no longer names."""
        if shards is None:
            save_checkpoint(checkpoint, path)
            return
        final = self.path / checkpoint["sharded"]
        if final.exists():  # a leftover no file names (a crash after its rename)
            shutil.rmtree(final)
        os.replace(shards, final)
        save_checkpoint(checkpoint, path)
        for old in self.path.glob(stale):
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)

    def rotate(self, saved: list[Path], keep: int) -> None:
        """Delete the oldest of ``saved`` (and their shards) until ``keep`` remain: by exact name,
        once the newest is durable."""
        while len(saved) > keep:
            old = saved.pop(0)
            old.unlink(missing_ok=True)
            for folder in self.path.glob(f"{old.stem}pos*{SHARDS}"):
                shutil.rmtree(folder, ignore_errors=True)
