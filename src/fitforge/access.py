"""Declared state access (FluxTraining.jl's ``stateaccess``): which TrainState fields a handler reads
and writes, the order that follows from it, and a guard that enforces it.

A handler declares ``reads`` and/or ``writes``: tuples of TrainState field names (``"metrics"``,
``"history"``...) or ``"shared.<key>"`` (``"shared"`` covers every key). Writing a field means
assigning it or changing the object in it (``history.record(...)`` writes ``history``);
``state.request_stop()`` writes ``stop_requested`` (with the stop's reason). A handler that declares
neither keeps full access.

At fit start, once: among declared handlers of one priority that share an event, a writer of a
field runs before its readers (a priority you set is kept: it says when a handler must run, e.g.
before the optimizer step), and two writers of one field must be ordered by priority or
``run_after`` (else a :class:`~fitforge.exceptions.HandlerOrderError` names both, the field and the
fix; handlers of one class, and ``stop_requested``, whose first reason wins, are exempt). With
``fit(check_access=True)`` every declared handler gets a :class:`GuardedState` that raises a
:class:`~fitforge.exceptions.StateAccessError` on any undeclared read or write. The guard costs a
wrapper call per hook and a check per field access, so it is a debug mode; the ordering is free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from .events import EventHandler, acts_as, events_of
from .exceptions import FitforgeTypeError, HandlerOrderError, StateAccessError
from .state import TrainState

FIELDS = frozenset(f.name for f in dataclasses.fields(TrainState)) - {"metric_sources"}
_METHODS = {"request_stop": ("stop_requested", True), "running_metrics": ("metrics", False)}


@dataclasses.dataclass(frozen=True)
class Access:
    """A handler's declared ``reads`` and ``writes`` (a write also allows reading)."""

    reads: frozenset[str]
    writes: frozenset[str]

    def allows(self, name: str, write: bool = False) -> bool:
        names = self.writes if write else self.reads | self.writes
        return name in names or (name.startswith("shared.") and "shared" in names)


def declared_access(handler: object) -> Access | None:
    """The handler's declaration, checked; None when it declares nothing (full access)."""
    reads, writes = getattr(handler, "reads", None), getattr(handler, "writes", None)
    if reads is None and writes is None:
        return None
    for attribute, names in (("reads", reads), ("writes", writes)):
        if names is None:
            continue
        if isinstance(names, str) or not isinstance(names, (tuple, list, frozenset, set)):
            raise FitforgeTypeError(
                f"{handler!r}.{attribute} must be a tuple of TrainState field names, "
                f"e.g. ('epoch', 'shared.lr'), got {names!r}"
            )
        for name in names:
            if not (isinstance(name, str) and (name in FIELDS or (name.startswith("shared.") and len(name) > 7))):
                raise FitforgeTypeError(
                    f"{handler!r}.{attribute} names {name!r}, which is no TrainState field; "
                    f"use one of {sorted(FIELDS)} or 'shared.<key>'"
                )
    return Access(frozenset(reads or ()), frozenset(writes or ()))


def _covered(name: str, names: frozenset[str]) -> bool:
    return name in names or (name.startswith("shared.") and "shared" in names)


def _common(a: frozenset[str], b: frozenset[str]) -> set[str]:
    """The fields both name (``shared`` and ``shared.<key>`` overlap)."""
    return {n for n in a if _covered(n, b)} | {n for n in b if _covered(n, a)}


_COMMUTING = frozenset({"stop_requested"})  # writers need no order: the first stop's reason is kept


def access_edges(handlers: Sequence[EventHandler]) -> dict[int, set[int]]:
    """``{i: handlers i must run after}``: readers after the writers of their fields, for handlers
    of one priority that share an event. Two writers of a field must already be ordered, else
    HandlerOrderError."""
    access = [declared_access(h) for h in handlers]
    events = [set(events_of(h)) for h in handlers]
    after: dict[int, set[int]] = {i: set() for i in range(len(handlers))}
    for i, writer in enumerate(access):
        if writer is None or not writer.writes:
            continue
        for j, other in enumerate(access):
            if j == i or other is None or not events[i] & events[j]:
                continue
            both_write = _common(writer.writes, other.writes) - _COMMUTING
            if both_write:
                if j > i and type(handlers[i]) is not type(handlers[j]):
                    _check_ordered(handlers[i], handlers[j], min(both_write))
                continue
            same_priority = getattr(handlers[i], "priority", 0) == getattr(handlers[j], "priority", 0)
            if same_priority and _common(writer.writes, other.reads):
                after[j].add(i)
    return after


def _check_ordered(a: EventHandler, b: EventHandler, field: str) -> None:
    if getattr(a, "priority", 0) != getattr(b, "priority", 0):
        return
    if acts_as(b, tuple(getattr(a, "run_after", ()))) or acts_as(a, tuple(getattr(b, "run_after", ()))):
        return
    raise HandlerOrderError(
        f"{a!r} and {b!r} both write {field!r} at the same priority ({getattr(a, 'priority', 0)}) with no "
        f"order between them, so which value wins is left to the order you listed them in; give one a "
        f"different priority, or set run_after=({type(a).__name__},) on {type(b).__name__}"
    )


def describe_access(handler: object) -> str:
    """``reads a, b; writes c`` or ``full access`` (undeclared)."""
    access = declared_access(handler)
    if access is None:
        return "full access (undeclared)"
    return f"reads {', '.join(sorted(access.reads)) or '-'}; writes {', '.join(sorted(access.writes)) or '-'}"


class GuardedState:
    """What a declared handler sees under ``fit(check_access=True)``: the TrainState, with every
    field read and write checked against the handler's declaration."""

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
        if name in _METHODS:
            field, write = _METHODS[name]
            if not access.allows(field, write):
                raise self._deny(field, write)
            return getattr(state, name)
        if name not in FIELDS:
            return getattr(state, name)
        if name == "shared":  # each key is checked on use
            if not any(n == "shared" or n.startswith("shared.") for n in access.reads | access.writes):
                raise self._deny(name, False)
            return GuardedShared(state.shared, self)
        if not access.allows(name):
            raise self._deny(name, False)
        value = getattr(state, name)
        writable = access.allows(name, write=True)
        if name == "metrics" and not writable:
            return ReadOnlyMetrics(value, self)
        if name == "history" and not writable:
            return ReadOnlyHistory(value, self)
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
    """``state.metrics`` for a handler that reads it but does not declare writing it: a copy that
    refuses changes with the access error (a plain dict otherwise, e.g. for ``json.dumps``)."""

    def __init__(self, metrics: dict, guard: GuardedState) -> None:
        super().__init__(metrics)
        self._guard = guard

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise self._guard._deny("metrics", True)

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]


class ReadOnlyHistory(Mapping):
    """``state.history`` for a handler that reads it but does not declare writing it."""

    def __init__(self, history: Any, guard: GuardedState) -> None:
        self._history, self._guard = history, guard

    def __getitem__(self, key: str) -> list[float]:
        return self._history[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._history)

    def __len__(self) -> int:
        return len(self._history)

    def __getattr__(self, name: str) -> Any:
        if name in ("record", "new_epoch", "load_state_dict"):
            raise self._guard._deny("history", True)
        return getattr(self._history, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_history", "_guard"):
            object.__setattr__(self, name, value)
            return
        raise self._guard._deny("history", True)


def guard(handler: object, method: Any, access: Access) -> Any:
    """``method`` called with a GuardedState for ``handler``."""

    def guarded(state: TrainState) -> Any:
        return method(GuardedState(state, handler, access))

    return guarded
