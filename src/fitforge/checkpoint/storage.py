"""Where checkpoints are kept: the :class:`CheckpointIO` protocol, and a local folder as one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fitforge.checkpoint.files import load_checkpoint, save_checkpoint, write_text_atomic
from fitforge.checkpoint.locations import SINGLES, TEMP_SUFFIX, is_url, local_path
from fitforge.checkpoint.objects import FsspecCheckpointIO  # fsspec itself is imported for a URL only
from fitforge.exceptions import CheckpointError, FitforgeTypeError, FitforgeValueError, describe


@runtime_checkable
class CheckpointIO(Protocol):
    """Checkpoints stored by file name: what a ``CheckpointHandler(io=...)`` saves through. The optional
    ``prepare(prefix)``, ``location(name)``, ``folder_path(name)`` and ``write_text(name, text)`` /
    ``read_text(name)`` (the run's ``manifest.json``) are used when present (docs/extending.md)."""

    def write(self, name: str, checkpoint: dict) -> None:
        """Store ``checkpoint`` under ``name``, whole or not at all, serialized (or copied) before returning:
        its tensors are the training's own."""

    def read(self, name: str) -> dict:
        """The checkpoint ``name``: FileNotFoundError when there is none, a CheckpointError when not whole."""

    def names(self) -> list[str]:
        """The names of the checkpoints stored (in any order)."""

    def delete(self, name: str) -> None:
        """Remove the checkpoint ``name`` (nothing when there is none)."""


class LocalCheckpointIO:
    """A local folder, each file written atomically (:func:`~fitforge.checkpoint.files.save_atomic`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = local_path(path)

    def location(self, name: str) -> Path:
        return self.path / name

    folder_path = location  # FSDP's shard folders are beside the files

    def names(self) -> list[str]:
        try:
            return [entry.name for entry in self.path.iterdir() if not entry.name.startswith(".")]
        except FileNotFoundError:
            return []

    def write(self, name: str, checkpoint: dict) -> None:
        save_checkpoint(checkpoint, self.path / name)

    def read(self, name: str) -> dict:
        return load_checkpoint(self.path / name)

    def write_text(self, name: str, text: str) -> None:
        """Write a text file (the run's manifest) atomically, creating the folder."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(text, self.path / name)

    def read_text(self, name: str) -> str:
        """A text file's contents (FileNotFoundError when there is none)."""
        return (self.path / name).read_text()

    def delete(self, name: str) -> None:
        target = self.path / name
        if target.is_dir():  # the shards of a sharded checkpoint
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)

    def prepare(self, prefix: str) -> None:
        """Create the folder, remove ``prefix``'s leftovers of interrupted saves, check it is writable."""
        self.path.mkdir(parents=True, exist_ok=True)
        for name in (f"{prefix}-epoch", *(f"{prefix}-{kind}" for kind in SINGLES)):  # not another prefix's
            for leftover in self.path.glob(f".{name}*{TEMP_SUFFIX}"):
                if leftover.is_dir():  # the shards of an interrupted sharded save
                    shutil.rmtree(leftover)
                else:  # a temporary file of a save interrupted by a crash
                    leftover.unlink(missing_ok=True)
        probe = self.path / f".{prefix}-probe{TEMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()

    def __repr__(self) -> str:
        return f"LocalCheckpointIO({str(self.path)!r})"


def write_checked(io: CheckpointIO, name: str, checkpoint: dict, label: str) -> None:
    """``io.write(name, checkpoint)``, a store's own error as a CheckpointError naming ``label``, the store."""
    try:
        io.write(name, checkpoint)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"cannot write {name} to {label}: {type(err).__name__}: {err}; the checkpoints saved before are intact"
        ) from err


def resolve_io(
    model_dir: str | os.PathLike | None, io: Any, storage_options: dict[str, Any] | None, owner: str
) -> CheckpointIO:
    """Where a handler keeps its checkpoints: ``io`` (checked), or the folder or URL ``model_dir``."""
    if (model_dir is None) == (io is None):
        raise FitforgeValueError(
            f"{owner}: give a model_dir (a folder or an fsspec URL) or an io (a CheckpointIO), "
            + ("not both" if io is not None else "got neither")
        )
    if storage_options is not None and not isinstance(storage_options, dict):
        raise FitforgeTypeError(f"{owner}: storage_options must be a dict or None, got {describe(storage_options)}")
    if io is not None:
        if storage_options:
            raise FitforgeValueError(f"{owner}: storage_options are for a model_dir URL; give them to your io")
        missing = [method for method in ("write", "read", "names", "delete") if not callable(getattr(io, method, None))]
        if isinstance(io, type):
            raise FitforgeTypeError(f"{owner}: io must be an instance: pass io={io.__name__}(...), not the class")
        if missing:
            raise FitforgeTypeError(
                f"{owner}: io must be a CheckpointIO (methods write(name, checkpoint), read(name), names(), "
                f"delete(name)); {describe(io)} lacks {', '.join(missing)}"
            )
        return io
    if not isinstance(model_dir, (str, os.PathLike)):
        raise FitforgeTypeError(
            f"{owner}: model_dir must be a folder path, got {describe(model_dir)} (or an fsspec URL such as "
            "'s3://bucket/run')"
        )
    if is_url(model_dir):
        return FsspecCheckpointIO(str(model_dir), storage_options)
    if storage_options:
        raise FitforgeValueError(
            f"storage_options are for an fsspec URL, but {str(model_dir)!r} is a local path; leave them out"
        )
    return LocalCheckpointIO(model_dir)
