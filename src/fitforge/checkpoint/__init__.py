"""Checkpointing and resume: atomic versioned files, the folder's naming and rotation, the training
state a checkpoint holds and resuming from it, the data order, preemption by signals.

It may import :mod:`fitforge.distributed`, :mod:`fitforge.metrics`, :mod:`fitforge.core` and
:mod:`fitforge.exceptions`. ``CheckpointHandler`` itself lives with the other built-in handlers
(:mod:`fitforge.handlers.checkpoint`), so that ``fitforge.handlers`` exports it.
"""
