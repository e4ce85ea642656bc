"""Control-flow signals handlers may raise, and the errors fitforge raises for user mistakes.

The three ``Cancel*`` signals are caught by the loop and never escape ``fit``/``evaluate``/``predict``.
Configuration errors subclass ``TypeError`` or ``ValueError`` so ordinary ``except`` clauses work;
their messages name the argument, what was received and what was expected. The argument checks
at the end raise them for every layer: one argument order ``(owner, name, value, ...)``, one message
shape ("``owner: name must be ..., got ...``").
"""

from __future__ import annotations

import math
from typing import Any, cast


class CancelBatch(Exception):
    """Skip the rest of the current batch: no optimizer step if raised before it, and the batch
    does not count towards ``batches=N``. Gradients it produced are cleared."""


class RetryBatch(CancelBatch):
    """Cancel the batch as :class:`CancelBatch` does, for data that yields the same position again (a
    fault-tolerant step that failed its commit): the epoch's position does not move past it."""


class CancelEpoch(Exception):
    """End the current epoch now; its ``epoch_end`` handlers still run."""


class CancelFit(Exception):
    """End training now; ``train_end`` handlers still run (``epoch_end`` does not)."""


class PassAbandoned(BaseException):
    """A pass within a fit (a validation) left unfinished because a signal asks the fit to stop
    (:mod:`fitforge.core.coordinator`): the fit's loop catches it and saves the last training batch's
    state. A BaseException, so a handler's ``except Exception`` does not take it for its own failure.

    ``unread`` holds the pass's data iterator until the error is handled: dropping a DataLoader's
    iterator waits for its workers' batches, and the save must not wait for that."""

    unread: object = None


class FitforgeTypeError(TypeError):
    """An argument has the wrong type (the message names it, what was given and what was expected)."""


class FitforgeValueError(ValueError):
    """An argument or a batch has a wrong value, shape or count."""


class BatchFormatError(FitforgeValueError):
    """A batch is neither a ``(data, label)`` pair of tensors or tuples of tensors nor data alone."""


class LossInputError(FitforgeValueError):
    """Predictions and labels do not fit the configured loss(es): counts, shapes or dtypes."""


class NonFiniteInputError(FitforgeValueError):
    """The first batch holds nan or inf values (checked once per fit, before its forward)."""


class DeviceMismatchError(FitforgeValueError, RuntimeError):
    """A parameter, buffer or tensor the net uses is not on the estimator's device. Also a
    ``RuntimeError``, the class of torch's own device error, so code written against it still works."""


class ForwardError(FitforgeValueError, RuntimeError):
    """The net failed on the first batch; the message names the layer, what it received and a likely
    fix, and the torch error is the ``__cause__``. Also a ``RuntimeError``, as torch's error was."""


class HandlerOrderError(FitforgeValueError):
    """The ``priority``/``run_after`` declarations of the handlers contain a cycle, or two handlers
    write one state field with no order between them."""


class StateAccessError(FitforgeValueError):
    """A handler read or wrote a TrainState field its ``reads``/``writes`` do not declare
    (raised under ``fit(check_access=True)``)."""


class MonitorKeyError(FitforgeValueError):
    """A handler monitors a history key that nothing will produce."""


class CheckpointError(FitforgeValueError):
    """A checkpoint cannot be read, or does not fit the estimator it is loaded into."""


class ConfigError(FitforgeValueError):
    """A run's config (:mod:`fitforge.cli`) has a wrong key, type or value, found before anything is
    built; the message names the key, what was expected and the nearest valid key."""


def describe(value: object) -> str:
    """A short description of a received value for error messages: its type and, if small, its repr."""
    text = " ".join(repr(value).split())  # one line, even for a tensor's repr
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}" if not isinstance(value, type) else f"the class {value.__name__}"


def check_positive(
    owner: str, name: str, value: Any, kinds: tuple[type, ...] = (int,), allow_none: bool = False
) -> None:
    """``value`` must be a positive instance of ``kinds`` (or None when ``allow_none``)."""
    _check_count(owner, name, value, kinds, allow_none, zero_allowed=False)


def check_non_negative(owner: str, name: str, value: Any, kinds: tuple[type, ...] = (int,)) -> None:
    """``value`` must be an instance of ``kinds`` that is 0 or more."""
    _check_count(owner, name, value, kinds, allow_none=False, zero_allowed=True)


def _check_count(
    owner: str, name: str, value: Any, kinds: tuple[type, ...], allow_none: bool, zero_allowed: bool
) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = _expected_count(kinds, allow_none, zero_allowed)
        raise FitforgeTypeError(f"{owner}: {name} must be {expected}, got {describe(value)}")
    number = cast(float, value)  # a number by now; cast for the type checker
    if math.isnan(number) or number < 0 or (number == 0 and not zero_allowed):
        raise FitforgeValueError(
            f"{owner}: {name} must be {_expected_count(kinds, allow_none, zero_allowed)}, got {value!r}"
        )


def _expected_count(kinds: tuple[type, ...], allow_none: bool, zero_allowed: bool) -> str:
    """What a count check expects, in words: built for its error only (checks run on every fit)."""
    sign = "non-negative" if zero_allowed else "positive"
    return f"a {sign} {'int' if kinds == (int,) else 'number'}{' or None' if allow_none else ''}"


def check_number(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    """``value`` must be a real number that is not nan (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FitforgeTypeError(
            f"{owner}: {name} must be a number{' or None' if allow_none else ''}, got {describe(value)}"
        )
    if math.isnan(value):
        raise FitforgeValueError(f"{owner}: {name} must be a number{' or None' if allow_none else ''}, not nan")


def check_flag(owner: str, name: str, value: Any) -> bool:
    """``value`` must be a bool (not a truthy stand-in such as 1 or "yes"); returns it."""
    if not isinstance(value, bool):
        raise FitforgeTypeError(f"{owner}: {name} must be True or False, got {describe(value)}")
    return value
