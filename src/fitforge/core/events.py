"""Event handlers: a handler is an object inheriting some of the six mixins.

It is called for an event if and only if it inherits that event's mixin, so a handler costs nothing
on events it does not use. Each hook takes the :class:`~fitforge.TrainState` and may return a truthy
value from ``batch_end``/``epoch_end`` to request a stop.

Ordering: lower ``priority`` runs first (built-ins: GradientUpdate -2000, Metric/Validation -1000,
user handlers 0, ProgressBar +990, Logging +1000, Stopping +2000); ``run_after`` names handler classes
this handler must run after whatever their priorities. Ties keep the order handlers were given in.
(ProgressBar is +990, just before Logging, so an epoch's bar closes before its log line.)

Example:
    >>> class PrintLoss(EpochEnd):
    ...     def epoch_end(self, state):
    ...         print(state.epoch, state.metrics.get("train_loss"))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from fitforge.core.state import TrainState


class Event(Enum):
    """The six events, in the order they first fire in a fit. ``value`` is the hook's method name."""

    TRAIN_BEGIN = "train_begin"
    EPOCH_BEGIN = "epoch_begin"
    BATCH_BEGIN = "batch_begin"
    BATCH_END = "batch_end"
    EPOCH_END = "epoch_end"
    TRAIN_END = "train_end"


class EventHandler:
    """Base of every handler: ordering attributes and optional state (de)serialisation.

    ``main_rank_only = True`` marks a handler that only reports (logs, progress bars, files): under
    torch.distributed only rank 0 runs it, so several processes write one log, not one each.
    """

    priority: int = 0
    run_after: tuple[type, ...] = ()
    main_rank_only: bool = False

    def state_dict(self) -> dict:
        """State to save in a checkpoint; stateless handlers return ``{}``."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return type(self).__name__


class TrainBegin(EventHandler):
    """Called once before the first epoch; initialise per-run state here."""

    def train_begin(self, state: TrainState) -> None:
        """Run once at the start of ``fit``."""


class TrainEnd(EventHandler):
    """Called once after training, also when an exception or a stop ended it."""

    def train_end(self, state: TrainState) -> None:
        """Run once at the end of ``fit``."""


class EpochBegin(EventHandler):
    """Called at the start of each epoch (and of each ``evaluate``/``predict`` pass)."""

    def epoch_begin(self, state: TrainState) -> None:
        """Run before the first batch of an epoch."""


class EpochEnd(EventHandler):
    """Called at the end of each epoch, also a partial one ended by a stop or ``CancelEpoch``."""

    def epoch_end(self, state: TrainState) -> bool | None:
        """Run after the last batch of an epoch; return True to stop training."""


class BatchBegin(EventHandler):
    """Called before each batch is processed."""

    def batch_begin(self, state: TrainState) -> None:
        """Run before the batch processor sees the batch."""


class BatchEnd(EventHandler):
    """Called after each batch is processed; ``state.output`` holds its result."""

    def batch_end(self, state: TrainState) -> bool | None:
        """Run after the batch processor; return True to stop training."""


MIXINS: dict[Event, type[EventHandler]] = {
    Event.TRAIN_BEGIN: TrainBegin,
    Event.EPOCH_BEGIN: EpochBegin,
    Event.BATCH_BEGIN: BatchBegin,
    Event.BATCH_END: BatchEnd,
    Event.EPOCH_END: EpochEnd,
    Event.TRAIN_END: TrainEnd,
}


def unwrapped(handler: object) -> object:
    """The handler a wrapper such as ``throttle(...)`` holds (``.handler``), else the handler itself."""
    inner = getattr(handler, "handler", None)
    return inner if isinstance(inner, EventHandler) else handler


def acts_as(handler: object, classes: type | tuple[type, ...]) -> bool:
    """``isinstance``, counting a wrapper as the handler it wraps (for defaults and ``run_after``)."""
    return isinstance(handler, classes) or isinstance(unwrapped(handler), classes)


def numbered_names(handlers: Iterable[object]) -> list[str]:
    """Each handler's class name, ``#2``, ``#3``... for the second and later of one class."""
    seen: Counter[str] = Counter()
    names = []
    for handler in handlers:
        name = type(handler).__name__
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def events_of(handler: object) -> list[Event]:
    """The events ``handler`` is called for: those whose mixin it inherits."""
    return [event for event, mixin in MIXINS.items() if isinstance(handler, mixin)]


__all__ = ["BatchBegin", "BatchEnd", "EpochBegin", "EpochEnd", "Event", "EventHandler", "TrainBegin", "TrainEnd"]
