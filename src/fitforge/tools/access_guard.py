"""The declared-access guard, a debug mode: under ``fit(check_access=True)`` every handler declaring
``reads``/``writes`` sees a :class:`GuardedState` that raises on any undeclared read or write."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from fitforge.core.dispatch import FIELDS, Access
from fitforge.core.history import History
from fitforge.core.state import RunControl, TrainState
from fitforge.exceptions import StateAccessError


class GuardedState:
    """The TrainState, with every field read and write checked against the handler's declaration."""

    __slots__ = ("_access", "_owner", "_state")

    def __init__(self, state: TrainState, owner: object, access: Access) -> None:
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_access", access)

    def _deny(self, name: str, write: bool) -> StateAccessError:
        verb, attribute = ("write", "writes") if write else ("read", "reads")
        return StateAccessError(
            f"{self._owner!r} tried to {verb} state.{name}, which its {attribute} does not "
            f"declare; add {name!r} to {type(self._owner).__name__}.{attribute}"
        )

    def __getattr__(self, name: str) -> Any:
        state, access = self._state, self._access
        if name == "running_metrics":  # a method reading the metrics
            if not access.allows("metrics"):
                raise self._deny("metrics", False)
            return state.running_metrics
        if name not in FIELDS:
            return getattr(state, name)
        if name in ("shared", "services"):  # a shared key is checked on use; a service's name is for the order only
            if not any(n == name or n.startswith(name + ".") for n in access.reads | access.writes):
                raise self._deny(name, False)
            return GuardedShared(state.shared, self) if name == "shared" else state.services
        if not access.allows(name):
            raise self._deny(name, False)
        value = getattr(state, name)
        if name in _READ_ONLY and not access.allows(name, write=True):
            return _READ_ONLY[name](value, self)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if not self._access.allows(name, write=True):
            raise self._deny(name, True)
        setattr(self._state, name, value)


class GuardedShared(MutableMapping):
    """``state.shared`` for a declared handler: each key checked as ``shared.<key>``."""

    def __init__(self, shared: dict, guard: GuardedState) -> None:
        self._shared, self._guard = shared, guard

    def _check(self, key: str, write: bool) -> None:
        if not self._guard._access.allows(f"shared.{key}", write):
            raise self._guard._deny(f"shared.{key}", write)

    def __getitem__(self, key: str) -> Any:
        self._check(key, False)
        return self._shared[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._check(key, True)
        self._shared[key] = value

    def __delitem__(self, key: str) -> None:
        self._check(key, True)
        del self._shared[key]

    def _declared(self) -> list[str]:
        access = self._guard._access
        return [key for key in self._shared if access.allows(f"shared.{key}")]

    def __iter__(self) -> Iterator[str]:  # only the declared keys are visible
        return iter(self._declared())

    def __len__(self) -> int:
        return len(self._declared())


class ReadOnlyMetrics(dict):
    """``state.metrics`` for a handler that reads but does not write it: a dict copy refusing changes."""

    def __init__(self, metrics: dict, guard: GuardedState) -> None:
        super().__init__(metrics)
        self._guard = guard

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise self._guard._deny("metrics", True)

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]


class ReadOnlyRun:
    """``state.run`` for a handler that reads it but does not declare writing it: ``stop()`` is refused."""

    _field: str = "run"
    _writers: tuple[str, ...] = ("stop",)

    def __init__(self, target: RunControl | History, guard: GuardedState) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_guard", guard)

    def __getattr__(self, name: str) -> Any:
        if name in self._writers:
            raise self._guard._deny(self._field, True)
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise self._guard._deny(self._field, True)


class ReadOnlyHistory(ReadOnlyRun, Mapping):
    """``state.history`` for a handler that reads it but does not declare writing it."""

    _field, _writers = "history", ("record", "new_epoch", "load_state_dict")

    def __getitem__(self, key: str) -> list[float]:
        return self._target[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._target)

    def __len__(self) -> int:
        return len(self._target)


_READ_ONLY: dict[str, Any] = {"metrics": ReadOnlyMetrics, "history": ReadOnlyHistory, "run": ReadOnlyRun}


def guard(handler: object, method: Any, access: Access) -> Any:
    """``method`` called with a GuardedState for ``handler``."""
    return lambda state: method(GuardedState(state, handler, access))
