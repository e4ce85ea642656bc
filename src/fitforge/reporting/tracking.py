"""What the trackers (MLflowHandler, TensorBoardHandler, WandbHandler) share: a writer on a thread of its own, so
that no step waits for a file, a database or a server; a run that a resumed fit continues; how a fit ended."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fitforge.core.events import EpochBegin, EpochEnd, Stage, TrainBegin, TrainEnd
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


def check_names(owner: str, **names: Any) -> None:
    """Each of ``names`` must be a non-empty str or None (None: the tracker's own default)."""
    for name, value in names.items():
        if value is not None and not isinstance(value, str):
            raise FitforgeTypeError(f"{owner}: {name} must be a str or None, got {describe(value)}")
        if value == "":
            raise FitforgeValueError(f"{owner}: {name} must not be empty; pass None for the tracker's default")


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


def outcome(state: TrainState) -> str:
    """At ``train_end``, how the fit ended, for a tracker's run: ``"killed"`` by a signal (SIGTERM, SIGINT,
    Ctrl-C: a resumed fit may continue the run), ``"failed"`` by an exception, else ``"finished"``."""
    error = state.run.error
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or (error is None and state.run.preempted is not None):
        return "killed"
    return "failed" if error is not None else "finished"


class RunTracker(TrainBegin, EpochBegin, EpochEnd, TrainEnd):
    """A handler that tracks each fit as a run of an experiment tracker (MLflowHandler, WandbHandler).

    A fit opens a run (:meth:`_open`: a new one, the tracker's active one, or the one of the checkpoint the fit
    resumes from, whose id the checkpoint holds); each training epoch's history row goes to a
    :class:`BackgroundWriter` as ``(epoch, unix time in ms, row)``; at ``train_end`` the writer's last records
    are written, then :meth:`_end` ends the run with how the fit ended. A run is open while its writer is.
    """

    priority = Stage.REPORT  # after validation, metrics and the checkpoint: the row is complete
    main_rank_only = True  # under torch.distributed, rank 0 reports for all
    reads = ("phase", "estimator", "history", "services", "run")
    writes = ()

    def __init__(self, flush_secs: float) -> None:
        self.flush_secs = check_flush_secs(type(self).__name__, flush_secs)
        self.run_id: str | None = None  # the run of the latest fit
        self._owned = False  # whether this handler started (or continued) the run, and so ends it
        self._writer: BackgroundWriter | None = None  # set while a run is open
        self._resumed_run: str | None = None  # the run of the checkpoint a fit resumes from
        self._fitting = False  # between train_begin and train_end

    def _open(self) -> None:
        """Open the fit's run (continuing ``_resumed_run`` when set), set ``run_id``, ``_owned`` and ``_writer``."""
        raise NotImplementedError

    def _end(self, ended: str) -> None:
        """After the writer's last records: end the run if ``_owned`` (``ended`` as :func:`outcome` says)."""
        raise NotImplementedError

    def train_begin(self, state: TrainState) -> None:
        self.run_id, self._resumed_run, self._fitting = None, None, True
        if not _resumes(state):  # else the run is the checkpoint's, known at load_state_dict
            self._open()

    def state_dict(self) -> dict:
        """The run's id, which a fit resumed from the checkpoint continues."""
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self._resumed_run = state.get("run_id")  # opened at the first epoch_begin: a resume's restoring is not timed

    def epoch_begin(self, state: TrainState) -> None:
        if self._fitting and self._writer is None:  # a resumed fit's run: the checkpoint's, or a new one
            self._open()

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train" or state.run.epoch_suspended or self._writer is None:
            return
        self._writer.put((state.history.epochs, int(time.time() * 1000), state.history.current_row()))

    def train_end(self, state: TrainState) -> None:
        writer, self._fitting = self._writer, False
        if writer is None:
            return  # no run was opened (an earlier handler's train_begin failed)
        try:
            writer.close()  # the epochs' values before the run's end
            self._before_end(state)
        finally:
            self._writer = None
            self._end(outcome(state))

    def _before_end(self, state: TrainState) -> None:
        """At ``train_end``, once the epochs' values are written and before the run ends: nothing by default."""


def _resumes(state: TrainState) -> bool:
    """At a tracker's ``train_begin`` (after the checkpoint handlers', ``Stage.PERSIST``), whether the fit resumes
    from a checkpoint: the handlers' states (a tracker's run) are loaded next, before the first epoch."""
    for saver in state.services.checkpoints:
        saved = saver.saved_checkpoints()
        if saved is not None and saved.resumed_from is not None:
            return True
    return False
