"""Turn a user's metric specification into named metric slots, and infer a default from the loss.

Specifications: None (a default for the loss), a name (``"accuracy"``, ``"top5_accuracy"``,
``"binary_accuracy"``, ``"mse"``, ``"rmse"``, ``"mae"``), a metric object (built-in or any
torchmetrics ``Metric``), a list of those, a dict ``{name: metric}`` to choose the history names,
or a dict ``{output_index: spec}`` for multi-output nets (names then end in ``_<index>``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.metrics.base import Metric
from fitforge.metrics.builtin import (
    Accuracy,
    BinaryAccuracy,
    MeanAbsoluteError,
    MeanSquaredError,
    RootMeanSquaredError,
    TopKAccuracy,
)

NAMES = {
    "accuracy": Accuracy,
    "acc": Accuracy,
    "binary_accuracy": BinaryAccuracy,
    "mse": MeanSquaredError,
    "rmse": RootMeanSquaredError,
    "mae": MeanAbsoluteError,
}
_TOPK = re.compile(r"top(\d+)_acc(uracy)?")


@dataclass
class MetricSlot:
    """A metric with the name its values get in history and the output/label it reads.

    ``inferred``: a default chosen for the loss, not asked for; a run whose step returns no label (or
    one it cannot take) leaves it out instead of failing (see :class:`~fitforge.handlers.MetricHandler`).
    """

    name: str
    metric: Metric
    output_index: int = 0
    inferred: bool = False


def metric_from_name(name: str) -> Metric:
    """A new built-in metric for ``name``; raise listing the known names otherwise."""
    key = name.lower()
    if key in NAMES:
        return NAMES[key]()
    match = _TOPK.fullmatch(key)
    if match:
        return TopKAccuracy(int(match.group(1)))
    known = ", ".join(sorted(NAMES)) + ", top<k>_accuracy"
    raise FitforgeValueError(f"unknown metric name {name!r}; known names: {known}")


def default_metrics(loss: Any) -> list[Metric]:
    """The metric a beginner expects for ``loss`` (the loss mean itself is always recorded)."""
    if isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)):
        # Labels the loss ignores (padding, torch's default -100) are left out of the accuracy too.
        return [Accuracy(ignore_index=loss.ignore_index)]
    if isinstance(loss, nn.BCEWithLogitsLoss):
        return [BinaryAccuracy(logits=True)]
    if isinstance(loss, nn.BCELoss):
        return [BinaryAccuracy()]
    if isinstance(loss, nn.MSELoss):
        return [MeanAbsoluteError()]
    return []


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def metric_name(metric: Metric) -> str:
    """The history name of a metric object: its ``name`` attribute if a string, else its class."""
    name = getattr(metric, "name", None)
    return name if isinstance(name, str) and name else _snake(type(metric).__name__)


def _as_metric(spec: Any, argument: str) -> Metric:
    if isinstance(spec, str):
        return metric_from_name(spec)
    if isinstance(spec, type):
        raise FitforgeTypeError(f"{argument} got {describe(spec)}; pass an instance: {spec.__name__}()")
    if not isinstance(spec, Metric):
        raise FitforgeTypeError(
            f"{argument} got {describe(spec)}; a metric is a name such as 'accuracy' or an object with "
            "update(pred, label), compute(), reset() and to(device), e.g. a torchmetrics Metric"
        )
    return spec


def _flat(spec: Any, argument: str, index: int | None) -> list[MetricSlot]:
    suffix = "" if index is None else f"_{index}"
    if isinstance(spec, dict):
        return [MetricSlot(f"{name}{suffix}", _as_metric(m, argument), index or 0) for name, m in spec.items()]
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    slots = []
    for item in items:
        metric = _as_metric(item, argument)
        slots.append(MetricSlot(metric_name(metric) + suffix, metric, index or 0))
    return slots


def resolve_metrics(spec: Any, loss: Any, argument: str = "train_metrics") -> list[MetricSlot]:
    """Named metric slots for ``spec`` (see the module docstring); names must be unique."""
    first_loss = loss[0] if isinstance(loss, (list, tuple)) and loss else loss
    if spec is None:
        slots = [MetricSlot(metric_name(m), m, inferred=True) for m in default_metrics(first_loss)]
    elif isinstance(spec, dict) and spec and all(isinstance(k, int) for k in spec):
        slots = [slot for index, sub in spec.items() for slot in _flat(sub, argument, index)]
    else:
        if isinstance(spec, dict) and not all(isinstance(k, str) for k in spec):
            raise FitforgeTypeError(
                f"{argument} dict keys must be all metric names (str) or all output indices (int), "
                f"got keys {list(spec)}"
            )
        slots = _flat(spec, argument, None)
    names = [slot.name for slot in slots]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise FitforgeValueError(
            f"{argument} has several metrics named {duplicates}; name them with a dict, "
            "e.g. {'acc_macro': m1, 'acc_micro': m2}"
        )
    return slots


def check_output_indices(slots: list[MetricSlot], outputs: int, argument: str) -> None:
    """Every slot must read an output the net has (one per loss)."""
    for slot in slots:
        if slot.output_index >= outputs:
            raise FitforgeValueError(
                f"{argument}: metric {slot.name!r} reads output {slot.output_index}, but the model has "
                f"{outputs} output(s) (one per loss); use output indices 0 to {outputs - 1}"
            )


def check_independent(train: list[MetricSlot], val: list[MetricSlot]) -> None:
    """One metric object cannot accumulate both training and validation values."""
    shared = [s.name for s in val if any(s.metric is t.metric for t in train)]
    if shared:
        raise FitforgeValueError(
            f"val_metrics and train_metrics share the metric object(s) {shared}; one object cannot count both: "
            "pass separate instances, or leave val_metrics=None to get copies of the training metrics"
        )


def copy_slots(slots: list[MetricSlot]) -> list[MetricSlot]:
    """Independent copies (fresh objects) of ``slots``, e.g. validation metrics from training ones."""
    return [MetricSlot(s.name, copy.deepcopy(s.metric), s.output_index, s.inferred) for s in slots]
