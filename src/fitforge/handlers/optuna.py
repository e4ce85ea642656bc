"""OptunaPruningHandler: report a monitored value to an Optuna trial; end a pruned trial cleanly."""

from __future__ import annotations

import logging
from typing import Any

from fitforge.core.events import BatchEnd, EpochEnd, TrainBegin
from fitforge.core.roles import Monitoring
from fitforge.core.state import Ending, TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.metrics.monitor import Monitor, infer_mode

log = logging.getLogger("fitforge")


class OptunaPruningHandler(TrainBegin, BatchEnd, EpochEnd, Monitoring):
    """Report ``monitor`` to an Optuna trial at each new value, and end the fit when Optuna prunes; ``fit`` then raises
    ``optuna.TrialPruned`` (docs/tuning.md). Needs ``pip install "fitforge[optuna]"``.

    Args:
        trial: an ``optuna.Trial`` (anything with ``report`` and ``should_prune``); None on the ranks other than 0.
        monitor: the history key reported, e.g. ``"val_loss"`` or ``"val_accuracy"``.
    """

    reads = ("estimator", "epoch", "run", "global_step", "history", "services")
    writes = ("run",)

    def __init__(self, trial: Any, monitor: str = "val_loss") -> None:
        try:  # imported here: optuna is an optional extra
            import optuna
        except ImportError as err:
            raise ImportError('OptunaPruningHandler needs the optuna package: pip install "fitforge[optuna]"') from err
        self._pruned: type[Exception] = optuna.TrialPruned  # on every rank: each one raises it
        if trial is not None and not all(callable(getattr(trial, name, None)) for name in ("report", "should_prune")):
            raise FitforgeTypeError(
                f"OptunaPruningHandler: trial must be an optuna.Trial (the argument of the objective), or None on "
                f"the ranks other than 0 under torchrun, got {describe(trial)}"
            )
        self._monitor = Monitor(monitor, owner="OptunaPruningHandler")
        self.trial, self.monitor = trial, monitor
        self.pruned_at: int | None = None  # the step at which Optuna pruned the trial, in the last fit
        self._by_batch = False  # validation runs between batches too: report at batch ends, by batches
        self._seen = 0  # values of monitor recorded so far this fit (History.times_recorded)

    def train_begin(self, state: TrainState) -> None:
        self.pruned_at, self._seen = None, 0
        self._by_batch = state.services.validates_mid_epoch
        # on rank 0, its error shared: the other ranks must not wait in a collective rank 0 never reaches
        state.run.ranks.on_main(lambda: self._check_trial(state), FitforgeValueError)

    def batch_end(self, state: TrainState) -> None:
        if self._by_batch:  # else nothing to do per batch: values come at epoch ends
            self._report_new(state, state.global_step + 1)  # this batch counts once its batch_end ran

    def epoch_end(self, state: TrainState) -> None:
        if state.run.epoch_suspended:
            return  # a signal cut the epoch short: the resumed run finishes it and reports its value
        self._monitor.epoch_value(state, self)  # a key only a custom validation gives fails here if it never comes
        self._report_new(state, state.global_step if self._by_batch else state.run.epochs_before + state.epoch)

    def _report_new(self, state: TrainState, step: int) -> None:
        """Report the monitored value if one was recorded since the last report; stop if pruned."""
        key = self._monitor.key
        recorded, value = state.history.times_recorded(key), state.history.current(key)
        if recorded == self._seen or value is None:
            return
        self._seen = recorded
        # Rank 0 asks Optuna; its verdict reaches every rank here (they validate together): all stop at this batch.
        verdict = state.run.ranks.on_main(lambda: self._judge(value, step), FitforgeValueError)
        if verdict is None or not verdict[0]:
            return
        self.pruned_at = step
        reason = f"Optuna pruned trial {verdict[1]} at step {step} ({key}={value:.4g})"
        state.run.stop(reason, every_rank=True, ending=Ending("Pruned", self._pruned(reason)))

    def _judge(self, value: float, step: int) -> tuple[bool, Any]:
        """``(pruned, trial number)``, on rank 0."""
        self.trial.report(value, step)
        return bool(self.trial.should_prune()), getattr(self.trial, "number", "")

    def _check_trial(self, state: TrainState) -> None:
        if self.trial is None:
            raise FitforgeValueError(
                "OptunaPruningHandler: trial is None on rank 0 (or in a single process), which reports to Optuna; "
                "pass the objective's optuna.Trial there (None is for the other ranks under torchrun)"
            )
        directions = list(getattr(getattr(self.trial, "study", None), "directions", None) or [])
        if len(directions) > 1:
            raise FitforgeValueError(
                f"OptunaPruningHandler: the study has {len(directions)} objectives, and Optuna prunes "
                "single-objective studies only (trial.report is not supported with several); create the study "
                "with one direction, or leave this handler out"
            )
        try:
            mode, why = infer_mode(self._monitor.key, state.estimator)
        except FitforgeValueError:
            return  # a key whose better side is unknown: the study's direction is all there is
        wanted = (
            {"MINIMIZE": "min", "MAXIMIZE": "max"}.get(getattr(directions[0], "name", ""), mode) if directions else mode
        )
        if mode != wanted:  # Optuna judges the reported values by the study's direction alone
            log.warning(
                "OptunaPruningHandler monitors %s, which is better %s (%s), but the study %s: Optuna would prune "
                "the best trials; monitor the objective's own key, or create the study with the other direction",
                self.monitor,
                "lower" if mode == "min" else "higher",
                why,
                "minimizes" if wanted == "min" else "maximizes",
            )

    def __repr__(self) -> str:
        return f"OptunaPruningHandler(monitor={self.monitor!r})"
