"""What the trackers (MLflowHandler, TensorBoardHandler, WandbHandler) share: a writer on a thread of its own, so
that no step waits for a file, a database or a server; whether a fit resumes; how it ended."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")

FLUSH_SECS = 5.0  # the trackers' default: at most this long between a value and its write


def check_flush_secs(owner: str, flush_secs: Any) -> float:
    """``flush_secs`` as a float; a clear error unless it is a positive number."""
    if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)):
        raise FitforgeTypeError(f"{owner}: flush_secs must be a positive number of seconds, got {describe(flush_secs)}")
    if not flush_secs > 0:  # nan included
        raise FitforgeValueError(f"{owner}: flush_secs must be a positive number of seconds, got {flush_secs!r}")
    return float(flush_secs)


CLOSE_SECS = 120.0  # the longest train_end waits for a tracker's last write


class BackgroundWriter:
    """Writes a tracker's records in order on a daemon thread.

    :meth:`put` queues a record and returns at once; the caller hands over plain values (floats, CPU
    copies), never a device tensor, so neither side waits for a device. The thread sleeps until a record
    comes, gathers what comes in the next ``flush_secs``, and calls ``write(records)`` with all of it:
    ``write`` sends them and flushes its sink, so a process killed at any instant loses at most the records
    of one interval. :meth:`close` (a tracker's ``train_end``, also when an exception ends the fit) writes
    what is queued and joins the thread: a normal end loses nothing. A ``write`` that raises is logged as a
    warning naming ``owner`` and the next records are written: a tracker out of reach never ends training.
    Each write done is logged at DEBUG level (``<owner>: wrote <n> record(s)``).

    Args:
        owner: the tracker's name, in warnings and the thread's name.
        write: called on the thread with the records gathered, oldest first.
        flush_secs: how long the thread gathers records before writing them.
    """

    def __init__(self, owner: str, write: Callable[[list[Any]], None], flush_secs: float = FLUSH_SECS) -> None:
        self.owner, self.flush_secs = owner, flush_secs
        self._write = write
        self._records: list[Any] = []
        self._closing = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"fitforge-{owner}", daemon=True)
        self._thread.start()

    def put(self, record: Any) -> None:
        """Queue ``record`` for the next write."""
        with self._wake:
            if self._closing:
                raise RuntimeError(f"{self.owner}: a record was put after its writer closed")
            self._records.append(record)
            if len(self._records) == 1:  # the thread sleeps until the first record of an interval
                self._wake.notify()

    def close(self, timeout: float = CLOSE_SECS) -> None:
        """Write what is queued, then end the thread, waiting for it up to ``timeout`` seconds (a tracker out
        of reach, retrying, must not hold the end of training forever); later calls do nothing."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s: its last records were not written within %.0f s; leaving them", self.owner, timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._records or self._closing)
                if not self._closing:  # gather the interval's records; close() wakes it early
                    self._wake.wait(self.flush_secs)
                records, self._records = self._records, []
                last = self._closing
            if records:
                try:
                    self._write(records)
                except Exception as err:  # a tracker out of reach must not end (and lose) the training
                    log.warning("%s: %d record(s) not written (%s); training goes on", self.owner, len(records), err)
                else:
                    log.debug("%s: wrote %d record(s)", self.owner, len(records))
            if last:
                return


def resumes(state: TrainState) -> bool:
    """At a tracker's ``train_begin`` (after the checkpoint handlers', ``Stage.PERSIST``), whether the fit resumes
    from a checkpoint: the handlers' states (a tracker's run) are loaded next, before the first epoch."""
    for saver in state.services.checkpoints:
        saved = saver.saved_checkpoints()
        if saved is not None and saved.resumed_from is not None:
            return True
    return False


def outcome(state: TrainState) -> str:
    """At ``train_end``, how the fit ended, for a tracker's run: ``"killed"`` by a signal (SIGTERM, SIGINT,
    Ctrl-C: a resumed fit may continue the run), ``"failed"`` by an exception, else ``"finished"``."""
    error = state.run.error
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or (error is None and state.run.preempted is not None):
        return "killed"
    return "failed" if error is not None else "finished"
