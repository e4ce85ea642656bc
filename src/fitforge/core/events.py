"""Event handlers: a handler is an object inheriting some of the seven mixins (Gluon's six and
FluxTraining.jl's ``BackwardEnd``), called for an event only if it inherits that event's mixin (and,
when it declares ``handled_events``, lists the event there: how ``LambdaHandler`` and ``throttle(...)``
narrow theirs). Each hook takes the :class:`~fitforge.TrainState` and may return a truthy value from
``batch_end``/``epoch_end`` to request a stop. The order among handlers: :mod:`fitforge.core.dispatch`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from fitforge.core.services import Services
    from fitforge.core.state import TrainState


class Event(Enum):
    """The events, in the order they first fire in a fit. ``value`` is the hook's method name.

    ``backward_end`` fires in training only, after the batch processor's step and before
    ``batch_end``, whose first handler steps the optimizers: the place to inspect gradients."""

    TRAIN_BEGIN = "train_begin"
    EPOCH_BEGIN = "epoch_begin"
    BATCH_BEGIN = "batch_begin"
    BACKWARD_END = "backward_end"
    BATCH_END = "batch_end"
    EPOCH_END = "epoch_end"
    TRAIN_END = "train_end"

    # Members are singletons compared by identity, so the identity hash agrees with equality; Enum's
    # own __hash__ is Python code, run at every dict lookup of an event (twice per batch in the loop).
    __hash__ = object.__hash__


HOOK_NAMES = {event: event.value for event in Event}  # event -> its method's name (Enum's .value is slow)


class Stage(IntEnum):
    """Where the built-in handlers run among the handlers of one event (lower first). A ``priority``
    may be a Stage or any int: ``Stage.STEP - 1`` runs just before the optimizer step. Within a stage the
    order comes from declared access (a writer of a field before its readers) and ``run_after``."""

    GUARD = -3000  # NaNGuardHandler, SpikeGuardHandler: judge the batch before anything uses it
    STEP = -2000  # GradientUpdateHandler: clip and step, so later handlers see the updated weights
    METRICS = -1000  # MetricHandler, ThroughputHandler, EMAHandler, then ValidationHandler: the epoch's values
    USER = 0  # the default
    PERSIST = 900  # ScheduleHandler, LRSchedulerHandler, then CheckpointHandler: the state after every update
    REPORT = 1000  # ProgressBar, Logging, CSVLogger, TensorBoard, StoppingHandler: the row is complete


def priority_name(priority: int) -> str:
    """A priority as ``describe_loop`` shows it: the stage's name (``step``), else the number."""
    return Stage(priority).name.lower() if priority in Stage._value2member_map_ else str(priority)


class EventHandler:
    """Base of every handler: ordering attributes and optional state (de)serialisation.
    ``main_rank_only = True`` marks a handler that only reports (logs, files): under
    torch.distributed only rank 0 runs it."""

    priority: int = Stage.USER
    run_after: tuple[type, ...] = ()
    main_rank_only: bool = False
    handled_events: tuple[Event, ...] | None = None  # None: the events of the mixins inherited
    reads: tuple[str, ...] | None = None  # declared state access (see fitforge.core.dispatch); None: full
    writes: tuple[str, ...] | None = None

    def offer(self, services: Services) -> None:
        """Offer what other handlers use to the run's :class:`~fitforge.core.services.Services` (fit calls it on
        every handler once, before any ``train_begin``); read theirs through ``state.services`` in the hooks."""

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


class BackwardEnd(EventHandler):
    """Called in training after the batch's backward, before ``batch_end`` (and the optimizer step)."""

    def backward_end(self, state: TrainState) -> None:
        """Run once the gradients of the batch exist; raise CancelBatch to skip its step."""


class BatchEnd(EventHandler):
    """Called after each batch is processed; ``state.output`` holds its result."""

    def batch_end(self, state: TrainState) -> bool | None:
        """Run after the batch processor; return True to stop training."""


MIXINS: dict[Event, type[EventHandler]] = {
    Event.TRAIN_BEGIN: TrainBegin,
    Event.EPOCH_BEGIN: EpochBegin,
    Event.BATCH_BEGIN: BatchBegin,
    Event.BACKWARD_END: BackwardEnd,
    Event.BATCH_END: BatchEnd,
    Event.EPOCH_END: EpochEnd,
    Event.TRAIN_END: TrainEnd,
}


class Wrapping:
    """A handler that wraps another (``handler``) and plays its roles (``throttle(...)``); a wrapper
    of a handler of a default's class replaces that default too."""

    handler: EventHandler


def unwrapped(handler: object) -> object:
    """The innermost handler of a chain of wrappers (:class:`Wrapping`), else the handler itself."""
    while isinstance(handler, Wrapping):
        handler = handler.handler
    return handler


def offered(handlers: Iterable[object], services: Services) -> Services:
    """``services`` with what each of ``handlers`` offers (:meth:`EventHandler.offer`), in their order; a
    wrapper's handler (``throttle(...)``) offers its own."""
    for handler in handlers:
        while isinstance(handler, Wrapping):  # unwrapped(), inlined: no call per handler at every fit
            handler = handler.handler
        if isinstance(handler, EventHandler):
            handler.offer(services)
    return services


def hook_of(handler: object, event: Event) -> Callable[[TrainState], Any]:
    """The method of ``handler`` that ``event`` calls (``handler.batch_end`` for BATCH_END)."""
    return getattr(handler, HOOK_NAMES[event])


def acts_as(handler: object, classes: type | tuple[type, ...]) -> bool:
    """``isinstance``, counting a wrapper as the handler it wraps (for defaults and ``run_after``)."""
    return isinstance(handler, classes) or isinstance(unwrapped(handler), classes)


def handler_name(handler: object) -> str:
    """The class name, a wrapper's with the wrapped class's appended (``ThrottledLoggingHandler``)."""
    inner = unwrapped(handler)
    name = type(handler).__name__
    return name if inner is handler else name + type(inner).__name__


def numbered_names(handlers: Iterable[object]) -> list[str]:
    """Each handler's name, ``#2``, ``#3``... for the second and later of one name."""
    seen: Counter[str] = Counter()
    names = []
    for handler in handlers:
        name = handler_name(handler)
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


_EVENTS_OF: dict[tuple, tuple[Event, ...]] = {}  # (class, handled_events) -> events: decided by both alone


def events_of(handler: object) -> list[Event]:
    """The events ``handler`` is called for: its mixins', narrowed by any ``handled_events``."""
    declared = handler.handled_events if isinstance(handler, EventHandler) else None
    try:
        key = (type(handler), None if declared is None else tuple(declared))
        events = _EVENTS_OF.get(key)
    except TypeError:  # something unhashable in handled_events: dispatch's checks name it
        key, events = None, None
    if events is None:
        events = tuple(
            event
            for event, mixin in MIXINS.items()
            if isinstance(handler, mixin) and (declared is None or event in declared)
        )
        if key is not None and len(_EVENTS_OF) < 1024:
            _EVENTS_OF[key] = events
    return list(events)
