"""LRSchedulerHandler: step any ``torch.optim.lr_scheduler`` scheduler per epoch or per optimizer step."""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import warnings
from typing import Any

from torch.optim.lr_scheduler import LRScheduler, OneCycleLR, ReduceLROnPlateau

from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, Event, Stage, TrainBegin, TrainEnd
from fitforge.core.history import numbered_key
from fitforge.core.roles import Accumulating, Monitoring
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.metrics.monitor import Monitor, infer_mode
from fitforge.optim.schedules import (
    OneCycleRecipe,
    WarmupCosineRecipe,
    fit_steps,
    own_steps,
    scheduled_optimizer,
    step_counter,
    warn_taking_turns,
)

log = logging.getLogger("fitforge")
_ONE_CYCLE_ARGS = sorted(set(inspect.signature(OneCycleLR).parameters) - {"optimizer", "max_lr"})


class LRSchedulerHandler(TrainBegin, EpochBegin, BatchEnd, EpochEnd, TrainEnd, Monitoring):
    """Step a learning-rate scheduler at every epoch end or after every optimizer step; ``history["lr"][e]`` is the
    rate *after* epoch ``e``'s steps (docs/handlers.md, Learning-rate schedules).

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` instance built on one of the estimator's optimizers.
        interval: ``"epoch"`` or ``"batch"``.
        monitor: the history key ``ReduceLROnPlateau`` steps with, e.g. ``"val_loss"`` (needed for it, and only for
            it). Its ``mode`` must agree with which way the key improves.
    """

    priority = Stage.PERSIST  # after validation; before CheckpointHandler, which reads the history it writes
    reads = ("estimator", "metrics", "history", "optimizer_steps", "num_batches", "run", "services", "batch_idx")
    writes = ("history",)  # the lr records; the optimizers' lrs it changes are no TrainState field

    def __init__(self, scheduler: Any, interval: str = "epoch", monitor: str | None = None) -> None:
        recipe = scheduler if isinstance(scheduler, (OneCycleRecipe, WarmupCosineRecipe)) else None
        if recipe is None and not isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
            hint = (
                "; wrap the optimizer in one, e.g. StepLR(optimizer, step_size=10)"
                if hasattr(scheduler, "param_groups")
                else ""
            )
            raise FitforgeTypeError(
                f"LRSchedulerHandler: scheduler must be a torch.optim.lr_scheduler scheduler "
                f"instance, got {describe(scheduler)}{hint}"
            )
        if not isinstance(interval, str):
            raise FitforgeTypeError(
                f"LRSchedulerHandler: interval must be 'epoch' or 'batch', got {describe(interval)}"
            )
        if interval not in ("epoch", "batch"):
            raise FitforgeValueError(f"LRSchedulerHandler: interval must be 'epoch' or 'batch', got {interval!r}")
        plateau = isinstance(scheduler, ReduceLROnPlateau)
        if plateau and monitor is None:
            raise FitforgeValueError(
                "LRSchedulerHandler: ReduceLROnPlateau steps with a monitored value; pass "
                "monitor='val_loss' (a history key), got monitor=None"
            )
        if plateau and interval == "batch":
            raise FitforgeValueError(
                "LRSchedulerHandler: ReduceLROnPlateau steps with an epoch's value of "
                f"{monitor!r}; use interval='epoch', got interval='batch'"
            )
        if monitor is not None and not plateau:
            raise FitforgeValueError(
                f"LRSchedulerHandler: monitor is only for ReduceLROnPlateau; {type(scheduler).__name__} steps without "
                f"a value, so leave monitor=None, got monitor={monitor!r}"
            )
        self._monitor = None if monitor is None else Monitor(monitor, owner="LRSchedulerHandler")
        self.scheduler: Any = None if recipe else scheduler
        self.interval, self.monitor, self._recipe = interval, monitor, recipe
        if interval != "batch":  # called per batch only then
            self.handled_events = (Event.TRAIN_BEGIN, Event.EPOCH_BEGIN, Event.EPOCH_END)
        self._steps_seen: int | None = None  # steps of its optimizer the scheduler has followed
        self._batches_seen = -1  # state.optimizer_steps when the scheduler last looked (any optimizer's)
        self._updater: Accumulating | None = None  # which counts each optimizer's steps
        self._index = 0  # of its optimizer in estimator.optimizers
        self._pending: dict | None = None  # a state loaded before a one-cycle scheduler was built
        self._rates: list[float] | None = None  # the rates before a fit built the schedule, until it steps
        self._warned_turns = False
        self._started_at = 0  # its optimizer's steps when the fit's first epoch began

    @classmethod
    def one_cycle(cls, max_lr: float | list[float], optimizer: int = 0, **onecycle_kwargs: Any) -> LRSchedulerHandler:
        """A ``OneCycleLR`` over the whole fit, stepped per optimizer step, built at fit start for
        ``estimator.optimizers[optimizer]`` with ``total_steps`` the fit's optimizer steps unless ``onecycle_kwargs``
        gives the length (docs/handlers.md)."""
        values = max_lr if isinstance(max_lr, (list, tuple)) else [max_lr]
        if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise FitforgeTypeError(
                f"LRSchedulerHandler.one_cycle: max_lr must be a positive number (or one per "
                f"parameter group), got {describe(max_lr)}"
            )
        if not all(v > 0 and math.isfinite(v) for v in values):
            raise FitforgeValueError(
                f"LRSchedulerHandler.one_cycle: max_lr must be positive and finite, got {max_lr!r}"
            )
        _check_index("one_cycle", optimizer)
        unknown = sorted(set(onecycle_kwargs) - set(_ONE_CYCLE_ARGS))
        if unknown:
            raise FitforgeTypeError(
                f"LRSchedulerHandler.one_cycle got unknown argument(s) {unknown}; OneCycleLR "
                f"takes {', '.join(_ONE_CYCLE_ARGS)}"
            )
        return cls(OneCycleRecipe(max_lr, optimizer, onecycle_kwargs), interval="batch")

    @classmethod
    def warmup_cosine(
        cls, warmup: int | float, min_lr: float | list[float] = 0.0, optimizer: int = 0, total_steps: int | None = None
    ) -> LRSchedulerHandler:
        """Linear warm-up from 0 to each parameter group's ``lr``, then cosine decay to ``min_lr`` at the fit's last
        optimizer step (a :class:`~fitforge.optim.schedules.WarmupCosineLR`, built at fit start as :meth:`one_cycle`).

        Args:
            warmup: optimizer steps of the warm-up (an int >= 0), or a fraction of the fit's steps (a float in
                (0, 1), rounded down).
            min_lr: the rate at the last step (one per parameter group, or one for all), below the starting rate.
            optimizer: the index of the optimizer in ``estimator.optimizers``.
            total_steps: the optimizer's steps in the fit, for optimizers stepped by turns (``BatchOutput.step``).
        """
        integer = isinstance(warmup, numbers.Integral) and not isinstance(warmup, bool)
        fraction = isinstance(warmup, float) and 0 <= warmup < 1
        if not ((integer and warmup >= 0) or fraction):
            raise FitforgeValueError(
                "LRSchedulerHandler.warmup_cosine: warmup is optimizer steps (an int >= 0) or a fraction of the "
                f"fit's steps (a float from 0 to 1, e.g. 0.1), got {describe(warmup)}"
            )
        lows = min_lr if isinstance(min_lr, (list, tuple)) else [min_lr]
        if not lows or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in lows):
            raise FitforgeValueError(
                f"LRSchedulerHandler.warmup_cosine: min_lr must be a rate >= 0, or one per parameter group, "
                f"got {describe(min_lr)}"
            )
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 2
        ):
            raise FitforgeTypeError(
                f"LRSchedulerHandler.warmup_cosine: total_steps must be an int >= 2 (the optimizer's steps in the "
                f"fit) or None, got {describe(total_steps)}"
            )
        _check_index("warmup_cosine", optimizer)
        steps = int(warmup) if integer else warmup
        return cls(WarmupCosineRecipe(steps, min_lr, optimizer, total_steps), interval="batch")

    def train_begin(self, state: TrainState) -> None:
        self._steps_seen = None  # set at the first epoch_begin, after a resume may have restored it
        if self._recipe is not None:  # rebuilt per fit: before CheckpointHandler (persist) loads the optimizer
            self._rates, self._warned_turns = None, False
            optimizer = scheduled_optimizer(f"LRSchedulerHandler.{self._recipe.method}", self._recipe.index, state)
            rates = [group["lr"] for group in optimizer.param_groups]
            self.scheduler = self._recipe.build(state)
            self._rates = rates  # built: the rates to give back if the fit takes no step
            if self._pending is not None:
                self.load_state_dict(self._pending)
        optimizers = state.estimator.optimizers
        if not any(self.scheduler.optimizer is optimizer for optimizer in optimizers):
            raise FitforgeValueError(
                f"LRSchedulerHandler: the scheduler's optimizer ({describe(self.scheduler.optimizer)}) is not one of "
                f"the estimator's {len(optimizers)} optimizer(s); build the scheduler on estimator.optimizer "
                "(or estimator.optimizers[i])"
            )
        self._index = next(i for i, optimizer in enumerate(optimizers) if self.scheduler.optimizer is optimizer)
        self._updater = step_counter(state)
        self._batches_seen = -1  # the first batch looks, whatever a resume restored
        if self._monitor is not None:
            try:
                better, why = infer_mode(self.monitor, state.estimator)  # type: ignore[arg-type]
            except FitforgeValueError:  # a key whose direction cannot be told: the scheduler's mode is the user's word
                better = self.scheduler.mode
            if better != self.scheduler.mode:
                raise FitforgeValueError(
                    f"LRSchedulerHandler: ReduceLROnPlateau(mode={self.scheduler.mode!r}) would cut the learning rate "
                    f"while {self.monitor!r} improves: a {'higher' if better == 'max' else 'lower'} value is better "
                    f"({why}); build it with mode={better!r}"
                )

    def epoch_begin(self, state: TrainState) -> None:
        if self._steps_seen is None:  # the fit's first epoch, after any resume: before its first step
            self._steps_seen = self._started_at = own_steps(state, self._updater, self._index)
            if isinstance(self.scheduler, OneCycleLR) and self._recipe is None:
                self._check_cycle_length(state)

    def _check_cycle_length(self, state: TrainState) -> None:
        """A OneCycleLR the user sized must fit this fit's steps (epochs and a data length known): too few crash in
        a later epoch (torch's "Tried to step"), and one per epoch of a cycle sized in batches never reaches max_lr."""
        total, done = self.scheduler.total_steps, self.scheduler.last_epoch
        if self.interval == "batch":
            if self._updater is not None:
                return  # optimizers stepped by turns: one optimizer's count is not known in advance
            try:
                needed = fit_steps(state, "LRSchedulerHandler") - state.optimizer_steps
            except FitforgeValueError:
                return  # no length: nothing to compare
            unit, fix = "optimizer steps", f"OneCycleLR(..., total_steps={needed}) (a new one)"
        else:
            if state.run.max_epochs is None:
                return
            needed = state.run.max_epochs - state.epoch
            unit, fix = (
                "epochs",
                f"interval='batch' (a cycle over optimizer steps), or a new one of total_steps={needed}",
            )
        if needed > total - done:
            raise FitforgeValueError(
                f"LRSchedulerHandler: the OneCycleLR has {total - done} of its total_steps={total} left, but this fit "
                f"takes {needed} {unit}: it would fail with torch's 'Tried to step' error part-way; build it with "
                f"{fix}, or use LRSchedulerHandler.one_cycle(max_lr=...), which sizes itself to the fit"
            )
        phases = getattr(self.scheduler, "_schedule_phases", None) or [{}]
        peak = phases[0].get("end_step", 0)  # the step at which the rate reaches max_lr
        if self.interval == "epoch" and needed + done < peak:
            log.warning(
                "LRSchedulerHandler: the OneCycleLR is stepped once per epoch (interval='epoch'), and this fit's %d "
                "epochs end it at step %d of total_steps=%d, before its peak (max_lr) at step %d; use "
                "interval='batch', or build a new one with total_steps=%d",
                needed,
                needed + done,
                total,
                int(peak),
                needed,
            )

    def batch_end(self, state: TrainState) -> None:
        # interval="batch" only (handled_events): an int compare per batch; a CancelBatch after the step catches up.
        if state.optimizer_steps != self._batches_seen:
            self._follow_steps(state)

    def epoch_end(self, state: TrainState) -> None:
        if self.interval == "batch":  # a trailing accumulation group is stepped at epoch end
            stepped = own_steps(state, self._updater, self._index) != self._steps_seen
            if stepped:
                self._follow_steps(state)
        else:
            stepped = state.run.epoch_finished and self._step_epoch(state)
        if stepped:
            for i, optimizer in enumerate(state.estimator.optimizers):  # the keys the loop records
                state.history.record(numbered_key("lr", i), float(optimizer.param_groups[0]["lr"]))

    def train_end(self, state: TrainState) -> None:
        """A fit that took no step with a schedule it built (it failed at its first batch, say) gives the optimizer
        its rates back: the schedule's first rate (0 for a warm-up) would else stay for the next fit."""
        rates, self._rates = self._rates, None
        stepped = self._steps_seen is not None and own_steps(state, self._updater, self._index) > self._started_at
        if rates is None or state.run.resumed or stepped:
            return
        for group, rate in zip(self.scheduler.optimizer.param_groups, rates):
            group["lr"] = rate

    def _follow_steps(self, state: TrainState) -> None:
        scheduler, seen, recipe = self.scheduler, self._steps_seen or 0, self._recipe
        steps = own_steps(state, self._updater, self._index)
        # A schedule sized to every optimizer step, whose optimizer steps only on some batches (optimizers taking
        # turns), would end part-way: say so once, with the fix.
        turns = self._updater is not None and state.optimizer_steps >= 2 and steps != state.optimizer_steps
        if turns and not self._warned_turns and recipe is not None and not recipe.sized:
            self._warned_turns = True
            warn_taking_turns(f"LRSchedulerHandler.{recipe.method}", self._index, steps, state, scheduler.total_steps)
        for _ in range(steps - seen):
            if recipe is not None and scheduler.last_epoch >= scheduler.total_steps - 1:
                break  # at the cycle's end (the fit's last step, or a cancelled batch's extra one)
            self._step()
        self._steps_seen, self._batches_seen = steps, state.optimizer_steps

    def _step_epoch(self, state: TrainState) -> bool:
        if self._monitor is None:
            self._step()
            return True
        value = self._monitor.epoch_value(state, self)
        if value is None:
            return False
        before = [group["lr"] for group in self.scheduler.optimizer.param_groups]
        # nan counts as no improvement; so does inf, else a best never beaten (or, the wrong way round, a cut at once).
        self.scheduler.step(value if math.isfinite(value) else math.nan)
        after = [group["lr"] for group in self.scheduler.optimizer.param_groups]
        if after != before:
            log.info(
                "LRSchedulerHandler: %s stopped improving (%.4g): lr %.4g -> %.4g",
                self.monitor,
                value,
                before[0],
                after[0],
            )
        return True

    def _step(self) -> None:
        if getattr(self.scheduler, "_step_count", 0) > 1:
            self.scheduler.step()
            return
        # Its first step: torch warns unless this process stepped the optimizer already, which a run resumed at an
        # epoch's end (or whose first epoch was all cancelled) has not; steps follow optimizer steps here anyway.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
            self.scheduler.step()

    def state_dict(self) -> dict:
        """The scheduler's state, and how many steps of its optimizer it has followed."""
        return {
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "optimizer_steps": self._steps_seen,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler is None:  # a one-cycle scheduler is built at train_begin
            self._pending = state
            return
        self._pending = None
        if state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._steps_seen = state.get("optimizer_steps")

    def __repr__(self) -> str:
        name = self._recipe.name if self._recipe is not None else type(self.scheduler).__name__
        extra = f", monitor={self.monitor!r}" if self.monitor else ""
        return f"LRSchedulerHandler({name}, interval={self.interval!r}{extra})"


def _check_index(method: str, optimizer: Any) -> None:
    if isinstance(optimizer, bool) or not isinstance(optimizer, int) or optimizer < 0:
        raise FitforgeTypeError(
            f"LRSchedulerHandler.{method}: optimizer must be an index into "
            f"estimator.optimizers (an int >= 0), got {describe(optimizer)}"
        )
