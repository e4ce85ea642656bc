"""DataLoader workers that outlive a preemption signal sent to the whole process group during a fit, so
that they do not die before the fit's save: they leave the signals to the main process, which shuts them
down (docs/checkpoints.md, "Preemption"). While ``iter(loader)`` starts them the main thread blocks the
signals, so none is lost before :class:`ShieldedWorkerInit` installs the worker's handlers.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import DataLoader

SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}
_active = 0  # fits under way in this process's main thread that shield their loaders' workers
_exiting: dict[str, Any] = {}  # start method -> an Event set when this process exits (workers then obey SIGTERM)


@contextmanager
def shielding() -> Iterator[None]:
    """Within the block, the workers :func:`shielded` loaders start leave preemption signals to this process."""
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def shielded(data: Iterable) -> Iterable:
    """``data``, whose workers are shielded when a fit's :func:`shielding` is on."""
    if _active and isinstance(data, DataLoader) and data.num_workers > 0:
        return _ShieldedPasses(data)
    return data


class _ShieldedPasses:
    """The passes of a loader whose workers start with :class:`ShieldedWorkerInit`."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        own = loader.worker_init_fn
        # Blocked first: a helper process started from here on (multiprocessing's resource tracker,
        # which the spawn start method's Event starts, and which ignores SIGINT and SIGTERM only)
        # starts with the signals blocked too.
        before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            if not isinstance(own, ShieldedWorkerInit):  # a fit within a fit: shielded already
                loader.worker_init_fn = ShieldedWorkerInit(own, _exit_event(loader.multiprocessing_context))
            return iter(loader)  # starts the workers (a persistent loader's first pass only)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
            loader.worker_init_fn = own


def _exit_event(context: Any) -> Any:
    """An Event of ``context``'s start method, set when this process exits, before its children end."""
    if isinstance(context, str) or context is None:
        context = multiprocessing.get_context(context)
    method = context.get_start_method()
    if method not in _exiting:
        _exiting[method] = context.Event()
        multiprocessing.util.Finalize(None, _exiting[method].set, exitpriority=0)
    return _exiting[method]


class ShieldedWorkerInit:
    """A worker's ``worker_init_fn`` during a fit: :func:`shield_worker`, then the loader's own (picklable)."""

    def __init__(self, own: Callable[[int], None] | None, exiting: Any) -> None:
        self.own, self.exiting = own, exiting

    def __call__(self, worker_id: int) -> None:
        # Called by torch's worker loop, whose ``done_event`` the loader sets when it shuts its workers down.
        done = sys._getframe(1).f_locals.get("done_event")
        shield_worker(self.exiting, done)
        if self.own is not None:
            self.own(worker_id)


def shield_worker(exiting: Any, done: Any = None) -> None:
    """In a DataLoader worker: SIGUSR1 and SIGINT do nothing, and SIGTERM ends the worker only once
    ``done`` (its loader's shutdown) or ``exiting`` (the main process's exit) is set."""

    def on_sigterm(signum: int, frame: Any) -> None:
        if exiting.is_set() or (done is not None and done.is_set()):
            os._exit(0)  # torch's worker exits so on its loader's SIGTERM: nothing of it is left to run

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGUSR1, _leave_to_the_main_process)
    signal.signal(signal.SIGINT, _leave_to_the_main_process)
    # A worker that ends by returning (spawn, forkserver) runs the interpreter's exit, which puts the
    # default actions back for its last second: block the signals from its exit on instead.
    atexit.register(signal.pthread_sigmask, signal.SIG_BLOCK, SIGNALS)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _leave_to_the_main_process(signum: int, frame: Any) -> None:
    """The main process of the fit saves and then shuts this worker down."""
