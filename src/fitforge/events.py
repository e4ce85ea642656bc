"""Event handlers: the six mixins and their base (public face of :mod:`fitforge.core.events`).

A handler is any object inheriting some of the mixins; it is called for an event if and only if it
inherits that event's mixin.

Example:
    >>> class PrintLoss(EpochEnd):
    ...     def epoch_end(self, state):
    ...         print(state.epoch, state.metrics.get("train_loss"))
"""

from fitforge.core.events import (
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    Event,
    EventHandler,
    Stage,
    TrainBegin,
    TrainEnd,
)

__all__ = [
    "BackwardEnd",
    "BatchBegin",
    "BatchEnd",
    "EpochBegin",
    "EpochEnd",
    "Event",
    "EventHandler",
    "Stage",
    "TrainBegin",
    "TrainEnd",
]
