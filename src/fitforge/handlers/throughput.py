"""ThroughputHandler: samples (and tokens) per second of each training epoch, FLOP/s and MFU."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from fitforge.core.events import (
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    Event,
    Stage,
    TrainBegin,
    TrainEnd,
)
from fitforge.core.roles import KeyRecording
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeValueError, check_flag, describe
from fitforge.metrics.base import Tally
from fitforge.metrics.reduction import reduced_sums
from fitforge.reporting.peak_flops import peak_flops, precision_of

log = logging.getLogger("fitforge")


class ThroughputHandler(TrainBegin, EpochBegin, BatchBegin, BackwardEnd, BatchEnd, EpochEnd, TrainEnd, KeyRecording):
    """Record each training epoch's ``train_samples_per_s``, and ``train_tokens_per_s`` where the batches hold
    tokens; with ``flops``, ``train_flops_per_s`` and ``train_mfu`` (docs/output.md, Throughput).

    Args:
        flops: count the FLOPs of a step (FLOP/s, and MFU where the peak is known).
        peak_flops: the dense peak of one device in FLOP/s (e.g. ``989e12``), instead of the table's.
    """

    priority = Stage.METRICS
    run_after = (KeyRecording,)  # after MetricHandler's read at epoch end; validation runs after it
    reads = ("estimator", "phase", "output", "history", "run")
    writes = ("history",)

    def __init__(self, flops: bool = True, peak_flops: float | None = None) -> None:
        check_flag("ThroughputHandler", "flops", flops)
        if peak_flops is not None and (
            isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or not peak_flops > 0
        ):
            raise FitforgeValueError(
                f"ThroughputHandler: peak_flops is a device's peak in FLOP/s (e.g. 989e12), got {describe(peak_flops)}"
            )
        if peak_flops is not None and not flops:
            raise FitforgeValueError("ThroughputHandler: peak_flops gives MFU, which needs flops=True")
        self.flops, self.peak_flops = flops, peak_flops
        events = [Event.EPOCH_BEGIN, Event.BATCH_END, Event.EPOCH_END]
        if flops:  # the first batch's step is counted between its batch_begin and its backward_end
            events += [Event.TRAIN_BEGIN, Event.BATCH_BEGIN, Event.BACKWARD_END, Event.TRAIN_END]
        self.handled_events = tuple(events)
        self._tally, self._batches = Tally(), 0  # the epoch's samples (and tokens), and its batches here
        self._started = 0.0
        self._counter: FlopCounterMode | None = None
        self.step_flops: int | None = None  # FLOPs of one training step, once counted
        self.samples = 0  # the last epoch's samples, every rank's
        self._peak: float | None = None

    def history_keys(self, estimator: Any, phase: str) -> list[str]:
        """``train_samples_per_s`` (and the FLOP keys when counted); tokens show once batches hold some."""
        if phase != "train":
            return []
        keys = ["train_samples_per_s"]
        if self.flops:
            keys.append("train_flops_per_s")
            if (self.peak_flops or peak_flops(estimator.device, _maths_dtype(estimator))) is not None:
                keys.append("train_mfu")
        return keys

    def train_begin(self, state: TrainState) -> None:
        estimator = state.estimator
        self.step_flops = None
        dtype = _maths_dtype(estimator)
        self._peak = self.peak_flops or peak_flops(estimator.device, dtype)
        if self._peak is None:
            log.info(
                "ThroughputHandler: the peak FLOP/s of %s in %s is not known, so train_mfu is left out; give "
                "ThroughputHandler(peak_flops=...) for it",
                estimator.device,
                precision_of(dtype),
            )

    def epoch_begin(self, state: TrainState) -> None:
        self._tally.reset()
        self._batches = 0
        self._started = time.perf_counter()

    def batch_begin(self, state: TrainState) -> None:
        if self.step_flops is None and state.phase == "train":
            if self._counter is not None:  # the batch counted was cancelled before its backward: count anew
                self._counter.__exit__(None, None, None)
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def _stop_counting(self, state: TrainState | None = None) -> None:
        """The first batch's FLOPs counted: at its backward, or at the epoch's or the fit's end if it ended first."""
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.step_flops = counter.get_total_flops()

    backward_end = train_end = _stop_counting  # a fit that ended inside its first step leaves no counter behind

    def batch_end(self, state: TrainState) -> None:
        out: Any = state.output
        self._tally.add(out.batch_size, _tokens(out.data) if type(out.data) is dict else None)  # a dict may hold tokens
        self._batches += 1

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train":
            return
        self._stop_counting()  # a first batch cancelled before its backward
        device = state.estimator.device
        if device.type == "cuda":  # the epoch ends when the device is through with its batches
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - self._started
        local_batches, every_rank = self._batches, Tally()
        every_rank.add(local_batches)
        self._tally.fold(device)
        with reduced_sums([self._tally, every_rank]):
            samples, tokens, batches = self._tally.count, self._tally.total(), every_rank.count
        if state.run.ranks.several:  # the job's time is its slowest rank's: every rank records the same figures
            slowest = torch.tensor(seconds, dtype=torch.float64, device=state.estimator.device)
            state.run.ranks.max_(slowest)
            seconds = float(slowest)
        self.samples = samples
        if seconds <= 0 or not samples:
            return
        values = {"train_samples_per_s": samples / seconds}
        if self._tally.totalled:
            values["train_tokens_per_s"] = tokens / seconds
        if self.step_flops is not None:
            values["train_flops_per_s"] = self.step_flops * batches / seconds
            if self._peak is not None:  # one device's FLOP/s over its peak
                values["train_mfu"] = self.step_flops * local_batches / seconds / self._peak
        for key, value in values.items():
            state.history.record(key, value)

    def __repr__(self) -> str:
        return f"ThroughputHandler(flops={self.flops}, peak_flops={self.peak_flops})"


def _maths_dtype(estimator: Any) -> torch.dtype | None:
    """The dtype the net computes in: the autocast dtype, else its parameters' (a net cast to bfloat16)."""
    if estimator.autocast_dtype is not None:
        return estimator.autocast_dtype
    first = next(estimator.net.parameters(), None)
    return None if first is None or first.dtype == torch.float32 else first.dtype


def _tokens(inputs: Mapping[str, Any]) -> torch.Tensor | int | None:
    """A dict batch's tokens: the non-padding ones of its attention mask (summed on the device), else every token of
    integer ``input_ids`` (counted from the shape); None for a batch of no tokens."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.sum(dtype=torch.int64)  # a float mask counts alike
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        return ids.numel()
    return None
