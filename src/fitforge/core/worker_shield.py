"""DataLoader workers that outlive a preemption signal sent to the whole process group during a fit.

A scheduler that preempts a job signals every process in it: SLURM at its time limit or on
``scancel`` (the job step's processes, whatever their group), a terminal's Ctrl-C (the foreground
process group). The DataLoader's worker processes get the signal too, and left to torch's and
Python's reactions they die of it; the fit then fails with "DataLoader worker ... killed by signal"
before its save, and the work since the last checkpoint is lost.

During a fit the main process reacts to these signals (:mod:`fitforge.core.preemption`) and shuts
its workers down itself, as the loader does at the end of every pass. So a worker that a loader
starts while fit reads it (train and validation data, see :func:`shielded`) leaves the signals to
the main process: it ignores SIGUSR1 and SIGINT, and obeys SIGTERM as torch's workers do only when
its parent sent it (the loader's shutdown of a worker that does not stop in time): it exits then;
a SIGTERM from anyone else is the scheduler's to the main process, and the worker serves on until
the main process shuts it down. A worker whose main process died (SIGKILL after the grace time)
exits on its own within seconds, as torch's workers do.

The worker's reaction comes from ``worker_init_fn``: while fit starts a loader's workers, the
loader's own ``worker_init_fn`` is wrapped in :class:`ShieldedWorkerInit` (which calls it after),
and given back at once. Workers started outside a fit, or before it (persistent workers from an
earlier pass), react as torch's do.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import DataLoader

_active = 0  # fits under way in this process's main thread that shield their loaders' workers


@contextmanager
def shielding() -> Iterator[None]:
    """Within the block, the workers :func:`shielded` loaders start leave preemption signals to
    this process (see the module docstring)."""
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def shielded(data: Iterable) -> Iterable:
    """``data``, whose workers (a DataLoader's with ``num_workers > 0``) are shielded when a fit's
    :func:`shielding` is on."""
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
        if not isinstance(own, ShieldedWorkerInit):  # a fit within a fit: shielded already
            loader.worker_init_fn = ShieldedWorkerInit(own)
        try:
            return iter(loader)  # starts the workers (a persistent loader's first pass only)
        finally:
            loader.worker_init_fn = own


class ShieldedWorkerInit:
    """A worker's ``worker_init_fn`` during a fit: :func:`shield_worker`, then the loader's own.
    Picklable (for the spawn and forkserver start methods) when the loader's own is."""

    def __init__(self, own: Callable[[int], None] | None) -> None:
        self.own = own

    def __call__(self, worker_id: int) -> None:
        shield_worker()
        if self.own is not None:
            self.own(worker_id)


def shield_worker() -> None:
    """In a DataLoader worker (after torch set its own signal handlers): leave SIGUSR1 and SIGINT to
    the main process, and SIGTERM too unless the parent sends it (then exit at once, as torch's
    worker would). SIGTERM is blocked in this thread, and so in the threads it starts, and one thread
    waits for it to read who sent it: a signal handler cannot tell."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_answer_sigterm, args=(parent,), name="fitforge-worker-sigterm", daemon=True).start()


def _answer_sigterm(parent: int) -> None:
    while True:
        sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
        if sender == parent:
            os._exit(0)  # torch's worker exits so on its parent's SIGTERM: nothing of it is left to run
