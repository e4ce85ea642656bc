"""Metrics: the protocol, built-in on-device metrics and name resolution."""

from .base import Metric, SumCountMetric
from .builtin import (
    Accuracy,
    BinaryAccuracy,
    Mean,
    MeanAbsoluteError,
    MeanSquaredError,
    RootMeanSquaredError,
    TopKAccuracy,
)
from .resolve import MetricSlot, check_output_indices, default_metrics, metric_from_name, metric_name, resolve_metrics

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
