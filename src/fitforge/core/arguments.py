"""Argument checks, for every layer: one argument order ``(owner, name, value, ...)``, one message
shape ("``owner: name must be ..., got ...``"), TypeError for a wrong type and ValueError for a
wrong value (fitforge's subclasses of both)."""

from __future__ import annotations

import math
from typing import Any, cast

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


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
    sign = "non-negative" if zero_allowed else "positive"
    expected = f"a {sign} {'int' if kinds == (int,) else 'number'}{' or None' if allow_none else ''}"
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise FitforgeTypeError(f"{owner}: {name} must be {expected}, got {describe(value)}")
    number = cast(float, value)  # a number by now; cast for the type checker
    if math.isnan(number) or number < 0 or (number == 0 and not zero_allowed):
        raise FitforgeValueError(f"{owner}: {name} must be {expected}, got {value!r}")


def check_number(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    """``value`` must be a real number that is not nan (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    expected = f"a number{' or None' if allow_none else ''}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FitforgeTypeError(f"{owner}: {name} must be {expected}, got {describe(value)}")
    if math.isnan(value):
        raise FitforgeValueError(f"{owner}: {name} must be {expected}, not nan")


def check_flag(owner: str, name: str, value: Any) -> bool:
    """``value`` must be a bool (not a truthy stand-in such as 1 or "yes"); returns it."""
    if not isinstance(value, bool):
        raise FitforgeTypeError(f"{owner}: {name} must be True or False, got {describe(value)}")
    return value
