"""The first batch's trial of a metric (a throw-away copy updated once), and the check that it gives one number."""

from __future__ import annotations

import copy
from typing import Any

import torch

from fitforge.exceptions import FitforgeValueError
from fitforge.metrics.base import SumCountMetric
from fitforge.metrics.builtin import is_builtin, takes_batch
from fitforge.metrics.resolve import MetricSlot


def trial_copy(metric: Any) -> Any:
    """A throw-away copy of ``metric``: shallow and reset for fitforge's own (a deep copy costs more), else deep."""
    if is_builtin(metric):
        trial = object.__new__(type(metric))  # copy.copy without its pickling protocol
        trial.__dict__.update(metric.__dict__)
        trial.reset()
        return trial
    return copy.deepcopy(metric)


def trial_update(metric: Any, pred: Any, label: Any, device: torch.device) -> Any | None:
    """Try ``metric`` on the first batch, its running state left alone, raising what the update raises.
    Returns the updated copy whose value :func:`check_trial_value` is to check, or None: for a built-in
    (one number by construction), or a metric that cannot be copied (left to its first real update)."""
    if is_builtin(metric) and type(metric).batch_stats is not SumCountMetric.batch_stats:
        if takes_batch(metric, pred, label):  # its shapes, dtypes and devices say so: no torch call
            return None
        # On a reset copy: what the metric checks on its first batch (Accuracy's kind of labels) is
        # kept from the last run until a reset, and this batch may be another run's (the validation's).
        trial_copy(metric).batch_stats(pred.detach() if isinstance(pred, torch.Tensor) else pred, label)
        return None
    try:
        trial = trial_copy(metric)
    except Exception:
        return None
    trial.to(device)
    trial.update(pred, label)
    return trial


def check_trial_value(slot: MetricSlot, trial: Any) -> None:
    """The value of ``trial`` (a copy of the slot's metric, updated once) must be one number."""
    describe = f"metric {slot.name!r} ({type(slot.metric).__name__})"
    try:  # the class's compute: a torchmetrics metric's instance compute would sync across ranks
        value = type(trial).compute(trial) if hasattr(trial, "sync_context") else trial.compute()
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError):
        return  # some metrics need more than a batch (an AUC of one class so far): epoch end decides
    one_number(describe, value)


def one_number(describe: str, value: Any) -> None:
    """A clear error when a metric's ``value`` is not one number (by its shape: no host read)."""
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return
    what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    hint = (
        "give a MetricCollection's metrics as a dict {name: metric}"
        if isinstance(value, dict)
        else "reduce it in the metric (torchmetrics: average='macro' or 'micro' rather than average=None; "
        "a confusion matrix has no single value: compute it after fit from predict's outputs)"
    )
    raise FitforgeValueError(
        f"{describe} computes {what}, not one number, and the History holds one value per metric and epoch: {hint}"
    )
