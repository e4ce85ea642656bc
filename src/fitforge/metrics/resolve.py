"""Turn a user's metric specification into named metric slots, and infer a default from the loss (the
specifications and the history names they give: docs/getting-started.md, "4. Metrics")."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.losses.loss import OutputKey, check_output_names, part_keys
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
    """A metric with its history name and the output it reads (a position, or a name); ``inferred``: a
    default chosen for the loss, which a run without a label it can take leaves out."""

    name: str
    metric: Metric
    output: OutputKey = 0
    inferred: bool = False

    @property
    def output_index(self) -> OutputKey:
        """``output``, under its name of releases before named outputs."""
        return self.output


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


def _flat(spec: Any, argument: str, output: OutputKey = 0, suffix: str = "", prefix: str = "") -> list[MetricSlot]:
    """The slots of one output's ``spec``; a metric given by kind (not named in a dict) also gets ``suffix``."""
    if isinstance(spec, dict):
        bad = [k for k in spec if not isinstance(k, str) or not k]
        if bad:
            raise FitforgeTypeError(f"{argument}: metric names in a dict must be non-empty strs, got keys {bad}")
        return [MetricSlot(prefix + name, _as_metric(m, argument), output) for name, m in spec.items()]
    metrics = [_as_metric(item, argument) for item in (spec if isinstance(spec, (list, tuple)) else [spec])]
    return [MetricSlot(prefix + metric_name(metric) + suffix, metric, output) for metric in metrics]


def _by_position(spec: dict, argument: str) -> list[MetricSlot]:
    """``{output_index: spec}``: a name the user chose in a dict stays as is unless several outputs use it."""
    slots = [
        (slot, isinstance(sub, dict))
        for index, sub in spec.items()
        for slot in _flat(sub, argument, index, f"_{index}")
    ]
    names = [slot.name for slot, chosen in slots if chosen]
    for slot, chosen in slots:
        if chosen and names.count(slot.name) > 1:  # the same name on several outputs: the index tells them apart
            slot.name = f"{slot.name}_{slot.output}"
    return [slot for slot, _ in slots]


def _by_name(spec: Any, loss: Mapping, argument: str) -> list[MetricSlot]:
    """Slots for named outputs (``loss`` a dict): ``spec`` a dict by output name, None for defaults."""
    outputs = list(loss)
    if spec is None:
        return [
            MetricSlot(f"{key}_{metric_name(m)}", m, key, inferred=True)
            for key in outputs
            for m in default_metrics(loss[key])
        ]
    example = f"{{{outputs[0] if outputs else 'cls'!r}: ['accuracy']}}"
    if not isinstance(spec, dict):
        if isinstance(spec, (list, tuple)) and not spec:
            return []
        raise FitforgeTypeError(
            f"{argument} must be a dict by output name, as loss is (its outputs: {', '.join(map(repr, outputs))}), "
            f"got {describe(spec)}; e.g. {argument}={example}"
        )
    check_output_names(spec, outputs, argument, f"key the metrics by those names, e.g. {argument}={example}")
    return [slot for key, sub in spec.items() for slot in _flat(sub, argument, key, prefix=f"{key}_")]


def resolve_metrics(spec: Any, loss: Any, argument: str = "train_metrics") -> list[MetricSlot]:
    """Named metric slots for ``spec`` (the forms: docs/getting-started.md §4); names must be unique."""
    first_loss = loss[0] if isinstance(loss, (list, tuple)) and loss else loss
    if isinstance(loss, Mapping):
        slots = _by_name(spec, loss, argument)
    elif spec is None:
        slots = [MetricSlot(metric_name(m), m, inferred=True) for m in default_metrics(first_loss)]
    elif isinstance(spec, dict) and spec and all(isinstance(k, int) for k in spec):
        slots = _by_position(spec, argument)
    else:
        if isinstance(spec, dict) and not all(isinstance(k, str) for k in spec):
            raise FitforgeTypeError(
                f"{argument} dict keys must be all metric names (str) or all output indices (int), "
                f"got keys {list(spec)}"
            )
        slots = _flat(spec, argument)
    names = [slot.name for slot in slots]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise FitforgeValueError(
            f"{argument} has several metrics named {duplicates}; name them with a dict, "
            "e.g. {'acc_macro': m1, 'acc_micro': m2}"
        )
    return slots


def check_output_indices(slots: list[MetricSlot], outputs: int | Sequence[OutputKey], argument: str) -> None:
    """Every slot must read an output the loss reads, and no metric may take the history name of a loss."""
    keys = tuple(range(outputs)) if isinstance(outputs, int) else tuple(outputs)
    losses = {"loss", *part_keys(keys)}
    for slot in slots:
        if slot.output not in keys and isinstance(slot.output, str):
            raise FitforgeValueError(
                f"{argument}: metric {slot.name!r} reads the output {slot.output!r}, which the loss does not "
                f"name: its outputs are {', '.join(map(repr, keys))}"
            )
        if slot.output not in keys:
            raise FitforgeValueError(
                f"{argument}: metric {slot.name!r} reads output {slot.output}, but the model has "
                f"{len(keys)} output(s) (one per loss); use output indices 0 to {len(keys) - 1}"
            )
        if slot.name in losses:
            raise FitforgeValueError(
                f"{argument}: the metric name {slot.name!r} is the history name of a loss; name the metric "
                f"otherwise, e.g. {slot.name + '_metric'!r}"
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
    return [MetricSlot(s.name, copy.deepcopy(s.metric), s.output, s.inferred) for s in slots]
