"""StoppingHandler: ends training after a number of epochs, batches or seconds."""

from __future__ import annotations

import time

from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin
from fitforge.core.roles import Stopping
from fitforge.exceptions import check_positive


def tighter_limit(a: int | None, b: int | None) -> int | None:
    """The smaller of two optional limits (None means no limit)."""
    return b if a is None else a if b is None else min(a, b)


class StoppingHandler(TrainBegin, BatchEnd, EpochEnd, Stopping):
    """Request a stop when a limit is reached: its own or ``fit(epochs=, batches=)``, whichever comes first.

    Args:
        max_epochs: stop at the end of this many epochs.
        max_batches: stop after this many completed training batches (``state.global_step``).
        max_time: stop at the first batch or epoch end after this many seconds of training.
    """

    priority = Stage.REPORT  # a limit reached stops once every handler saw the batch (the loop asks after it)
    reads = ("epoch", "global_step", "run")
    writes = ("run",)

    def __init__(
        self, max_epochs: int | None = None, max_batches: int | None = None, max_time: float | None = None
    ) -> None:
        check_positive("StoppingHandler", "max_epochs", max_epochs, allow_none=True)
        check_positive("StoppingHandler", "max_batches", max_batches, allow_none=True)
        check_positive("StoppingHandler", "max_time", max_time, (int, float), allow_none=True)
        self.max_epochs, self.max_batches, self.max_time = max_epochs, max_batches, max_time

    def run_limits(self) -> tuple[int | None, int | None]:
        """``(max_epochs, max_batches)``: fit trains to the first limit reached, its own or these."""
        return self.max_epochs, self.max_batches

    def train_begin(self, state) -> None:
        self._epochs = tighter_limit(self.max_epochs, state.run.max_epochs)
        self._batches = tighter_limit(self.max_batches, state.run.max_batches)
        self._deadline = None if self.max_time is None else time.monotonic() + self.max_time

    def _out_of_time(self, state) -> None:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            state.run.stop(f"reached max_time={self.max_time}s")

    def batch_end(self, state) -> None:
        # global_step counts batches completed before this one, so this batch is number global_step+1.
        if self._batches is not None and state.global_step + 1 >= self._batches:
            state.run.stop(f"reached batches={self._batches}", every_rank=True)  # same step on every rank
        if self._deadline is not None:  # checked here first: without max_time a batch costs no call
            self._out_of_time(state)

    def epoch_end(self, state) -> None:
        if self._epochs is not None and state.epoch + 1 >= self._epochs:
            state.run.stop(f"reached epochs={self._epochs}", every_rank=True)
        self._out_of_time(state)
