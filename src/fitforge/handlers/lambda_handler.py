"""LambdaHandler: plain functions ``fn(state)`` on the events you name, and nothing on the others."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fitforge.core.events import BackwardEnd, BatchBegin, BatchEnd, EpochBegin, EpochEnd, Event, TrainBegin, TrainEnd
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


def check_declared(owner: str, name: str, value: Any) -> tuple[str, ...] | None:
    """``reads``/``writes``: None (undeclared) or a tuple of TrainState field names / ``shared.<key>``."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
        raise FitforgeTypeError(
            f"{owner}: {name} must be None or a tuple of TrainState field names "
            f"(e.g. ('epoch', 'history', 'shared.lr')), got {describe(value)}"
        )
    return tuple(value)


class LambdaHandler(TrainBegin, EpochBegin, BatchBegin, BackwardEnd, BatchEnd, EpochEnd, TrainEnd):
    """Call plain functions ``fn(state)`` on the events given, and only on those (``handled_events``).

    Args:
        train_begin, epoch_begin, batch_begin, backward_end, batch_end, epoch_end, train_end: a function taking the
            ``TrainState``, by keyword; at least one.
        priority: the order among handlers (lower first; 0 is the user default).
        run_after: handler classes this one must run after.
        reads, writes: optional declarations of the TrainState fields (or ``"shared.<key>"``) the functions read and
            write; None (the default) leaves them undeclared (full access).
    """

    reads: tuple[str, ...] | None = None
    writes: tuple[str, ...] | None = None

    def __init__(
        self,
        *args: Any,
        train_begin: Callable | None = None,
        epoch_begin: Callable | None = None,
        batch_begin: Callable | None = None,
        backward_end: Callable | None = None,
        batch_end: Callable | None = None,
        epoch_end: Callable | None = None,
        train_end: Callable | None = None,
        priority: int = 0,
        run_after: tuple[type, ...] = (),
        reads: tuple[str, ...] | None = None,
        writes: tuple[str, ...] | None = None,
        **unknown: Any,
    ) -> None:
        if args:
            raise FitforgeTypeError(
                f"LambdaHandler takes its functions by event name, e.g. "
                f"LambdaHandler(epoch_end=fn); got a positional argument {describe(args[0])}"
            )
        if unknown:
            raise FitforgeTypeError(
                f"LambdaHandler got unknown argument(s) {', '.join(sorted(unknown))}; expected functions named after "
                f"events ({', '.join(e.value for e in Event)}) and priority, run_after, reads, writes"
            )
        given = (train_begin, epoch_begin, batch_begin, backward_end, batch_end, epoch_end, train_end)  # Event's order
        functions = {event: fn for event, fn in zip(Event, given) if fn is not None}
        if not functions:
            raise FitforgeValueError(
                "LambdaHandler needs at least one function, e.g. LambdaHandler(epoch_end=lambda state: ...); got none"
            )
        for event, fn in functions.items():
            if not callable(fn):
                raise FitforgeTypeError(
                    f"LambdaHandler: {event.value} must be a function fn(state), got {describe(fn)}"
                )
            try:
                inspect.signature(fn).bind(None)
            except TypeError:
                raise FitforgeTypeError(
                    f"LambdaHandler: {event.value} must take one argument (the TrainState), "
                    f"got {getattr(fn, '__qualname__', describe(fn))}{inspect.signature(fn)}"
                ) from None
            except ValueError:  # no signature to inspect (some builtins): trust it
                pass
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise FitforgeTypeError(f"LambdaHandler: priority must be an int, got {describe(priority)}")
        if not isinstance(run_after, (tuple, list)) or not all(isinstance(c, type) for c in run_after):
            raise FitforgeTypeError(
                f"LambdaHandler: run_after must be a tuple of handler classes, got {describe(run_after)}"
            )
        self.priority, self.run_after = priority, tuple(run_after)
        self.reads = check_declared("LambdaHandler", "reads", reads)
        self.writes = check_declared("LambdaHandler", "writes", writes)
        self.functions = functions
        self.handled_events = tuple(functions)
        for event, fn in functions.items():
            setattr(self, event.value, fn)  # the hook is the function itself: no wrapper call per event

    def __repr__(self) -> str:
        names = ", ".join(
            f"{event.value}={getattr(fn, '__qualname__', type(fn).__name__)}" for event, fn in self.functions.items()
        )
        return f"LambdaHandler({names})"
