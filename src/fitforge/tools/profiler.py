"""``fit(profile=True)``: the host wall-clock time each handler spends in each event.

A ``torch.profiler`` trace of chosen steps (operators, kernels) is another tool: ``ProfilerHandler``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import Event, numbered_names
from fitforge.core.history import History

log = logging.getLogger("fitforge")


class HandlerProfile:
    """Calls and seconds per (handler, event); :meth:`report` formats them as a table."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = {}
        self.calls: dict[tuple[str, str], int] = {}
        self.total = 0.0  # the whole fit, for the handlers' share

    def instrument(self, dispatcher: Dispatcher) -> None:
        """Replace ``dispatcher``'s hooks by timed ones (the loop then calls those)."""
        names = {id(h): name for h, name in zip(dispatcher.handlers, numbered_names(dispatcher.handlers))}
        for event in Event:
            dispatcher.hooks[event] = [
                self._timed(names[id(owner)], event.value, hook)
                for owner, hook in zip(dispatcher.owners[event], dispatcher.hooks[event])
            ]

    def _timed(self, name: str, event: str, hook: Callable) -> Callable:
        key = (name, event)
        self.seconds[key], self.calls[key] = 0.0, 0
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(state: Any) -> Any:
            start = clock()
            try:
                return hook(state)
            finally:
                seconds[key] += clock() - start
                calls[key] += 1

        return timed

    def report(self) -> str:
        """One line per handler and event that was called, slowest first, with the share of the fit."""
        rows = sorted(((s, k) for k, s in self.seconds.items() if self.calls[k]), reverse=True)
        lines = [f"{'handler':<28} {'event':<12} {'calls':>7} {'total ms':>10} {'us/call':>9} {'of fit':>7}"]
        for seconds, (name, event) in rows:
            calls = self.calls[(name, event)]
            share = seconds / self.total if self.total else 0.0
            lines.append(
                f"{name:<28} {event:<12} {calls:>7} {seconds * 1e3:>10.2f} {seconds / calls * 1e6:>9.1f} {share:>7.1%}"
            )
        handlers = sum(s for s, _ in rows)
        lines.append(
            f"handlers {handlers * 1e3:.1f} ms of the fit's {self.total * 1e3:.1f} ms "
            f"({handlers / self.total if self.total else 0.0:.1%})"
        )
        return "\n".join(lines)


@contextmanager
def profiled(dispatcher: Dispatcher, history: History, enabled: bool) -> Iterator[None]:
    """Time ``dispatcher``'s hooks for the block when ``enabled``; the table goes to ``history.profile`` and the log."""
    if not enabled:
        yield
        return
    profiler = HandlerProfile()
    profiler.instrument(dispatcher)
    started = time.perf_counter()
    try:
        yield
    finally:
        profiler.total = time.perf_counter() - started
        history.profile = profiler.report()
        log.info("time per handler and event:\n%s", history.profile)
