"""The storage behind a :class:`~fitforge.checkpoint.folder.CheckpointFolder`: how one checkpoint
file is written, read, listed and deleted. :class:`LocalFiles` (a folder on disk, written
atomically by rename) and :class:`~fitforge.checkpoint.objects.ObjectFiles` (an object store,
written then committed by a marker) play the same :class:`Files` role; naming, rotation and the
choice of the checkpoint to resume from are the folder's, the same for both."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from fitforge.checkpoint.files import load_checkpoint, save_checkpoint
from fitforge.checkpoint.locations import Location, ObjectPath, is_url, local_path
from fitforge.checkpoint.objects import ObjectFiles  # fsspec itself is imported for a URL only
from fitforge.exceptions import FitforgeValueError


class Files(Protocol):
    """Checkpoint files in one folder, by name. Only committed files are listed, read or existing:
    a crash in the middle of a write never shows."""

    @property
    def root(self) -> Location:
        """The folder, as messages name it."""
        ...

    def location(self, name: str) -> Location: ...
    def names(self, pattern: str) -> list[str]:
        """The committed files whose names match the glob ``pattern``."""
        ...

    def write(self, checkpoint: dict, name: str) -> None: ...
    def read(self, name: str) -> dict: ...
    def exists(self, name: str) -> bool: ...
    def delete(self, name: str) -> None: ...


class LocalFiles:
    """A local folder: a file is written to a temporary file, fsynced and renamed over its name
    (:func:`~fitforge.checkpoint.files.save_atomic`), so every file under a name is committed."""

    def __init__(self, path: Path) -> None:
        self.root = self.path = path

    def location(self, name: str) -> Path:
        return self.path / name

    def names(self, pattern: str) -> list[str]:
        return [path.name for path in self.path.glob(pattern)]

    def write(self, checkpoint: dict, name: str) -> None:
        save_checkpoint(checkpoint, self.path / name)

    def read(self, name: str) -> dict:
        return load_checkpoint(self.path / name)

    def exists(self, name: str) -> bool:
        return (self.path / name).is_file()

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)


def open_files(where: str | os.PathLike | ObjectPath, storage_options: dict[str, Any] | None = None) -> Files:
    """The files of folder ``where``: a local path (or ``file://`` URL), or an fsspec URL."""
    if isinstance(where, ObjectPath) or is_url(where):
        return ObjectFiles(str(where), storage_options)
    if storage_options:
        raise FitforgeValueError(
            f"storage_options are for an fsspec URL, but {str(where)!r} is a local path; leave them out"
        )
    return LocalFiles(local_path(where))
