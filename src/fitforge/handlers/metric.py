"""MetricHandler: accumulates the loss mean and the metrics on the device, publishes floats at epoch end."""

from __future__ import annotations

from typing import Any

from ..events import BatchEnd, EpochBegin, EpochEnd
from ..exceptions import FitforgeValueError
from ..metrics import Mean, resolve_metrics
from ..state import TrainState

_PREFIX = {"train": "train_", "validate": "val_"}


class MetricHandler(EpochBegin, BatchEnd, EpochEnd):
    """Record ``<prefix>loss`` (sample mean), one mean per loss when there are several
    (``<prefix>loss_<i>``), and ``<prefix><metric name>`` for every metric.

    Updates stay on the device; values reach the host at epoch end (or when a handler calls
    ``state.running_metrics()``). The prefix is ``train_`` in fit and ``val_`` in evaluate.

    Args:
        metrics: a metric specification (see ``fitforge.metrics``); None uses the estimator's
            ``train_metrics`` in fit and ``val_metrics`` in evaluate.
    """

    priority = -1000

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self._configured_for: tuple | None = None

    def _configure(self, state: TrainState) -> None:
        estimator = state.estimator
        if self.metrics is not None:
            slots = resolve_metrics(self.metrics, estimator.loss, argument="MetricHandler(metrics=...)")
        else:
            slots = estimator.val_metrics if state.phase == "validate" else estimator.train_metrics
        self.prefix = _PREFIX.get(state.phase, state.phase + "_")
        self.slots = slots
        for slot in slots:
            slot.metric.to(estimator.device)
        self._loss = Mean()
        self._parts = [Mean() for _ in range(estimator.loss_count)] if estimator.loss_count > 1 else []
        self._configured_for = (id(estimator), state.phase)

    def epoch_begin(self, state: TrainState) -> None:
        if self._configured_for != (id(state.estimator), state.phase):
            self._configure(state)
        self._loss.reset()
        for mean in self._parts:
            mean.reset()
        for slot in self.slots:
            slot.metric.reset()
        if self.compute not in state.metric_sources:
            state.metric_sources.append(self.compute)

    def batch_end(self, state: TrainState) -> None:
        out = state.output
        self._loss.update(out.loss, out.batch_size)
        for mean, part in zip(self._parts, out.losses):
            mean.update(part, out.batch_size)
        multi = isinstance(out.pred, tuple)
        for slot in self.slots:
            pred = out.pred[slot.output_index] if multi else out.pred
            label = out.label[slot.output_index] if isinstance(out.label, tuple) else out.label
            try:
                slot.metric.update(pred, label)
            except (RuntimeError, ValueError, TypeError, IndexError) as err:
                raise FitforgeValueError(
                    f"metric {slot.name!r} ({type(slot.metric).__name__}) failed on pred of shape "
                    f"{tuple(pred.shape)} and label of shape {tuple(label.shape)} in batch {state.batch_idx}: "
                    f"{err}"
                ) from err

    def compute(self) -> dict[str, float]:
        """The epoch-so-far values, keyed as in history (reads device values to the host)."""
        values = {self.prefix + "loss": float(self._loss.compute())}
        for i, mean in enumerate(self._parts):
            values[f"{self.prefix}loss_{i}"] = float(mean.compute())
        for slot in self.slots:
            values[self.prefix + slot.name] = float(slot.metric.compute())
        return values

    def epoch_end(self, state: TrainState) -> None:
        values = self.compute()
        state.metrics.update(values)
        if state.phase == "train":
            for key, value in values.items():
                state.history.record(key, value)
