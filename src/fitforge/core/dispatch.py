"""Orders handlers once per run and calls them per event from precomputed lists.

Ordering is a topological sort: ``run_after`` gives hard edges, declared access adds "a writer of a
field before its readers" among handlers of one priority, and among handlers free to run the lowest
``(priority, position given)`` goes first. So priorities decide unless an edge says otherwise, and a
cycle is an error naming the handlers in it.

Declared state access (``reads``/``writes``; the names and rules: docs/handlers.md): two writers of one
field at one priority must be ordered by ``run_after``, else a :class:`~fitforge.exceptions.HandlerOrderError`
names both (handlers of one class, and writers of ``run``, need no order: a stop takes effect once the
event's handlers ran). The ordering is free; enforcing the declarations is a debug mode
(``fit(check_access=True)``, see :mod:`fitforge.tools.access_guard`)."""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Callable, Sequence

import torch

from fitforge.core.events import (
    HOOK_NAMES,
    MIXINS,
    Event,
    EventHandler,
    acts_as,
    events_of,
    handler_name,
    priority_name,
    unwrapped,
)
from fitforge.core.roles import ROLES
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, HandlerOrderError, PassAbandoned, describe

# The dataclass's fields but its machinery (private), and the property handlers set.
FIELDS = frozenset(f.name for f in dataclasses.fields(TrainState) if not f.name.startswith("_")) | {"restored_epoch"}


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
        if isinstance(names, str) or not isinstance(names, (tuple, list, frozenset, set, type(None))):
            raise FitforgeTypeError(
                f"{handler!r}.{attribute} must be a tuple of TrainState field names, "
                f"e.g. ('epoch', 'shared.lr'), got {names!r}"
            )
        for name in names or ():
            if not (isinstance(name, str) and (name in FIELDS or _keyed(name) is not None)):
                raise FitforgeTypeError(
                    f"{handler!r}.{attribute} names {name!r}, which is no TrainState field; "
                    f"use one of {sorted(FIELDS)}, 'shared.<key>' or 'services.<name>'"
                )
    return Access(frozenset(reads or ()), frozenset(writes or ()))


def _keyed(name: str) -> str | None:
    """``shared`` for ``shared.<key>``, ``services`` for ``services.<name>``; else None."""
    field, dot, key = name.partition(".")
    return field if dot and key and field in ("shared", "services") else None


def _covered(name: str, names: frozenset[str]) -> bool:
    return name in names or _keyed(name) in names


def _common(a: frozenset[str], b: frozenset[str]) -> set[str]:
    """The fields both name (``shared`` and ``shared.<key>`` overlap, as ``services`` and its names)."""
    return {n for n in a if _covered(n, b)} | {n for n in b if _covered(n, a)}


_COMMUTING = frozenset({"run"})  # stops: no order among them (the first reason is kept), nor before readers


def access_edges(handlers: Sequence[EventHandler]) -> dict[int, set[int]]:
    """``{i: handlers i must run after}``: readers after the writers of their fields, for handlers
    of one priority that share an event. Two writers of a field must already be ordered, else
    HandlerOrderError."""
    access = [declared_access(h) for h in handlers]
    after: dict[int, set[int]] = {i: set() for i in range(len(handlers))}
    if all(declared is None or not declared.writes for declared in access):
        return after  # no declared writer: no edge
    events = [set(events_of(h)) for h in handlers]
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
            if same_priority and _common(writer.writes - _COMMUTING, other.reads):
                after[j].add(i)
    return after


def _check_ordered(a: EventHandler, b: EventHandler, field: str) -> None:
    if a.priority != b.priority or acts_as(b, tuple(a.run_after)) or acts_as(a, tuple(b.run_after)):
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


log = logging.getLogger("fitforge")
STOPPING_EVENTS = (Event.BATCH_END, Event.EPOCH_END)  # the events whose truthy return requests a stop
Guard = Callable[[EventHandler, Callable, Access], Callable]  # (handler, hook, its declared access) -> hook
_EVENTS = tuple(Event)  # built once: iterating an Enum, and its .value, run Python code each time


def check_handler(handler: object, argument: str = "event_handlers") -> None:
    """Raise a clear error unless ``handler`` is an instance of an event mixin, with an int
    ``priority`` and a tuple of classes as ``run_after``."""
    if isinstance(handler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        raise FitforgeTypeError(
            f"{argument} got a learning-rate scheduler ({type(handler).__name__}), not a handler; wrap it: "
            "LRSchedulerHandler(scheduler) (from fitforge.handlers) steps it per epoch or per batch"
        )
    if isinstance(handler, type):
        raise FitforgeTypeError(
            f"{argument} must hold handler instances, got {describe(handler)}; write {handler.__name__}() to create one"
        )
    if not isinstance(handler, EventHandler):  # every mixin is one
        raise _no_event(handler, argument)
    declared = handler.handled_events
    if declared is not None and (
        not isinstance(declared, (tuple, list)) or not all(isinstance(e, Event) for e in declared)
    ):
        raise FitforgeTypeError(
            f"{handler!r}.handled_events must be None or a tuple of fitforge.events.Event, e.g. "
            f"(Event.EPOCH_END,), got {describe(declared)}"
        )
    if not events_of(handler):
        raise _no_event(handler, argument)
    priority = handler.priority
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise FitforgeTypeError(f"{handler!r}.priority must be an int, got {describe(priority)}")
    run_after = handler.run_after
    if not isinstance(run_after, (tuple, list)) or not all(isinstance(c, type) for c in run_after):
        raise FitforgeTypeError(
            f"{handler!r}.run_after must be a tuple of handler classes, e.g. (LoggingHandler,), "
            f"got {describe(run_after)}"
        )


def _no_event(handler: object, argument: str) -> FitforgeTypeError:
    mixins = ", ".join(m.__name__ for m in MIXINS.values())
    roles = [role.__name__ for role in ROLES if isinstance(handler, role)]
    hint = f" (a role such as {roles[0]} is inherited beside an event mixin)" if roles else ""
    return FitforgeTypeError(
        f"{argument} got {describe(handler)}, which handles no event; "
        f"a handler must inherit at least one of {mixins} (from fitforge.events){hint}"
    )


Plan = tuple[tuple[int, ...], tuple[tuple[Event, ...], ...]]  # the order, and each ordered handler's events
_ORDERS: dict[tuple, Plan] = {}  # the handlers' descriptions -> their plan, for later fits
_MAX_ORDERS = 256


def _plan(handlers: Sequence[EventHandler]) -> Plan:
    """The order of ``handlers`` and the events of each in that order, remembered for later fits
    with the same kinds of handlers (a fit's fixed cost; unhashable declarations are ordered afresh)."""
    try:  # what a handler's place depends on: its events follow from its class and handled_events
        key: tuple | None = tuple(
            (type(h), type(unwrapped(h)), h.priority, h.reads, h.writes, h.run_after, h.handled_events)
            for h in handlers
        )
        plan = _ORDERS.get(key)  # type: ignore[arg-type]
    except TypeError:  # unhashable declarations
        key, plan = None, None
    if plan is None:
        order = _order(handlers)
        plan = order, tuple(tuple(events_of(handlers[i])) for i in order)
        if key is not None and len(_ORDERS) < _MAX_ORDERS:
            _ORDERS[key] = plan
    return plan


def _order(handlers: Sequence[EventHandler]) -> tuple[int, ...]:
    """The positions of ``handlers`` in their order (see the module docstring)."""
    after = access_edges(handlers)  # i -> must run after these
    for i, handler in enumerate(handlers):
        classes = tuple(handler.run_after or ())
        kinds = tuple(c for c in classes if issubclass(c, EventHandler))  # whatever the priorities
        roles = tuple(c for c in classes if not issubclass(c, EventHandler))  # the players at its own priority
        for j, other in enumerate(handlers):
            if i == j or not classes:
                continue
            # a wrapper (throttle) counts as what it wraps
            if (kinds and acts_as(other, kinds)) or (
                roles and other.priority == handler.priority and acts_as(other, roles)
            ):
                after[i].add(j)
    waiting = {i: len(before) for i, before in after.items()}
    followers: dict[int, list[int]] = {i: [] for i in after}
    for i, before in after.items():
        for j in before:
            followers[j].append(i)
    ready = [(handlers[i].priority, i) for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    ordered: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        ordered.append(i)
        for k in followers[i]:
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, (handlers[k].priority, k))
    if len(ordered) < len(handlers):  # one cycle among those left: follow their edges until one repeats
        stuck = [i for i in after if i not in ordered]
        cycle, node = [], stuck[0]
        while node not in cycle:
            cycle.append(node)
            node = next(j for j in sorted(after[node]) if j in stuck)
        cycle = cycle[cycle.index(node) :] + [node]
        raise HandlerOrderError(
            "handler ordering has a cycle through run_after: "
            + " runs after ".join(repr(handlers[i]) for i in cycle)
            + "; remove one of their run_after entries"
        )
    return tuple(ordered)


class Dispatcher:
    """Per-event lists of hooks, built once; calling an event is a plain loop over one list."""

    def __init__(self, handlers: Sequence[EventHandler], guard: Guard | None = None) -> None:
        """``guard`` wraps the hooks of handlers that declare their access (:mod:`fitforge.tools.access_guard`)."""
        order, handled = _plan(handlers)
        self.handlers = [handlers[i] for i in order]
        self.owners: dict[Event, list[EventHandler]] = {event: [] for event in _EVENTS}
        self.hooks: dict[Event, list[Callable]] = {event: [] for event in _EVENTS}
        for handler, events in zip(self.handlers, handled):  # in call order, so each event's list is too
            access = declared_access(handler) if guard is not None else None
            for event in events:
                method = getattr(handler, HOOK_NAMES[event])  # hook_of, inlined: every fit builds two
                self.owners[event].append(handler)
                self.hooks[event].append(method if guard is None or access is None else guard(handler, method, access))

    def stop_reason(self, event: Event, hook: Callable) -> str:
        """The reason recorded when ``hook`` returned a truthy value (rare path: a linear search)."""
        owner = next(h for h, k in zip(self.owners[event], self.hooks[event]) if k is hook)
        return f"{owner!r}.{event.value} returned True"

    def fire(
        self,
        event: Event,
        state: TrainState,
        ignore: tuple[type[BaseException], ...] = (),
        abandoned: Callable[[TrainState], None] | None = None,
    ) -> BaseException | None:
        """Call every hook of ``event``; a truthy return from batch_end/epoch_end requests a stop.
        An ``ignore``-d exception ends only its hook; the first one caught is returned. With
        ``abandoned``, a :class:`PassAbandoned` ends its hook too, then ``abandoned(state)`` runs."""
        caught = None
        stops = event in STOPPING_EVENTS
        held = None  # an abandoned pass's data, kept past the later hooks (a save): see PassAbandoned.unread
        for hook in self.hooks[event]:
            try:
                if hook(state) and stops:
                    state.run.stop(self.stop_reason(event, hook))
            except ignore as signal:
                caught = caught or signal
            except PassAbandoned as abandoning:
                if abandoned is None:
                    raise
                held = abandoning.unread
                abandoned(state)
        del held
        return caught

    def fire_teardown(
        self, event: Event, state: TrainState, ignore: tuple[type[BaseException], ...], failing: bool = True
    ) -> Exception | None:
        """Call every hook of ``event`` even when some fail, so every handler can clean up. While an
        exception ends the run (``failing``), failures are logged; otherwise the first is returned
        for the caller to raise (later ones are logged), and set as ``state.run.error`` for later hooks."""
        first = None
        for owner, hook in zip(self.owners[event], self.hooks[event]):
            try:
                hook(state)
            except ignore:
                pass
            except Exception as error:
                if failing or first is not None:
                    log.exception("%r.%s failed while training was ending", owner, event.value)
                else:
                    first = state.run.error = error  # the hooks after it (the closing log line) see it
        return first

    def describe(self) -> str:
        """The handlers of each event in call order, one event per line; then each one's state access."""
        lines = []
        for event in Event:
            names = [f"{handler_name(h)}({priority_name(h.priority)})" for h in self.owners[event]]
            lines.append(f"{event.value:<12} " + (" -> ".join(names) if names else "(none)"))
        lines.append("state access:")
        lines += [f"  {handler_name(h)}: {describe_access(h)}" for h in self.handlers]
        return "\n".join(lines)
