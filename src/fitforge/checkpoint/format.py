"""The format of a checkpoint's bytes, wherever they are stored: a ``torch.save`` of a dict with a
``format_version`` and a ``checksum`` of its contents, read back with ``weights_only=True``."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fitforge.exceptions import CheckpointError

FORMAT_VERSION = 1


def content_digest(value: Any) -> str:
    """A BLAKE2b digest of a checkpoint's contents: every tensor's dtype, shape and bytes, and every
    other value's repr, walked in a fixed order (dict keys sorted)."""
    digest = hashlib.blake2b(digest_size=16)

    def walk(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            flat = item.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"T{flat.dtype}{tuple(item.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif isinstance(item, dict):
            digest.update(f"D{len(item)}".encode())
            for key in sorted(item, key=repr):
                digest.update(repr(key).encode())
                walk(item[key])
        elif isinstance(item, (list, tuple)):
            digest.update(f"L{len(item)}".encode())
            for element in item:
                walk(element)
        else:
            digest.update(repr(item).encode())

    walk(value)
    return digest.hexdigest()


def with_checksum(checkpoint: dict) -> dict:
    """``checkpoint`` with the ``checksum`` of its contents: the one it carries already (computed by a
    caller that records it, :class:`~fitforge.checkpoint.folder.CheckpointFolder`), else computed now."""
    return checkpoint if "checksum" in checkpoint else {**checkpoint, "checksum": content_digest(checkpoint)}


def checkpoint_bytes(checkpoint: dict) -> bytes:
    """``checkpoint`` as the bytes of a checkpoint file, with the ``checksum`` that
    :func:`checkpoint_from_bytes` verifies (what a CheckpointIO of one's own may store)."""
    buffer = io.BytesIO()
    torch.save(with_checksum(checkpoint), buffer)
    return buffer.getvalue()


def checkpoint_from_bytes(data: bytes, name: str) -> dict:
    """The checkpoint in ``data`` (``name`` in messages), its format and checksum verified."""
    return parse_checkpoint(io.BytesIO(data), name)


def parse_checkpoint(
    source: Path | BinaryIO, path: Path | str, map_location: Any = "cpu", require_checksum: bool = False
) -> dict:
    """Load the checkpoint in ``source`` (called ``path`` in messages) and verify its format version
    and checksum (``require_checksum``: refuse one without a checksum, written before checksums)."""
    try:
        checkpoint = torch.load(source, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err})") from err
    version = checkpoint.get("format_version") if isinstance(checkpoint, dict) else None
    if not isinstance(version, int):
        raise CheckpointError(f"{path} is not a fitforge checkpoint (no format_version)")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}; this fitforge reads up to "
            f"{FORMAT_VERSION}: upgrade fitforge"
        )
    expected = checkpoint.pop("checksum", None)  # files from before checksums have none
    if expected is None and require_checksum:
        raise CheckpointError(f"checkpoint {path} has no checksum: its contents cannot be verified")
    if expected is not None and content_digest(checkpoint) != expected:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its contents no longer match the checksum written "
            "with them (bytes changed on disk)"
        )
    return checkpoint
