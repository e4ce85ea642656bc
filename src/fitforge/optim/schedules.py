"""Learning-rate schedules torch does not ship in one piece, and the length of a fit in optimizer steps."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR

from fitforge.core.roles import Accumulating
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")
ONE_CYCLE_LENGTHS = {"total_steps", "epochs", "steps_per_epoch"}  # OneCycleLR's arguments that size it


class WarmupCosineLR(LRScheduler):
    """Linear warm-up from 0 to each parameter group's learning rate over ``warmup_steps`` steps,
    then a cosine decay to ``min_lr``, reached exactly at step ``total_steps - 1`` (the last).

    Args:
        optimizer: whose groups' ``lr`` (``initial_lr`` when set) are the peaks.
        warmup_steps: steps of the warm-up (0: none, the decay starts at the peak).
        total_steps: steps of the whole schedule; at least ``warmup_steps + 2``.
        min_lr: the rate at the last step, one for all groups or one per group.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr: float | Sequence[float] = 0.0,
        last_epoch: int = -1,
    ) -> None:
        for name, value in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise FitforgeTypeError(f"WarmupCosineLR: {name} must be an int >= 0, got {describe(value)}")
        if total_steps < warmup_steps + 2:
            raise FitforgeValueError(
                f"WarmupCosineLR: total_steps={total_steps} leaves no decay after warmup_steps={warmup_steps}: the "
                "peak is at step warmup_steps and min_lr at step total_steps - 1, a later one; use a shorter "
                "warm-up or a longer schedule"
            )
        groups = len(optimizer.param_groups)
        mins = list(min_lr) if isinstance(min_lr, (list, tuple)) else [min_lr] * groups
        if len(mins) != groups or not all(_rate(value) for value in mins):
            raise FitforgeValueError(
                f"WarmupCosineLR: min_lr must be a finite rate >= 0, or one per parameter group ({groups}), "
                f"got {min_lr!r}"
            )
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.min_lrs = [float(m) for m in mins]  # type: ignore[arg-type]  # numbers: checked by _rate
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self.rate(float(base), low, self.last_epoch) for base, low in zip(self.base_lrs, self.min_lrs)]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def rate(self, peak: float, low: float, step: int) -> float:
        """The rate of step ``step`` for a group of peak ``peak`` and last rate ``low``."""
        if step < self.warmup_steps:
            return peak * step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - 1 - self.warmup_steps))
        return low + (peak - low) * (1.0 + math.cos(math.pi * progress)) / 2.0


def _rate(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def fit_steps(state: TrainState, who: str, fix: str = "pass batches=N to fit") -> int:
    """The optimizer steps a fit takes; ``fix`` says how to give the length to ``who`` where it is not known."""
    steps = state.services.steps
    accumulate = 1 if steps is None else steps.accumulate
    per_epoch = None if state.num_batches is None else math.ceil(state.num_batches / accumulate)
    lengths = []
    if state.run.max_epochs is not None and per_epoch is not None:
        lengths.append(state.run.max_epochs * per_epoch)
    if state.run.max_batches is not None:
        full, rest = divmod(state.run.max_batches, state.num_batches or state.run.max_batches + 1)
        lengths.append(full * (per_epoch or 0) + math.ceil(rest / accumulate))
    if not lengths:
        raise FitforgeValueError(
            f"{who} cannot tell the fit's length: train_data has no len() and fit was given "
            f"epochs={state.run.max_epochs}; {fix}"
        )
    return max(min(lengths), 1)


def step_counter(state: TrainState) -> Accumulating | None:
    """What counts each optimizer's steps where there are several (they may take turns), else None."""
    return state.services.steps if len(state.estimator.optimizers) > 1 else None


def own_steps(state: TrainState, counter: Accumulating | None, index: int) -> int:
    """The steps optimizer ``index`` took (``counter`` from :func:`step_counter`)."""
    return state.optimizer_steps if counter is None else counter.steps_per_optimizer(state)[index]


def warn_taking_turns(who: str, index: int, steps: int, state: TrainState, total: int) -> None:
    """Warn that a schedule spanning the fit ends part-way for an optimizer that steps on some batches only."""
    log.warning(
        f"{who}: optimizer {index} stepped {steps} of the fit's first {state.optimizer_steps} optimizer steps "
        f"(optimizers taking turns), but the schedule spans all {total} of the fit's steps, so it will end "
        "part-way; give total_steps=N (this optimizer's steps in the fit)"
    )


def scheduled_optimizer(who: str, index: int, state: TrainState) -> Any:
    """``estimator.optimizers[index]``, the optimizer ``who`` (a schedule) sets; a clear error if none."""
    optimizers = state.estimator.optimizers
    if index >= len(optimizers):
        raise FitforgeValueError(f"{who}: optimizer={index}, but the estimator has {len(optimizers)} optimizer(s)")
    return optimizers[index]


class OneCycleRecipe:
    """What :meth:`LRSchedulerHandler.one_cycle` builds at fit start, once the fit's length is known."""

    name, method = "OneCycleLR", "one_cycle"

    def __init__(self, max_lr: Any, index: int, kwargs: dict[str, Any]) -> None:
        self.max_lr, self.index, self.kwargs = max_lr, index, kwargs
        self.sized = bool(ONE_CYCLE_LENGTHS & kwargs.keys())  # its length given: nothing to warn of

    def build(self, state: TrainState) -> OneCycleLR:
        optimizer, kwargs = scheduled_optimizer("LRSchedulerHandler.one_cycle", self.index, state), dict(self.kwargs)
        if not self.sized:
            kwargs["total_steps"] = fit_steps(
                state, "LRSchedulerHandler.one_cycle", "pass batches=N to fit, or total_steps=N to one_cycle"
            )
        kwargs.setdefault("cycle_momentum", "momentum" in optimizer.defaults or "betas" in optimizer.defaults)
        try:
            return OneCycleLR(optimizer, self.max_lr, **kwargs)
        except (ValueError, TypeError) as err:
            raise FitforgeValueError(
                f"LRSchedulerHandler.one_cycle: OneCycleLR rejected max_lr={self.max_lr!r} with {kwargs}: {err}"
            ) from err


class WarmupCosineRecipe:
    """What :meth:`LRSchedulerHandler.warmup_cosine` builds at fit start, once the fit's length is known."""

    name, method = "WarmupCosineLR", "warmup_cosine"

    def __init__(self, warmup: int | float, min_lr: Any, index: int, total_steps: int | None) -> None:
        self.warmup, self.min_lr, self.index, self.total_steps = warmup, min_lr, index, total_steps
        self.sized = total_steps is not None

    def build(self, state: TrainState) -> WarmupCosineLR:
        who = "LRSchedulerHandler.warmup_cosine"
        optimizer = scheduled_optimizer(who, self.index, state)
        total = self.total_steps
        if total is None:
            total = fit_steps(state, who, "pass batches=N to fit, or total_steps=N")
        # A fraction of the steps, rounded down (a product a hair under a whole number counts as it)
        warmup = self.warmup if isinstance(self.warmup, int) else math.floor(self.warmup * total + 1e-9)
        if total < warmup + 2:
            raise FitforgeValueError(
                f"{who}: this fit takes {total} optimizer step(s), which leaves no decay after a warm-up of {warmup}: "
                f"the peak is at step {warmup} and min_lr at the last step; use a shorter warm-up or a longer fit"
            )
        peaks = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        lows = self.min_lr if isinstance(self.min_lr, (list, tuple)) else [self.min_lr] * len(peaks)
        above = [(low, peak) for low, peak in zip(lows, peaks) if isinstance(low, (int, float)) and low > peak]
        if above:
            raise FitforgeValueError(
                f"{who}: min_lr={above[0][0]} is above the rate it decays from, the optimizer's lr={above[0][1]}: "
                "give a min_lr below each parameter group's lr"
            )
        try:
            return WarmupCosineLR(optimizer, warmup, total, self.min_lr)
        except (FitforgeValueError, FitforgeTypeError) as err:
            raise FitforgeValueError(f"{who}: {err}") from err
