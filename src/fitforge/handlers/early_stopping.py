"""EarlyStoppingHandler: stop when a monitored value stops improving."""

from __future__ import annotations

import logging
from typing import Any

from fitforge.core.events import EpochEnd, TrainBegin, TrainEnd
from fitforge.core.roles import Monitoring, Stopping, averaged_weights
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeValueError, check_flag, check_non_negative, check_number
from fitforge.metrics.monitor import Monitor

log = logging.getLogger("fitforge")


class EarlyStoppingHandler(TrainBegin, EpochEnd, TrainEnd, Monitoring, Stopping):
    """Stop training when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs (0 or 1:
    the first epoch that does not improve). An epoch without a value for the key neither counts nor resets.

    Args:
        monitor: a history key, e.g. ``"val_loss"`` or ``"val_accuracy"``.
        min_delta: the smallest change that counts as an improvement.
        patience: epochs without improvement before stopping.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (loss/error-like keys minimise, accuracy-like keys maximise; a
            metric object's ``higher_is_better`` wins).
        baseline: a value the monitor must beat; until it does, epochs count as not improving.
        restore_best: when training ends, load the net's weights of the best epoch (kept on the host meanwhile),
            named by ``history.restored_epoch``; not when SIGTERM/SIGINT stopped training.
        restore_best_weights: Keras's name for ``restore_best``.
    """

    reads = ("estimator", "epoch", "run", "history", "metrics", "batch_idx", "num_batches")
    writes = ("run", "restored_epoch")

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best: bool = False,
        restore_best_weights: bool | None = None,
    ) -> None:
        self._monitor = Monitor(monitor, mode, min_delta, owner="EarlyStoppingHandler")
        check_non_negative("EarlyStoppingHandler", "patience", patience)
        check_number("EarlyStoppingHandler", "baseline", baseline, allow_none=True)
        self.monitor, self.patience, self.baseline = monitor, patience, baseline
        if restore_best_weights is not None:  # the Keras name
            if restore_best and not restore_best_weights:
                raise FitforgeValueError(
                    "EarlyStoppingHandler: restore_best=True and restore_best_weights=False "
                    "disagree; pass only restore_best"
                )
            restore_best = restore_best_weights
        self.restore_best = check_flag("EarlyStoppingHandler", "restore_best", restore_best)
        self._reset()

    def _reset(self) -> None:
        self.best: float | None = self.baseline
        self.best_epoch: int | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None
        self._best_weights: dict[str, Any] | None = None
        self._active = False  # between this run's train_begin and train_end

    def train_begin(self, state: TrainState) -> None:
        self._reset()
        self._monitor.resolve(state.estimator)
        self._active = True

    def epoch_end(self, state: TrainState) -> None:
        if state.run.epoch_suspended:
            return  # a partial epoch's value is no epoch's: the epoch ends when the run resumes
        value = self._monitor.epoch_value(state, self)
        if value is None:
            return
        if self._monitor.improved(value, self.best):
            self.best, self.best_epoch, self.wait = value, state.epoch, 0
            if self.restore_best:  # kept on the host: a second copy must not fill the device
                with averaged_weights(state.estimator):  # the weights the value was judged on (an EMA's)
                    self._best_weights = {
                        k: v.detach().to("cpu", copy=True) for k, v in state.estimator.net.state_dict().items()
                    }
            return
        self.wait += 1
        if self.wait >= max(self.patience, 1):
            self.stopped_epoch = state.epoch
            best = (
                f"{self.best:.4g} at epoch {state.run.epochs_before + self.best_epoch + 1}"
                if self.best_epoch is not None
                else f"none beat the baseline {self.baseline}"
                if self.baseline is not None
                else "no value"
            )
            state.run.stop(f"early stopping: {self.monitor} did not improve for {self.wait} epoch(s) (best {best})")

    def train_end(self, state: TrainState) -> None:
        if not self._active:  # train_begin never ran for this run (an earlier handler failed in it)
            return
        self._active = False
        best_epoch = self.best_epoch
        if self._best_weights is not None and best_epoch not in (None, state.epoch) and state.run.preempted is None:
            average = state.estimator.weight_average
            if average is not None and average.evaluates_averaged:  # evaluation runs with the average: the
                average.load_averaged(self._best_weights)  # best one goes back there; the raw weights train on
            else:
                state.estimator.net.load_state_dict(self._best_weights)
            state.restored_epoch = best_epoch + 1  # the closing summary reports that row
            shown = state.run.epochs_before + best_epoch + 1  # numbered across fits, as the epoch lines
            log.info("restored the weights of epoch %d (%s=%.4g)", shown, self.monitor, self.best)
        self._best_weights = None  # do not hold a copy of the weights after the run

    def best_weights(self) -> str | None:
        """``"restored"`` with ``restore_best``: the weights it puts back are the best by ``monitor``."""
        return "restored" if self.restore_best else None

    def ended_run(self) -> bool:
        """Whether it had stopped the run (restored from a checkpoint: a resumed fit is over)."""
        return self.stopped_epoch is not None

    def state_dict(self) -> dict:
        """The patience count and the best so far (with the best weights when they are kept)."""
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
            "best_weights": self._best_weights,
        }

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.wait, self.stopped_epoch = state["wait"], state["stopped_epoch"]
        self._best_weights = state.get("best_weights")

    def __repr__(self) -> str:
        return f"EarlyStoppingHandler(monitor={self.monitor!r}, patience={self.patience})"
