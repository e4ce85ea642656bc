"""The user's handlers before a fit: a name of a role defined without the role is warned of, once
per class and name (fitforge asks roles, so it would never use the name)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable

from fitforge.core.events import unwrapped
from fitforge.core.roles import Accompanied, KeyRecording, Monitoring, Stopping, Validating

# What a handler defined for fitforge to find by name before the roles, and the roles' own methods.
_NAMES = {
    Monitoring: ("monitor", "save_best", "restore_best", "best_weights"),
    Validating: ("validation_setup", "use_evaluation"),
    Stopping: ("stopped_epoch", "run_limits", "ended_run"),
    KeyRecording: ("history_keys",),
    Accompanied: ("companions",),
}
_CLASS_NAMES: dict[type, tuple[list[tuple[str, str]], list[tuple[str, str]]]] = {}
_WARNED: set[tuple[type, str]] = set()


def warn_unplayed_roles(handlers: Iterable[object]) -> None:
    """Warn of each name of a role that one of the user's ``handlers`` defines without the role."""
    for handler in map(unwrapped, handlers):
        for name, role in missing_roles(handler):
            if (type(handler), name) not in _WARNED:
                _WARNED.add((type(handler), name))
                warnings.warn(
                    f"{type(handler).__name__} defines {name!r} but does not inherit the role {role} (from "
                    f"fitforge.events), so fitforge will not use it: inherit {role} beside its event mixins, "
                    f"e.g. class {type(handler).__name__}(..., {role})",
                    UserWarning,
                    stacklevel=_outside_fitforge(),
                )


def missing_roles(handler: object) -> list[tuple[str, str]]:
    """``(name, role)`` for each name of a role that ``handler`` defines (on its own classes or
    itself) without inheriting the role."""
    cls = type(handler)
    known = _CLASS_NAMES.get(cls)
    if known is None:  # once per class: the user's classes only, fitforge's own play their roles
        own = {name for k in cls.__mro__ if not k.__module__.startswith("fitforge.") for name in vars(k)}
        unplayed = [
            (name, role.__name__) for role, names in _NAMES.items() if not isinstance(handler, role) for name in names
        ]
        on_class = [pair for pair in unplayed if pair[0] in own]
        # A built-in handler's attributes are its own business: only a user's class is looked into.
        elsewhere = [pair for pair in unplayed if pair[0] not in own] if own else []
        known = _CLASS_NAMES[cls] = on_class, elsewhere
    on_class, elsewhere = known
    instance = handler.__dict__ if hasattr(handler, "__dict__") else {}
    return on_class + [pair for pair in elsewhere if pair[0] in instance] if instance else on_class


def _outside_fitforge() -> int:
    """The ``stacklevel`` that points a warning raised by the caller at the first frame outside fitforge."""
    frame, level = sys._getframe(2), 2  # the frame of the function that warns is level 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "fitforge":
        frame, level = frame.f_back, level + 1
    return level
