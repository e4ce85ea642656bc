"""Schedules: learning-rate ones torch does not ship in one piece (linear warm-up, then cosine
decay), and the length of a fit in optimizer steps that a schedule spans."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from fitforge.core.roles import Accumulating, players
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


class WarmupCosineLR(LRScheduler):
    """Linear warm-up from 0 to each parameter group's learning rate over ``warmup_steps`` steps,
    then a cosine decay to ``min_lr``, reached exactly at step ``total_steps - 1`` (the last).

    Step ``k`` (0-based: the rate the ``k``-th optimizer step uses, after ``k`` calls of
    ``step()``) has the rate ``lr * k / warmup_steps`` while ``k < warmup_steps``, then
    ``min_lr + (lr - min_lr) * (1 + cos(pi * (k - warmup_steps) / (total_steps - 1 - warmup_steps))) / 2``:
    the peak ``lr`` at step ``warmup_steps``. Stepped past its last step it stays at ``min_lr``.
    Its state (``state_dict``) holds the lengths and rates, so a resume continues exactly.

    Args:
        optimizer: whose groups' ``lr`` (``initial_lr`` when set, as torch's schedulers read it)
            are the peaks.
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
    """The optimizer steps a fit takes (the first limit reached of ``epochs`` and ``batches``, a
    trailing accumulation group at each epoch end a step of its own); ``fix`` says how to give the
    length to ``who`` (a schedule) where it cannot be known."""
    accumulate = next((h.accumulate for h in players(state.handlers, Accumulating)), 1)
    per_epoch = None if state.num_batches is None else math.ceil(state.num_batches / accumulate)
    lengths = []
    if state.max_epochs is not None and per_epoch is not None:
        lengths.append(state.max_epochs * per_epoch)
    if state.max_batches is not None:
        full, rest = divmod(state.max_batches, state.num_batches or state.max_batches + 1)
        lengths.append(full * (per_epoch or 0) + math.ceil(rest / accumulate))
    if not lengths:
        raise FitforgeValueError(
            f"{who} cannot tell the fit's length: train_data has no len() and fit was given "
            f"epochs={state.max_epochs}; {fix}"
        )
    return max(min(lengths), 1)
