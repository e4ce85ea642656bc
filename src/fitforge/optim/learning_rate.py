"""Setting the learning rate of the estimator's optimizers between fits (:meth:`Estimator.set_lr`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

OWNER = "set_lr"


def set_learning_rate(optimizers: Sequence[torch.optim.Optimizer], lr: Any, optimizer: Any = None) -> None:
    """Set ``lr`` (a number >= 0, or one per parameter group) in ``optimizers[optimizer]`` (an index or one
    of them), or in every optimizer when ``optimizer`` is None. Everything is checked before any change."""
    chosen = _chosen(optimizers, optimizer)
    if isinstance(lr, (list, tuple)):
        if len(chosen) != 1:
            raise FitforgeValueError(
                f"{OWNER}: a list of learning rates gives one per parameter group of one optimizer, but the estimator "
                f"has {len(optimizers)} optimizers; pass optimizer=<index> too, or a single number for every group"
            )
        groups = chosen[0].param_groups
        if len(lr) != len(groups):
            raise FitforgeValueError(
                f"{OWNER}: lr has {len(lr)} learning rates, but the optimizer has {len(groups)} parameter group(s); "
                f"give one per group, in the order of optimizer.param_groups, or a single number for every group"
            )
        written = list(zip(groups, [_checked(value, f"lr[{i}]") for i, value in enumerate(lr)]))
    else:
        rate = _checked(lr, "lr")
        written = [(group, rate) for item in chosen for group in item.param_groups]
    for group, rate in written:
        write_rate(group, rate)


def _chosen(optimizers: Sequence[torch.optim.Optimizer], optimizer: Any) -> list[torch.optim.Optimizer]:
    if not optimizers:
        raise FitforgeValueError(f"{OWNER}: the estimator has no optimizer yet (its net had nothing to train)")
    if optimizer is None:
        return list(optimizers)
    if isinstance(optimizer, torch.optim.Optimizer):
        if not any(optimizer is item for item in optimizers):
            raise FitforgeValueError(
                f"{OWNER}: optimizer {describe(optimizer)} is not one of the estimator's {len(optimizers)} "
                f"optimizer(s); pass estimator.optimizers[i], its index i, or None for all"
            )
        return [optimizer]
    if isinstance(optimizer, bool) or not isinstance(optimizer, int):
        raise FitforgeTypeError(
            f"{OWNER}: optimizer must be None (every optimizer), an index into estimator.optimizers or one of "
            f"them, got {describe(optimizer)}"
        )
    if not 0 <= optimizer < len(optimizers):
        raise FitforgeValueError(
            f"{OWNER}: optimizer={optimizer}, but the estimator has {len(optimizers)} optimizer(s) "
            f"(indices 0 to {len(optimizers) - 1})"
        )
    return [optimizers[optimizer]]


def _checked(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FitforgeTypeError(
            f"{OWNER}: {name} must be a number >= 0 (or a list of them, one per parameter group), got {describe(value)}"
        )
    if not math.isfinite(value) or value < 0:
        raise FitforgeValueError(f"{OWNER}: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def write_rate(group: dict[str, Any], rate: float) -> None:
    """Write ``rate`` into a parameter group's ``lr``, and its ``initial_lr`` where a scheduler recorded one
    (a scheduler built next takes its base rates from it)."""
    for key in ("lr", "initial_lr"):
        if isinstance(group.get(key), torch.Tensor):  # a tensor rate (capturable, compiled steps): keep the tensor
            group[key].fill_(rate)
        elif key in group:
            group[key] = rate
