"""Event handlers: the mixins, their base, the named stages (:mod:`fitforge.core.events`), the roles a
handler declares (:mod:`fitforge.core.roles`), and the :class:`~fitforge.core.state.Ending` a stop may
give (``state.request_stop(reason, ending=...)``). A handler is called for an event if and only if it
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
    Wrapping,
)
from fitforge.core.roles import (
    Accompanied,
    Accumulating,
    KeyRecording,
    Monitoring,
    Stopping,
    Validating,
    ValidationSetup,
    WeightAveraging,
    players,
    plays,
    role_of,
    unwrapped,
)
from fitforge.core.state import Ending

__all__ = [
    "Accompanied",
    "Accumulating",
    "BackwardEnd",
    "BatchBegin",
    "BatchEnd",
    "Ending",
    "EpochBegin",
    "EpochEnd",
    "Event",
    "EventHandler",
    "KeyRecording",
    "Monitoring",
    "Stage",
    "Stopping",
    "TrainBegin",
    "TrainEnd",
    "Validating",
    "ValidationSetup",
    "WeightAveraging",
    "Wrapping",
    "players",
    "plays",
    "role_of",
    "unwrapped",
]
