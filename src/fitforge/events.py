"""Event handlers: the mixins, their base and the named stages (public face of
:mod:`fitforge.core.events`).

A handler is any object inheriting some of the mixins; it is called for an event if and only if it
inherits that event's mixin (narrowed by ``handled_events`` when it declares them).

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
