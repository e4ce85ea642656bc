"""Argument checks shared by the handlers: one message shape, TypeError for a wrong type and
ValueError for a wrong value, each naming the owner, the argument and what was received."""

from __future__ import annotations

import math
from typing import Any, cast

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


def check_positive(
    owner: str, name: str, value: Any, kinds: tuple[type, ...] = (int,), allow_none: bool = False
) -> None:
    """``value`` must be a positive instance of ``kinds`` (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    expected = f"a positive {'int' if kinds == (int,) else 'number'}{' or None' if allow_none else ''}"
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise FitforgeTypeError(f"{owner}: {name} must be {expected}, got {describe(value)}")
    if cast(float, value) <= 0:  # a number by now; cast for the type checker
        raise FitforgeValueError(f"{owner}: {name} must be {expected}, got {value!r}")


def check_number(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    """``value`` must be a real number that is not nan (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise FitforgeTypeError(
            f"{owner}: {name} must be a number{' or None' if allow_none else ''}, got {describe(value)}"
        )


def check_flag(value: Any, name: str, owner: str = "Estimator") -> bool:
    """``value`` must be a bool (not a truthy stand-in such as 1 or "yes"); returns it."""
    if not isinstance(value, bool):
        raise FitforgeTypeError(f"{owner}: {name} must be True or False, got {describe(value)}")
    return value
