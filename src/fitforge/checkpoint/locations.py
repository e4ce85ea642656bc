"""Where a checkpoint lives: a local path (a ``file://`` URL too: it keeps the atomic rename), or an
object in a store named by an fsspec URL (``s3://bucket/run``, ``memory://run``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

EXTENSION = ".pt"
TEMP_SUFFIX = ".tmp"  # a file (or folder) being written, renamed into place once whole
SINGLES = ("best", "nonfinite")  # one file each, replaced at each save: <prefix>-best.pt, <prefix>-nonfinite.pt
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]+://")  # two letters at least: "C:\\" is a Windows drive


def is_url(where: object) -> bool:
    """Whether ``where`` names an object store (a URL other than ``file://``)."""
    if isinstance(where, ObjectPath):
        return True
    return isinstance(where, str) and bool(_URL.match(where)) and not where.startswith("file://")


def local_path(where: str | os.PathLike) -> Path:
    """The local path of a plain path or a ``file://`` URL."""
    if isinstance(where, str) and where.startswith("file://"):
        return Path(unquote(urlsplit(where).path))
    return Path(where)


@dataclass(frozen=True)
class ObjectPath:
    """The URL of an object (or folder) in a store, or ``<repr of a CheckpointIO>/<name>``; it has a
    :class:`~pathlib.Path`'s ``name``."""

    url: str

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url.rstrip('/')}/{name}")

    def __str__(self) -> str:
        return self.url


Location = Path | ObjectPath  # where one checkpoint file is
