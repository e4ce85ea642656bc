"""Orders handlers once per run and calls them per event from precomputed lists.

Ordering is a topological sort: ``run_after`` gives hard edges, and among handlers free to run the
lowest ``(priority, position given)`` goes first. So priorities decide unless a ``run_after``
says otherwise, and a cycle is an error naming the handlers in it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .events import MIXINS, Event, EventHandler, events_of
from .exceptions import FitforgeTypeError, HandlerOrderError, describe

if TYPE_CHECKING:  # pragma: no cover
    from .state import TrainState


def check_handler(handler: object, argument: str = "event_handlers") -> None:
    """Raise a clear error unless ``handler`` is an instance inheriting at least one event mixin."""
    if isinstance(handler, type):
        raise FitforgeTypeError(
            f"{argument} must hold handler instances, got {describe(handler)}; "
            f"write {handler.__name__}() to create one"
        )
    if not events_of(handler):
        mixins = ", ".join(m.__name__ for m in MIXINS.values())
        raise FitforgeTypeError(
            f"{argument} got {describe(handler)}, which handles no event; "
            f"a handler must inherit at least one of {mixins} (from fitforge.events)"
        )


def order_handlers(handlers: Sequence[EventHandler]) -> list[EventHandler]:
    """Sort by ``priority`` (stable), then move handlers after those named in their ``run_after``."""
    after: dict[int, set[int]] = {i: set() for i in range(len(handlers))}  # i -> must run before i
    for i, handler in enumerate(handlers):
        classes = tuple(getattr(handler, "run_after", ()) or ())
        for j, other in enumerate(handlers):
            if i != j and classes and isinstance(other, classes):
                after[i].add(j)
    waiting = {i: len(before) for i, before in after.items()}
    followers: dict[int, list[int]] = {i: [] for i in after}
    for i, before in after.items():
        for j in before:
            followers[j].append(i)
    ready = [(getattr(handlers[i], "priority", 0), i) for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    ordered: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        ordered.append(i)
        for k in followers[i]:
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, (getattr(handlers[k], "priority", 0), k))
    if len(ordered) < len(handlers):
        stuck = [handlers[i] for i in after if i not in ordered]
        raise HandlerOrderError(
            "handler ordering has a cycle through run_after: "
            + " -> ".join(repr(h) for h in stuck)
            + "; remove one of their run_after entries"
        )
    return [handlers[i] for i in ordered]


class Dispatcher:
    """Per-event lists of bound hooks, built once; calling an event is a plain loop over one list."""

    def __init__(self, handlers: Sequence[EventHandler]) -> None:
        self.handlers = order_handlers(handlers)
        self.hooks: dict[Event, list] = {
            event: [getattr(h, event.value) for h in self.handlers if isinstance(h, MIXINS[event])]
            for event in Event
        }

    def fire(self, event: Event, state: TrainState) -> None:
        """Call every hook of ``event``; a truthy return from a hook requests a stop."""
        for hook in self.hooks[event]:
            if hook(state):
                state.request_stop(f"{hook.__self__!r}.{event.value} returned True")

    def fire_each(self, event: Event, state: TrainState,
                  ignore: tuple[type[BaseException], ...]) -> BaseException | None:
        """As :meth:`fire`, but an ``ignore``-d exception ends only the hook that raised it; the
        first one caught is returned."""
        caught = None
        for hook in self.hooks[event]:
            try:
                if hook(state):
                    state.request_stop(f"{hook.__self__!r}.{event.value} returned True")
            except ignore as signal:
                caught = caught or signal
        return caught

    def describe(self) -> str:
        """The handlers of each event in call order, one event per line."""
        lines = []
        for event in Event:
            names = [f"{h.__self__!r}({getattr(h.__self__, 'priority', 0)})" for h in self.hooks[event]]
            lines.append(f"{event.value:<12} " + (" -> ".join(names) if names else "(none)"))
        return "\n".join(lines)
