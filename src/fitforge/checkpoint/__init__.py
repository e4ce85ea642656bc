"""Checkpointing and resume: atomic versioned files (in a local folder, or committed objects in an
object store named by an fsspec URL), the folder's naming and rotation, the training
state a checkpoint holds and resuming from it. (The data order it saves is the input side's,
:mod:`fitforge.inputs.order`; the signals that stop a fit are the run's, :mod:`fitforge.signals.preemption`.)

It may import :mod:`fitforge.metrics`, :mod:`fitforge.inputs`, :mod:`fitforge.distributed`,
:mod:`fitforge.core` and :mod:`fitforge.exceptions`. ``CheckpointHandler`` itself lives with the other built-in handlers
(:mod:`fitforge.handlers.checkpoint`), so that ``fitforge.handlers`` exports it.
"""

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
