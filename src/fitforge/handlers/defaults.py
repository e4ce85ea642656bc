"""Which handlers a run gets: the user's, plus each default whose class the user did not supply."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fitforge.core.clock import ALWAYS, CAUSES, compiled, history_key
from fitforge.core.dispatch import check_handler
from fitforge.core.events import EventHandler, acts_as, offered
from fitforge.core.history import numbered_key
from fitforge.core.roles import Accompanied, KeyRecording, Validating, players
from fitforge.core.services import Services
from fitforge.core.state import EstimatorLike
from fitforge.exceptions import FitforgeTypeError, describe
from fitforge.handlers.gradient_update import GradientUpdateHandler
from fitforge.handlers.logging import LoggingHandler
from fitforge.handlers.manifest import ManifestHandler
from fitforge.handlers.metric import MetricHandler
from fitforge.handlers.progress_bar import ProgressBarHandler, interactive
from fitforge.handlers.stopping import StoppingHandler
from fitforge.handlers.throughput import ThroughputHandler
from fitforge.handlers.validation import ValidationHandler


def user_handlers(event_handlers: Any, argument: str = "event_handlers") -> list[EventHandler]:
    """A new list of the caller's handlers (never mutated), each checked."""
    if event_handlers is None:
        return []
    if isinstance(event_handlers, EventHandler) or not isinstance(event_handlers, (list, tuple)):
        raise FitforgeTypeError(f"{argument} must be a list of handlers, got {describe(event_handlers)}")
    for handler in event_handlers:
        check_handler(handler, argument)
    return list(event_handlers)


def with_defaults(given: list[EventHandler], defaults: Iterable[EventHandler]) -> list[EventHandler]:
    """Defaults first, then the user's; a default is dropped when the user gave one of its class
    (also wrapped, e.g. ``throttle(LoggingHandler(), ...)``)."""
    kept = [d for d in defaults if not any(acts_as(h, type(d)) for h in given)]
    return kept + given


def fit_handlers(event_handlers: Any, val_data: Any, default_handlers: bool = True) -> list[EventHandler]:
    """The handlers of a fit. With ``default_handlers=False`` only the two a loop cannot run without are added,
    plus a ValidationHandler when ``val_data`` is given (an explicit request), and the ManifestHandler (it
    writes only beside the files of handlers the user gave: checkpoints, logs)."""
    if not isinstance(default_handlers, bool):
        raise FitforgeTypeError(f"default_handlers must be True or False, got {describe(default_handlers)}")
    given = user_handlers(event_handlers)
    defaults: list[EventHandler] = [GradientUpdateHandler()]
    defaults += [companion for handler in players(given, Accompanied) for companion in handler.companions()]
    if default_handlers:
        defaults += [MetricHandler(), ThroughputHandler(flops=False)]
    if val_data is not None:
        defaults.append(ValidationHandler(val_data))
    if default_handlers:  # the bar first: an epoch's bar closes before its log line (one priority, as given)
        defaults += [ProgressBarHandler()] if interactive() else []
        defaults.append(LoggingHandler())
    defaults.append(ManifestHandler())
    defaults.append(StoppingHandler())  # last of the defaults at REPORT: the reports of a batch before its stop
    return with_defaults(given, defaults)


def evaluate_handlers(event_handlers: Any) -> list[EventHandler]:
    return with_defaults(user_handlers(event_handlers), [MetricHandler()])


def run_keys(handlers: Sequence[EventHandler], estimator: EstimatorLike) -> list[str]:
    """The history keys a fit with ``handlers`` produces, except those of a custom validation."""
    keys = [key for recorder in players(handlers, KeyRecording) for key in recorder.history_keys(estimator, "train")]
    for validator in players(handlers, Validating):
        setup = validator.validation_setup()
        if setup is not None and setup.by_estimator:  # with its handlers, or the default MetricHandler
            inner = players(evaluate_handlers(setup.event_handlers), KeyRecording)
            keys += [k for h in inner for k in h.history_keys(estimator, "validate") if k not in keys]
    # The keys the loop itself records every epoch: learning rates, epoch_time and the seconds by cause.
    clock = [key for key in map(history_key, timed_causes(handlers, estimator)) if key not in keys]
    return keys + [numbered_key("lr", i) for i in range(len(estimator.optimizers))] + ["epoch_time", *clock]


def timed_causes(handlers: Sequence[EventHandler], estimator: EstimatorLike) -> tuple[str, ...]:
    """The causes of time a fit with ``handlers`` records in every History row
    (:class:`~fitforge.core.clock.RunClock`): the loop's, validation's where a handler validates,
    compilation's for a compiled net, and those whose keys a handler records (a checkpoint's, a rollback's)."""
    recorders = players(handlers, KeyRecording)
    declared = {key for recorder in recorders for key in recorder.history_keys(estimator, "train")}
    optional = {"validation": bool(players(handlers, Validating)), "compile": compiled(estimator.net)}
    return (*ALWAYS, *(c for c in CAUSES if c not in ALWAYS and (optional.get(c) or history_key(c) in declared)))


def fit_services(handlers: Sequence[EventHandler], estimator: EstimatorLike) -> Services:
    """The services of a fit with ``handlers``: what fit knows, then what each handler offers."""
    setups = [validator.validation_setup() for validator in players(handlers, Validating)]  # None: its own means
    services = Services(
        history_keys=lambda: run_keys(handlers, estimator),
        keys_complete=all(setup is not None and setup.by_estimator for setup in setups),
        validates_mid_epoch=any(setup is not None and setup.mid_epoch for setup in setups),
    )
    return offered(handlers, services)


def unknown_val_keys(handlers: Sequence[EventHandler]) -> bool:
    """Whether a validation of the run records keys known only once it ran (an ``eval_fn``, or a
    user's :class:`~fitforge.core.roles.Validating` handler that validates by its own means)."""
    return any(by_own_means(validator) for validator in players(handlers, Validating))


def by_own_means(validator: Validating) -> bool:
    """Whether ``validator`` evaluates by its own means (its keys known only once it ran)."""
    setup = validator.validation_setup()
    return setup is None or not setup.by_estimator
