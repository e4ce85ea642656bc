"""Monitor: the "watch a history key, min/max/auto, min_delta" logic of the handlers that track a best value."""

from __future__ import annotations

import logging
import math
from typing import Any

from fitforge.core.state import EstimatorLike, TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, MonitorKeyError, check_number, describe

log = logging.getLogger("fitforge")

# Words of a key (split on "_") that say which way is better; checked after a metric object's
# own ``higher_is_better``, which always wins.
_LOWER = frozenset("loss error err mse mae rmse l1 l2 perplexity distance time".split())  # noqa: SIM905
_HIGHER = frozenset("accuracy acc iou miou match f1 precision recall auc ap map dice r2 score".split())  # noqa: SIM905


def infer_mode(key: str, estimator: EstimatorLike) -> tuple[str, str]:
    """``("min" | "max", why)`` for a history key; raise when it cannot be told."""
    name = key.split("_", 1)[1] if key.startswith(("train_", "val_")) else key
    for slot in [*estimator.train_metrics, *estimator.val_metrics]:
        better = getattr(slot.metric, "higher_is_better", None)
        if slot.name == name and isinstance(better, bool):
            return ("max" if better else "min"), f"{type(slot.metric).__name__}.higher_is_better={better}"
    words = set(name.lower().split("_"))
    lower, higher = words & _LOWER, words & _HIGHER
    if lower and not higher:
        return "min", f"{min(lower)!r} in the key"
    if higher and not lower:
        return "max", f"{min(higher)!r} in the key"
    raise FitforgeValueError(
        f"cannot tell whether a higher or a lower {key!r} is better; pass mode='min' or mode='max'"
    )


class Monitor:
    """Which way ``key`` improves and by how much.

    Args:
        key: a history key such as ``"val_loss"``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (inferred at fit start: see :func:`infer_mode`).
        min_delta: an improvement must exceed this (a non-negative number).
        owner: the handler's name for messages.
    """

    def __init__(self, key: Any, mode: Any = "auto", min_delta: Any = 0.0, owner: str = "handler") -> None:
        if not isinstance(key, str) or not key:
            raise FitforgeTypeError(f"{owner}: monitor must be a history key such as 'val_loss', got {describe(key)}")
        if mode not in ("auto", "min", "max"):
            raise FitforgeValueError(f"{owner}: mode must be 'auto', 'min' or 'max', got {mode!r}")
        check_number(owner, "min_delta", min_delta)
        if min_delta < 0:
            raise FitforgeValueError(
                f"{owner}: min_delta must be >= 0 (the direction comes from mode), got {min_delta}"
            )
        self.key, self.mode, self.min_delta, self.owner = key, mode, float(min_delta), owner
        self.resolved_mode: str = "" if mode == "auto" else mode  # set by resolve() for "auto"

    def resolve(self, estimator: EstimatorLike) -> str:
        """Fix the mode for a run (inferring it for ``"auto"``, which is logged); return it."""
        if self.mode == "auto":
            self.resolved_mode, why = infer_mode(self.key, estimator)
            log.info("%s monitors %s: mode %s (from %s)", self.owner, self.key, self.resolved_mode, why)
        return self.resolved_mode

    def improved(self, value: float, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` by more than ``min_delta``. A non-finite value (a diverged
        epoch's) never does, and a non-finite ``best`` (from an older checkpoint) counts as none."""
        if not math.isfinite(value):
            return False
        if best is None or not math.isfinite(best):
            return True
        gain = value - best if self.resolved_mode == "max" else best - value
        return gain > self.min_delta

    def epoch_value(self, state: TrainState, who: object) -> float | None:
        """The key's value in this epoch's history row; None when it was not produced this epoch."""
        if self.key in state.history:
            return state.history.current(self.key)
        # fit start checked the key against what the run produces, except keys only a custom eval_fn
        # can give: once a row holds values of the key's kind (val_...) without it, it never will.
        kind = self.key.split("_", 1)[0] + "_"
        if any(key.startswith(kind) for key in state.history):
            monitored_value(state, self.key, who)  # a MonitorKeyError listing the keys produced
        return None


def monitored_value(state: TrainState, key: str, who: object) -> float:
    """The current value of a monitored key, or a MonitorKeyError listing the available keys."""
    try:
        return state.metrics[key]
    except KeyError:
        raise MonitorKeyError(
            f"{who!r} monitors {key!r}, which is not among the values produced: {', '.join(state.metrics)}"
        ) from None
