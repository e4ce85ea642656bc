"""MetricHandler: accumulates the loss mean and the metrics on the device, publishes floats at epoch end."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fitforge.core.batches import shape_of
from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, Stage
from fitforge.core.roles import KeyRecording
from fitforge.core.services import Services, Undoable
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeValueError
from fitforge.losses.loss import part_keys
from fitforge.metrics import Mean, MetricSlot, check_output_indices, resolve_metrics
from fitforge.metrics.base import SumCountMetric, load_metric_state, merge_metric_state, metric_state
from fitforge.metrics.builtin import is_builtin
from fitforge.metrics.named import NamedMeans, declared_names
from fitforge.metrics.reduction import own_share, rank_states, reduced_sums, several_ranks
from fitforge.metrics.trial import check_trial_value, one_number, trial_update

log = logging.getLogger("fitforge")

_PREFIX = {"train": "train_", "validate": "val_"}
_BY_POSITION = (tuple, list)  # outputs and labels that metrics pick from by index
_BY_NAME = (tuple, list, Mapping)  # ... and by name, for named outputs (a dict loss)


def key_prefix(state: TrainState) -> str:
    """``train_`` in fit, ``val_`` in evaluate, or ``<prefix>_`` for ``evaluate(prefix=...)``."""
    return f"{state.prefix}_" if state.prefix else _PREFIX.get(state.phase, state.phase + "_")


def _run_of(state: TrainState) -> tuple:
    """What the handler's set-up depends on: the estimator, the phase and the keys' prefix."""
    return (id(state.estimator), state.phase, state.prefix)


class MetricHandler(EpochBegin, BatchEnd, EpochEnd, KeyRecording):
    """Record ``<prefix>loss`` (sample mean), one mean per loss when there are several (``<prefix>loss_<i>``,
    ``<prefix><output>_loss``), ``<prefix><metric>`` per metric and ``<prefix><name>`` per ``state.log`` name
    (``train_`` in fit, ``val_`` in evaluate, ``test_`` for ``evaluate(data, prefix="test")``); updates stay on the
    device, values reach the host at epoch end (or at ``state.running_metrics()``).

    Args:
        metrics: a metric specification (see ``fitforge.metrics``); None uses the estimator's ``train_metrics`` in
            fit and ``val_metrics`` in evaluate.
    """

    priority = Stage.METRICS
    reads = ("estimator", "phase", "prefix", "output", "batch_idx", "services")  # its running values, the logged
    writes = ("metrics", "history")

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self._resolved: list[MetricSlot] | None = None
        self._open = False  # between this handler's epoch_begin and epoch_end
        self._configured_for: tuple | None = None
        self._pending: list[dict] | None = None  # running sums from a checkpoint (one per rank to merge)
        self._inbox: list = []  # the state's pending named values (state.services.logged), from epoch_begin on
        self._epochs = 0  # epochs begun: a mark of another epoch's sums rewinds to none

    def _slots(self, estimator, phase: str) -> list[MetricSlot]:
        if self.metrics is None:
            return estimator.val_metrics if phase == "validate" else estimator.train_metrics
        if self._resolved is None:  # resolved once: the same metric objects in every fit
            self._resolved = resolve_metrics(self.metrics, estimator.loss, argument="MetricHandler(metrics=...)")
        check_output_indices(self._resolved, estimator.losses.of(phase).keys, "MetricHandler(metrics=...)")
        return self._resolved

    def history_keys(self, estimator, phase: str) -> list[str]:
        """The keys this handler produces for ``estimator`` in ``phase``, the declared ``logs`` names included."""
        prefix = _PREFIX.get(phase, phase + "_")
        named = self._named_means(estimator, phase, prefix)
        # A step that leaves its loss out (BatchProcessor.record_loss = False) records no loss names.
        unrecorded = (
            () if estimator.batch_processor.record_loss else ("loss", *part_keys(estimator.losses.of(phase).keys))
        )
        reserved = [name for name in named.reserved if name not in unrecorded]
        return [prefix + name for name in [*reserved, *(n for n in named.means if n not in named.reserved)]]

    def _named_means(self, estimator, phase: str, prefix: str) -> NamedMeans:
        """Fresh means for the declared names; the loss's and the metrics' names are reserved."""
        reserved = {"loss": "the loss mean"}
        reserved.update({key: f"the mean of a loss ({key})" for key in part_keys(estimator.losses.of(phase).keys)})
        reserved.update({s.name: f"the metric {s.name!r}" for s in self._slots(estimator, phase)})
        return NamedMeans(prefix, declared_names(estimator.batch_processor), reserved)

    def _configure(self, state: TrainState) -> None:
        estimator = state.estimator
        slots = self._slots(estimator, state.phase)
        self.prefix = key_prefix(state)
        self.slots = list(slots)  # this handler's: a default metric left out later goes from both lists
        for slot in slots:
            slot.metric.to(estimator.device)
        self._loss = Mean()
        outputs = estimator.losses.of(state.phase).keys
        self._records_loss = estimator.batch_processor.record_loss
        self._part_keys = part_keys(outputs) if self._records_loss else ()
        self._parts = [Mean() for _ in self._part_keys]
        self._several = _BY_NAME if any(isinstance(key, str) for key in outputs) else _BY_POSITION
        self._named = self._named_means(estimator, state.phase, self.prefix)
        self._device = estimator.device
        self._configured_for = _run_of(state)

    def _reset(self) -> None:
        self._loss.reset()
        for mean in self._parts:
            mean.reset()
        for slot in self.slots:
            slot.metric.reset()
        self._named.reset()

    def epoch_begin(self, state: TrainState) -> None:
        if self._configured_for != _run_of(state):
            self._configure(state)
        self._reset()
        self._epochs += 1
        if self._pending is not None:
            if state.batch_idx >= 0:  # at epoch_begin: a resume continues this epoch, and its sums
                self._resume(self._pending, state.estimator.device)
            self._pending = None
        if self.compute not in state.services.running_values:
            state.services.running_values.append(self.compute)
        inbox = self._inbox = state.services.logged  # state.log keeps values from now on, for this handler to take
        inbox.collected = True
        if inbox:  # logged before this epoch's sums were open (an earlier epoch_begin hook, a late epoch_end one)
            self._named.take(inbox, self._device)
        self._open = True

    def batch_end(self, state: TrainState) -> None:
        if self._inbox:  # the one check the named values cost a batch that logs none
            self._named.take(self._inbox, self._device)
        out: Any = state.output
        if self._records_loss:
            self._loss.update(out.loss, out.batch_size)
        if self._parts:
            for mean, part in zip(self._parts, out.losses):
                mean.update(part, out.batch_size)
        several = self._several
        pick_pred, pick_label = isinstance(out.pred, several), isinstance(out.label, several)
        for slot in self.slots:
            pred = out.pred[slot.output] if pick_pred else out.pred
            label = out.label[slot.output] if pick_label else out.label
            try:
                slot.metric.update(pred, label)
            except _UPDATE_ERRORS as err:
                # first: no update yet this epoch (a default metric is a built-in, whose sum is None then)
                first = isinstance(slot.metric, SumCountMetric) and slot.metric._sum is None
                self._cannot_update(state, slot, pred, label, err, first)

    def check_first_batch(self, state: TrainState) -> None:
        """Update throw-away copies of the metrics with the first batch's output, so that a metric that cannot take
        it, or gives no single number, fails before the optimizer step with ``batch_end``'s message."""
        estimator, out = state.estimator, state.output
        assert out is not None  # the first batch's output, set before this call
        configured = self._configured_for == _run_of(state)
        named = self._named if configured else self._named_means(estimator, state.phase, key_prefix(state))
        named.check(state.services.logged)
        slots = self._slots(estimator, state.phase)
        several = _BY_NAME if any(isinstance(slot.output, str) for slot in slots) else _BY_POSITION
        pick_pred, pick_label = isinstance(out.pred, several), isinstance(out.label, several)
        for slot in list(slots):
            pred = _picked(out.pred, slot, "the net's output") if pick_pred else out.pred
            label = _picked(out.label, slot, "the label") if pick_label else out.label
            try:
                trial = trial_update(slot.metric, pred, label, estimator.device)
            except _UPDATE_ERRORS as err:
                self._cannot_update(state, slot, pred, label, err, first=True)
                continue
            if trial is not None:  # else its first value would fail at epoch end, after a whole epoch
                check_trial_value(slot, trial)

    def _cannot_update(
        self, state: TrainState, slot: MetricSlot, pred: Any, label: Any, err: Exception, first: bool
    ) -> None:
        """A metric failed on a batch: a default one is left out if the label cannot feed it (none, or the first
        batch's cannot); otherwise raise, naming a missing label if that is the cause."""
        if not (slot.inferred and (label is None or first)):
            what = f"metric {slot.name!r} ({type(slot.metric).__name__})"
            if pred is None and state.estimator.loss is None:  # a net that returned its loss alone
                raise FitforgeValueError(
                    f"{what} reads the net's predictions, but with "
                    "loss=None the net returned its loss without 'logits', the item metrics read: return "
                    "{'loss': ..., 'logits': ...}, or name the item with BatchProcessor(output_key=...)"
                ) from err
            if label is None:
                train = state.phase == "train"
                argument = "train_metrics" if train else "val_metrics"
                raise FitforgeValueError(
                    f"{what} needs a label, but the step ({'fit_batch' if train else 'evaluate_batch'}) returned "
                    f"none (BatchOutput(label=None)) in batch {state.batch_idx}: give the batches a label (data alone, "
                    "a tensor or (x,), has none), return the label in the BatchOutput of a step of your own, or leave "
                    f"the metric out of {'MetricHandler(metrics=...)' if self.metrics is not None else argument}"
                ) from err
            raise FitforgeValueError(
                f"{what} failed on pred: {shape_of(pred)} and label: {shape_of(label)} in batch {state.batch_idx}: "
                f"{err}"
            ) from err
        estimator = state.estimator
        shared = self._slots(estimator, state.phase)
        shared[:] = [s for s in shared if s is not slot]
        if self._configured_for == _run_of(state):
            self.slots = [s for s in self.slots if s is not slot]  # batch_end's loop goes on over the old list
            self._named.reserved.pop(slot.name, None)
        log.info(
            "the default metric %r (%s, inferred from the loss) is left out of %s: %s",
            slot.name,
            type(slot.metric).__name__,
            "training" if state.phase == "train" else "validation",
            "the step returns no label (BatchOutput(label=None))"
            if label is None
            else f"it cannot take the label ({err}); ask for the metrics you want with "
            + ("train_metrics=..." if state.phase == "train" else "val_metrics=..."),
        )

    def state_dict(self) -> dict:
        """The running sums of the current (or last) epoch; under torch.distributed every rank's (a collective)."""
        if self._configured_for is None:
            return {}
        if self._open and self._inbox:  # values logged after this batch's batch_end belong to the sums
            self._named.take(self._inbox, self._device)
        return rank_states(
            {**self._sums(), "names": [slot.name for slot in self.slots]}, lambda own: _mapped(own, torch.Tensor.cpu)
        )

    def _sums(self) -> dict:
        return {
            "loss": self._loss.state_dict(),
            "parts": [mean.state_dict() for mean in self._parts],
            "metrics": [metric_state(slot.metric) for slot in self.slots],
            "named": self._named.state_dict(),
        }

    def offer(self, services: Services) -> None:
        """Its first-batch check; its running sums, set back with the weights when batches are undone."""
        services.first_batch_checks.append(self.check_first_batch)
        services.undoables.append(Undoable(self.mark_sums, self.rewind_sums))

    def mark_sums(self) -> Any:
        """A copy of the epoch's running sums (cloned on their device), for :meth:`rewind_sums`."""
        return {"epoch": self._epochs, **self._sums()}

    def rewind_sums(self, mark: Any) -> None:
        """Set the sums back to ``mark``; to those of no batch when it was taken in an earlier epoch (every batch
        of this one is undone). A metric whose state fitforge cannot read starts the epoch anew."""
        self._reset()
        if mark["epoch"] != self._epochs:
            return
        mark = _mapped(mark, torch.Tensor.clone)  # the mark may be rewound to again
        self._loss.load_state_dict(mark["loss"])
        for mean, saved in zip(self._parts, mark["parts"]):
            mean.load_state_dict(saved)
        for slot, saved in zip(self.slots, mark["metrics"]):
            if saved is not None:
                load_metric_state(slot.metric, saved)
        self._named.load([mark["named"]], self._device)

    def load_state_dict(self, state: dict) -> None:
        """Keep the sums for the next ``epoch_begin``, which resumes them if it continues an epoch."""
        self._pending = own_share(state)

    def _resume(self, saved: list[dict], device) -> None:
        means = [(self._loss, [ranks["loss"] for ranks in saved])]
        means += [(mean, [ranks["parts"][i] for ranks in saved]) for i, mean in enumerate(self._parts)]
        for mean, parts in means:
            mean.load_state_dict(parts[0])
            for extra in parts[1:]:
                merge_metric_state(mean, extra)
            mean.to(device)
        self._named.load([ranks.get("named", {}) for ranks in saved], device)
        names = saved[0].get("names")  # absent from checkpoints older than named values: by position
        for i, slot in enumerate(self.slots):
            index = i if names is None else names.index(slot.name) if slot.name in names else None
            if index is None:  # a default metric the saving run left out is left out again at the first batch
                if not slot.inferred:
                    log.warning(
                        "metric %r is not in the checkpoint: its value for the resumed epoch covers only the "
                        "batches after the resume",
                        slot.name,
                    )
                continue
            states = [rank_saved["metrics"][index] for rank_saved in saved]
            if any(state is None for state in states):
                log.warning(
                    "metric %r (%s) has no state fitforge can save: its value for the resumed epoch "
                    "covers only the batches after the resume",
                    slot.name,
                    type(slot.metric).__name__,
                )
                continue
            load_metric_state(slot.metric, states[0])
            try:
                for extra in states[1:]:
                    merge_metric_state(slot.metric, extra)
            except RuntimeError as err:
                log.warning(
                    "metric %r (%s) cannot merge the running states of %d ranks (%s): its value for the "
                    "resumed epoch misses the other ranks' batches before the resume",
                    slot.name,
                    type(slot.metric).__name__,
                    len(states),
                    err,
                )
            slot.metric.to(device)

    def compute(self) -> dict[str, float]:
        """The epoch-so-far values, keyed as in history (a host read). Under torch.distributed, this rank's own: a
        torchmetrics metric skips its cross-rank sync, a collective the ranks without this reader would never join."""
        if self._open and self._inbox:
            self._named.take(self._inbox, self._device)
        return self._values(local=several_ranks())

    def _values(self, local: bool) -> dict[str, float]:
        values = {self.prefix + "loss": self._loss.value()} if self._records_loss else {}
        for key, mean in zip(self._part_keys, self._parts):
            values[self.prefix + key] = mean.value()
        for slot in self.slots:
            metric = slot.metric
            if isinstance(metric, SumCountMetric) and is_builtin(metric):  # one number by construction
                values[self.prefix + slot.name] = metric.value()
                continue
            unsynced = local and hasattr(metric, "sync_context")  # torchmetrics: its class's compute skips the sync
            value = type(metric).compute(metric) if unsynced else metric.compute()
            one_number(f"metric {slot.name!r} ({type(metric).__name__})", value)
            values[self.prefix + slot.name] = float(value)
        values.update(self._named.values())
        return values

    def epoch_end(self, state: TrainState) -> None:
        if not self._open:  # epoch_begin was cancelled before reaching this handler: nothing to report
            return
        self._open = False
        if self._inbox:  # logged by handlers after this one's batch_end, or in an earlier epoch_end hook
            self._named.take(self._inbox, self._device)
        # Under torch.distributed every rank holds its share of the sums: totals over all ranks first.
        sums: list[SumCountMetric] = [*([self._loss] if self._records_loss else []), *self._parts]
        sums += self._named.in_order()
        sums += [s.metric for s in self.slots if isinstance(s.metric, SumCountMetric)]
        with reduced_sums(sums):
            values = self._values(local=False)
        state.metrics.update(values)
        if state.phase == "train":
            for key, value in values.items():
                state.history.record(key, value)


_UPDATE_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, AttributeError)


def _picked(value: Any, slot: MetricSlot, what: str) -> Any:
    """The item of ``value`` (several outputs or labels) that ``slot`` reads; a clear error if it has none."""
    try:
        return value[slot.output]
    except (KeyError, IndexError, TypeError):
        keys = ", ".join(map(repr, value)) if isinstance(value, Mapping) else f"{len(value)} item(s) by position"
        raise FitforgeValueError(
            f"metric {slot.name!r} ({type(slot.metric).__name__}) reads the item {slot.output!r} of {what}, which has "
            f"none: it holds {keys}; key the metrics by the outputs the net returns"
        ) from None


def _mapped(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in its dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _mapped(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(item, fn) for item in value)
    return value
