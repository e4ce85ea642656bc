"""Checkpointing and resume: atomic versioned files (a local folder, or committed objects in an object
store), their naming and rotation, and the training state a checkpoint holds (``CheckpointHandler``
itself is :mod:`fitforge.handlers.checkpoint`)."""

from fitforge.checkpoint.async_writer import AsyncCheckpointIO
from fitforge.checkpoint.format import checkpoint_bytes, checkpoint_from_bytes
from fitforge.checkpoint.objects import FsspecCheckpointIO
from fitforge.checkpoint.storage import CheckpointIO, LocalCheckpointIO

__all__ = [
    "AsyncCheckpointIO",
    "CheckpointIO",
    "FsspecCheckpointIO",
    "LocalCheckpointIO",
    "checkpoint_bytes",
    "checkpoint_from_bytes",
]
