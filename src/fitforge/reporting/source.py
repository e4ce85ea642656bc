"""The git commit of the script a run came from, read from the repository's files: no ``git`` process
(a fit starts none), so the dirty flag compares the tracked files with git's index, as ``git status`` does
for tracked files (untracked ones do not count, as in ``git describe --dirty``)."""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from pathlib import Path
from typing import Any

_MOST_FILES = 20_000  # a larger repository's dirty flag is left unknown: its stat calls would slow each fit
_GITLINK = 0o160000  # a submodule's entry: its own repository
_ASSUME_VALID, _EXTENDED, _UNMERGED = 0x8000, 0x4000, 0x3000  # an entry's flags
_SKIP_WORKTREE = 0x4000  # an extended entry's own flags: outside a sparse checkout, absent on purpose


def repository_of(path: str | os.PathLike) -> dict[str, Any] | None:
    """``{"root", "commit", "branch", "dirty"}`` of the git repository holding ``path``, or None. ``branch``
    is None on a detached HEAD, ``dirty`` None where it cannot be told (an index git writes otherwise)."""
    start = Path(path).absolute()
    for root in (start, *start.parents):
        dot = root / ".git"
        if dot.exists():
            break
    else:
        return None
    try:
        git = dot if dot.is_dir() else (root / dot.read_text().removeprefix("gitdir:").strip()).resolve()
        common = (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").exists() else git
        head = (git / "HEAD").read_text().strip()
    except OSError:
        return None
    ref = head.removeprefix("ref: ") if head.startswith("ref: ") else None
    commit = head if ref is None else _resolve(ref, git, common)
    branch = None if ref is None else ref.removeprefix("refs/heads/")
    return {"root": str(root), "commit": commit, "branch": branch, "dirty": _dirty(root, git / "index")}


def _resolve(ref: str, git: Path, common: Path) -> str | None:
    for folder in (git, common):
        if (folder / ref).is_file():
            return (folder / ref).read_text().strip()
    try:
        lines = (common / "packed-refs").read_text().splitlines()
    except OSError:
        return None  # a new repository's branch with no commit yet
    found = [line.split()[0] for line in lines if line.endswith(f" {ref}") and not line.startswith("#")]
    return found[0] if found else None


def _dirty(root: Path, index: Path) -> bool | None:
    """Whether a tracked file differs from git's index (version 2 or 3, SHA-1, whole); None where it cannot be
    told (another version or object format, a split index whose entries are in another file)."""
    try:
        data = index.read_bytes()
        index_mtime = int(index.stat().st_mtime)
        signature, version, count = struct.unpack(">4sLL", data[:12])
    except (OSError, struct.error):
        return None
    if signature != b"DIRC" or version not in (2, 3) or count > _MOST_FILES:
        return None
    entries, position = [], 12
    try:
        for _ in range(count):
            # ctime, ctime_ns, mtime, mtime_ns, dev, ino, mode, uid, gid, size; the blob's id; the flags
            fields = struct.unpack(">10L20sH", data[position : position + 62])
            flags = fields[11]
            extended = version == 3 and flags & _EXTENDED  # two bytes of flags more
            header = 64 if extended else 62
            skipped = extended and struct.unpack(">H", data[position + 62 : position + 64])[0] & _SKIP_WORKTREE
            end = data.index(b"\0", position + header)
            name = data[position + header : end].decode(errors="surrogateescape")
            position += (end - position + 8) & ~7  # the entry is padded with 1 to 8 NULs to a multiple of 8
            if flags & _UNMERGED:  # an unmerged entry: a merge in progress
                return True
            if not (skipped or flags & _ASSUME_VALID or fields[6] == _GITLINK):  # git does not look at these either
                entries.append((root / name, fields))
        if _split(data, position):
            return None
    except (struct.error, ValueError):  # another object format (SHA-256): not read here
        return None
    return any(_changed(file, fields[2:4], fields[6], fields[9], fields[10], index_mtime) for file, fields in entries)


def _split(data: bytes, position: int) -> bool:
    """Whether the index's extensions (from ``position`` to its 20-byte checksum) hold ``link``: a split index."""
    while position + 8 <= len(data) - 20:
        signature, size = struct.unpack(">4sL", data[position : position + 8])
        if signature == b"link":
            return True
        position += 8 + size
    return False


def _changed(file: Path, mtime: tuple[int, int], mode: int, size: int, blob: bytes, index_mtime: int) -> bool:
    try:
        info = file.lstat()
    except OSError:
        return True  # deleted
    if stat.S_ISLNK(mode):
        return not file.is_symlink() or _blob(os.readlink(file).encode()) != blob
    if not stat.S_ISREG(info.st_mode) or (info.st_mode & 0o100) != (mode & 0o100):
        return True
    size_now = info.st_size % 2**32  # the index keeps 32 bits of it
    # Its stat as the index recorded it: unchanged, unless written in the second the index was (git's racy case).
    if size_now == size and (int(info.st_mtime), info.st_mtime_ns % 10**9) == mtime and mtime[0] < index_mtime:
        return False
    return size_now != size or _blob(file.read_bytes()) != blob


def _blob(content: bytes) -> bytes:
    """git's object id of a blob of ``content`` (SHA-1)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).digest()
