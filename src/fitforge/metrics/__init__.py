"""Metrics: the protocol, built-in on-device metrics and name resolution."""

from fitforge.metrics.base import Metric, SumCountMetric
from fitforge.metrics.builtin import (
    Accuracy,
    BinaryAccuracy,
    Mean,
    MeanAbsoluteError,
    MeanSquaredError,
    RootMeanSquaredError,
    TopKAccuracy,
)
from fitforge.metrics.resolve import (
    MetricSlot,
    check_output_indices,
    default_metrics,
    metric_from_name,
    metric_name,
    resolve_metrics,
)

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "MetricSlot",
    "RootMeanSquaredError",
    "SumCountMetric",
    "TopKAccuracy",
    "check_output_indices",
    "default_metrics",
    "metric_from_name",
    "metric_name",
    "resolve_metrics",
]
