"""Declared state access (FluxTraining.jl's ``stateaccess``): which TrainState fields a handler reads
and writes, and the order that follows from it.

A handler declares ``reads`` and/or ``writes``: tuples of TrainState field names (``"metrics"``...)
or ``"shared.<key>"`` (``"shared"`` covers every key). Writing a field means assigning it or changing
the object in it (``history.record(...)`` writes ``history``; ``state.request_stop()``
``stop_requested``). A handler that declares neither keeps full access.

At fit start, once: among declared handlers of one priority that share an event, a writer of a
field runs before its readers (priorities are kept), and two writers of one field must be ordered
by priority or ``run_after``, else a :class:`~fitforge.exceptions.HandlerOrderError` names both
(handlers of one class, and writers of ``stop_requested``, need no order). These edges join
``run_after``'s in the topological sort of :mod:`fitforge.core.dispatch`. The ordering is free;
enforcing the declarations is a debug mode (``fit(check_access=True)``, see
:mod:`fitforge.tools.access_guard`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fitforge.core.events import EventHandler, acts_as, events_of, handler_name, unwrapped
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, HandlerOrderError

# The dataclass's fields but its plumbing, and the properties handlers set.
FIELDS = frozenset(f.name for f in dataclasses.fields(TrainState)) - {"metric_sources", "run", "logged", "ranks"} | {
    "restored_epoch"
}


@dataclasses.dataclass(frozen=True)
class Access:
    """A handler's declared ``reads`` and ``writes`` (a write also allows reading)."""

    reads: frozenset[str]
    writes: frozenset[str]

    def allows(self, name: str, write: bool = False) -> bool:
        return _covered(name, self.writes if write else self.reads | self.writes)


def declared_access(handler: object) -> Access | None:
    """The handler's declaration, checked; None when it declares nothing (full access)."""
    assert isinstance(handler, EventHandler)  # checked by check_handler
    reads, writes = handler.reads, handler.writes
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
            conflict = _common(writer.writes, other.writes) - _COMMUTING
            if conflict:  # writers of one field are ordered by priority and run_after, not by reads
                if j > i and type(handlers[i]) is not type(handlers[j]):
                    _check_ordered(handlers[i], handlers[j], min(conflict))
                continue
            same_priority = handlers[i].priority == handlers[j].priority
            if same_priority and _common(writer.writes, other.reads):
                after[j].add(i)
    return after


def _check_ordered(a: EventHandler, b: EventHandler, field: str) -> None:
    if a.priority != b.priority:
        return
    if acts_as(b, tuple(a.run_after)) or acts_as(a, tuple(b.run_after)):
        return
    raise HandlerOrderError(
        f"{a!r} and {b!r} both write {field!r} at the same priority ({a.priority}) with no "
        f"order between them, so which value wins is left to the order you listed them in; give one a "
        f"different priority, or set run_after=({type(unwrapped(a)).__name__},) on {handler_name(b)}"
    )


def describe_access(handler: object) -> str:
    """``reads a, b; writes c`` or ``full access`` (undeclared)."""
    access = declared_access(handler)
    if access is None:
        return "full access (undeclared)"
    return f"reads {', '.join(sorted(access.reads)) or '-'}; writes {', '.join(sorted(access.writes)) or '-'}"
