"""Event handlers: the mixins, their base, the named stages (:mod:`fitforge.core.events`), the roles a
handler declares (:mod:`fitforge.core.roles`), the run's services handlers share
(:mod:`fitforge.core.services`: ``Services``, ``Undoable``), ``state.run``
(:class:`~fitforge.core.state.RunControl`), and the :class:`~fitforge.core.state.Ending` a stop may
give (``state.run.stop(reason, ending=...)``). docs/handlers.md is the reference.
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
from fitforge.core.services import Services, Undoable
from fitforge.core.state import Ending, RunControl

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
    "RunControl",
    "Services",
    "Stage",
    "Stopping",
    "TrainBegin",
    "TrainEnd",
    "Undoable",
    "Validating",
    "ValidationSetup",
    "WeightAveraging",
    "Wrapping",
    "players",
    "plays",
    "role_of",
    "unwrapped",
]

# Roles that became the run's services (issue 47): an old import says where each went.
_BECAME = {
    "FirstBatchCheck": "offer the check: services.first_batch_checks.append(self.check_first_batch)",
    "StateConfirming": "offer it: services.before_save.append(self.confirm_state)",
    "Checkpointing": "offer the handler: services.checkpoints.append(self)",
    "EpochLines": "offer it: services.epoch_lines.append(self.shows_epoch_lines)",
    "NonFiniteGuarding": "offer it: services.guards_nonfinite = True",
    "RunningSums": "offer the sums: services.undoables.append(Undoable(mark, rewind))",
}


def __getattr__(name: str) -> object:
    if name in _BECAME:
        raise ImportError(
            f"fitforge.events.{name} is no longer a role: what handlers share is the run's services; in your "
            f"handler's offer(self, services), {_BECAME[name]} (docs/handlers.md, Services)"
        )
    raise AttributeError(f"module 'fitforge.events' has no attribute {name!r}")
