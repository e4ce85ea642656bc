"""ProgressBarHandler: a tqdm bar per epoch, refreshed at a throttled interval."""

from __future__ import annotations

import sys
import time

from fitforge.core.arguments import check_non_negative
from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, Stage, TrainEnd
from fitforge.core.state import TrainState
from fitforge.handlers.formatting import format_values


def interactive() -> bool:
    """True on a terminal or in a Jupyter notebook, where a progress bar helps rather than clutters."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if type(shell).__name__ == "ZMQInteractiveShell":
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class ProgressBarHandler(EpochBegin, BatchEnd, EpochEnd, TrainEnd):
    """Show a progress bar with the running loss and metrics.

    Only every ``refresh_seconds`` does it move the bar and read running values from the device,
    so its cost per batch is a clock read. Added by default only on a terminal or in a notebook.

    Args:
        refresh_seconds: the throttle interval.
    """

    priority = Stage.REPORT
    main_rank_only = True  # under torch.distributed, rank 0 reports for all
    reads = ("phase", "epoch", "max_epochs", "num_batches", "metrics")

    def __init__(self, refresh_seconds: float = 0.5) -> None:
        check_non_negative("ProgressBarHandler", "refresh_seconds", refresh_seconds, (int, float))
        self.refresh_seconds = refresh_seconds
        self._bar = None

    def epoch_begin(self, state: TrainState) -> None:
        from tqdm.auto import tqdm

        self._close()
        total = f"/{state.max_epochs}" if state.max_epochs else ""
        label = "Validate" if state.phase == "validate" else f"Epoch {state.epoch + 1}{total}"
        self._bar = tqdm(
            total=state.num_batches,
            desc=label,
            leave=state.phase == "train",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=self.refresh_seconds,
        )
        self._pending = 0
        self._next = time.monotonic() + self.refresh_seconds

    def batch_end(self, state: TrainState) -> None:
        self._pending += 1
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.refresh_seconds
            self._flush(state.running_metrics())

    def _flush(self, values: dict[str, float]) -> None:
        assert self._bar is not None  # opened in epoch_begin, before any batch_end
        self._bar.update(self._pending)
        self._pending = 0
        self._bar.set_postfix_str(format_values(values), refresh=True)

    def epoch_end(self, state: TrainState) -> None:
        if self._bar is not None:
            self._flush(state.metrics)
            self._close()

    def train_end(self, state: TrainState) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
