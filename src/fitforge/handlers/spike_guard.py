"""SpikeGuardHandler: recover from a loss spike by going back to the last good weights."""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from typing import Any

import torch

from fitforge.core.clock import history_key
from fitforge.core.events import BackwardEnd, EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.roles import KeyRecording
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import CancelBatch, FitforgeTypeError, FitforgeValueError, check_positive, describe

log = logging.getLogger("fitforge")
_NONE = 2**62  # "no spike since the last check"
KEY = "spike_recoveries"  # the history key: recoveries in each epoch


class LossSpikeError(FitforgeValueError):
    """The training loss spiked more often than ``SpikeGuardHandler(max_recoveries=...)`` allows."""


class SpikeGuardHandler(TrainBegin, BackwardEnd, EpochEnd, TrainEnd, KeyRecording):
    """Recover from a loss spike (a loss not finite, or above ``factor`` times the running median): go back to the
    last good weights, skip the bad batch, optionally lower the learning rate, and go on (docs/handlers.md).

    Args:
        factor: how many times the running median a loss must exceed to spike.
        window: how many recent losses the median is taken over.
        snapshot_every: optimizer steps between snapshots (taken at checks without a spike).
        check_every: batches between two reads of the decision (1: every batch, a host read each).
        lr_factor: multiply the learning rates by this at each recovery (None: leave them).
        max_recoveries: recoveries allowed in a run; the next spike raises.
    """

    priority = Stage.GUARD  # after NaNGuardHandler's verdict (it writes services.step_skips), before the step
    reads = (
        "phase",
        "output",
        "epoch",
        "batch_idx",
        "global_step",
        "optimizer_steps",
        "estimator",
        "history",
        "services",
        "run",
    )
    writes = ("accumulated_batches", "history")

    def __init__(
        self,
        factor: float = 4.0,
        window: int = 32,
        snapshot_every: int = 32,
        check_every: int = 8,
        lr_factor: float | None = None,
        max_recoveries: int = 5,
    ) -> None:
        check_positive("SpikeGuardHandler", "factor", factor, (int, float))
        check_positive("SpikeGuardHandler", "window", window)
        check_positive("SpikeGuardHandler", "snapshot_every", snapshot_every)
        check_positive("SpikeGuardHandler", "check_every", check_every)
        check_positive("SpikeGuardHandler", "lr_factor", lr_factor, (int, float), allow_none=True)
        if not isinstance(max_recoveries, int) or isinstance(max_recoveries, bool) or max_recoveries < 0:
            raise FitforgeTypeError(
                f"SpikeGuardHandler: max_recoveries must be an int >= 0, got {describe(max_recoveries)}"
            )
        if factor <= 1:
            raise FitforgeValueError(f"SpikeGuardHandler: factor must be above 1 (times the median), got {factor}")
        self.factor, self.window, self.snapshot_every = float(factor), window, snapshot_every
        self.check_every, self.lr_factor, self.max_recoveries = check_every, lr_factor, max_recoveries
        self.recoveries: list[tuple[int, int]] = []  # (epoch, batch), from 1, of each recovery's spiked batch
        self._epoch_recoveries = 0
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_step = 0
        self._batches = 0

    def history_keys(self, estimator: Any, phase: str) -> list[str]:
        return [KEY, history_key("rollback")] if phase == "train" else []  # recoveries, and their seconds

    def train_begin(self, state: TrainState) -> None:
        device = state.estimator.device
        self._losses = torch.zeros(self.window, device=device)  # recent losses that did not spike
        self._known = 0  # how many of them are real (the window fills first)
        self._first = torch.full((), _NONE, dtype=torch.int64, device=device)  # first spiked batch since the check
        self._recent: deque[tuple[int, int, int]] = deque(maxlen=2 * self.check_every)  # batch -> (epoch, batch)
        self.recoveries, self._epoch_recoveries, self._batches = [], 0, 0
        self._snapshot, self._snapshot_step = None, 0
        self._saved_at: tuple[int, int, int] | None = None  # the batch whose state a save made the snapshot

    def backward_end(self, state: TrainState) -> None:
        if state.phase != "train" or state.output is None or state.output.loss is None:
            return
        if self._snapshot is None:  # the state the run starts from (a resumed one's too): good by definition
            self._take_snapshot(state)
        loss = state.output.loss.detach().float()
        spiked = ~torch.isfinite(loss)
        if self._judges(self._known):  # a median at or below 0 (a loss that can be negative) judges nothing
            median = self._losses[: min(self._known, self.window)].median()
            spiked = spiked | ((median > 0) & (loss > self.factor * median))
        position = self._known % self.window
        kept = self._losses[(position - 1) % self.window] if self._known else loss.new_zeros(())
        self._losses[position] = torch.where(spiked, kept, loss)  # a spike leaves the window: the last good loss again
        self._known += 1
        self._recent.append((self._batches, state.epoch + 1, state.batch_idx + 1))
        this = torch.full_like(self._first, self._batches)  # a count of this fit's batches: cancelled ones too
        self._first = torch.where(spiked, torch.minimum(self._first, this), self._first)
        self._batches += 1
        if self._batches % self.check_every == 0 and self._check(state):
            raise CancelBatch  # the spiked state was put back: this batch takes no step either

    def _judges(self, known: int) -> bool:  # enough losses are known to judge one against their median
        return known >= max(1, self.window // 2)

    def offer(self, services: Services) -> None:
        services.before_save.append(self.confirm_state)

    def confirm_state(self, state: TrainState) -> None:
        """Before a checkpoint: check now, so that a spiked state is never saved; a good one becomes the snapshot,
        as a resume from this checkpoint takes it (with the same losses, the saved ones): a resume is exact."""
        where = (state.epoch, state.batch_idx, state.optimizer_steps)
        fresh = state.phase == "train" and self._snapshot is not None and where != self._saved_at  # once a state
        if fresh and not self._check(state, saving=True):
            self._saved_at = where

    def _check(self, state: TrainState, saving: bool = False) -> bool:
        """Read the decision (every rank agrees on the earliest spike): recover (True) or snapshot a good state."""
        first = state.run.ranks.min_int(int(self._first))
        self._first.fill_(_NONE)
        if first == _NONE:
            # Only a state the median could judge is a good one (the first batch's and a save's aside: a resume
            # starts from those). The first such state replaces the start's without waiting snapshot_every: an
            # early spike (the loss falls fastest then) would otherwise undo all the training so far.
            assert self._snapshot is not None  # taken at the first batch
            due = state.optimizer_steps - self._snapshot_step >= self.snapshot_every
            if saving or ((due or not self._judges(self._snapshot["known"])) and self._judges(self._known)):
                self._take_snapshot(state)
            return False
        self._recover(state, first)
        return True

    def _take_snapshot(self, state: TrainState) -> None:
        estimator = state.estimator
        self._snapshot = None  # the old copies go first: at most one snapshot in memory
        self._snapshot = {
            "net": {name: value.detach().clone() for name, value in estimator.net.state_dict().items()},
            "optimizers": [copy.deepcopy(optimizer.state_dict()) for optimizer in estimator.optimizers],
            "scaler": None if estimator.scaler is None else copy.deepcopy(estimator.scaler.state_dict()),
            "undone": [(undoable, undoable.mark()) for undoable in state.services.undoables],  # an EMA's, the sums
            # The losses that led to these weights: after a rollback the next losses are judged against them, not
            # against the lower ones of the undone steps (a falling loss would make every clean batch a spike).
            "losses": self._losses.clone(),
            "known": self._known,
        }
        self._snapshot_step = state.optimizer_steps
        self._snapshot_steps = state.run.clock.steps_so_far()  # the steps after it, a rollback undoes

    def _recover(self, state: TrainState, first: int) -> None:
        started = time.perf_counter()  # in backward_end: within the step's time, as the steps it undoes
        self._roll_back(state, first)
        clock = state.run.clock
        clock.undo(clock.steps_so_far() - self._snapshot_steps + time.perf_counter() - started)
        self._snapshot_steps = clock.steps_so_far()

    def _roll_back(self, state: TrainState, first: int) -> None:
        where = next(((epoch, batch) for count, epoch, batch in self._recent if count == first), (0, 0))
        self.recoveries.append(where)
        if len(self.recoveries) > self.max_recoveries:
            named = ", ".join(f"epoch {epoch} batch {batch}" for epoch, batch in self.recoveries)
            raise LossSpikeError(
                f"SpikeGuardHandler: the training loss spiked {len(self.recoveries)} times, more than "
                f"max_recoveries={self.max_recoveries}, at {named}: look at those batches' data, lower the "
                "learning rate, or raise factor or max_recoveries"
            )
        assert self._snapshot is not None  # taken at the first batch
        estimator = state.estimator
        estimator.net.load_state_dict(self._snapshot["net"])
        for optimizer, saved in zip(estimator.optimizers, self._snapshot["optimizers"]):
            rates = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            optimizer.load_state_dict(copy.deepcopy(saved))  # the snapshot stays as it was for the next time
            for group, now in zip(optimizer.param_groups, rates):  # the rates go on as the schedule set them
                group.update(now)
        self._losses.copy_(self._snapshot["losses"])  # judged as the snapshot was: no clean batch looks a spike
        self._known = self._snapshot["known"]
        for undoable, mark in self._snapshot["undone"]:  # an EMA's average; the sums, to count no undone batch
            undoable.rewind(mark)
        if estimator.scaler is not None and self._snapshot["scaler"] is not None:
            estimator.scaler.load_state_dict(self._snapshot["scaler"])
        for parameter in estimator.net.parameters():
            parameter.grad = None
        state.accumulated_batches = 0
        if self.lr_factor is not None:
            for optimizer in estimator.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= self.lr_factor
        self._epoch_recoveries += 1
        log.warning(
            "SpikeGuardHandler: the training loss spiked at epoch %d batch %d; back to the weights of "
            "optimizer step %d%s (recovery %d of at most %d)",
            *where,
            self._snapshot_step,
            "" if self.lr_factor is None else f", learning rates x{self.lr_factor}",
            len(self.recoveries),
            self.max_recoveries,
        )

    def epoch_end(self, state: TrainState) -> None:
        if state.phase == "train":
            if self._snapshot is not None and self._batches:  # the epoch's last batches, before validation
                self._check(state)
            state.history.record(KEY, float(self._epoch_recoveries))
            self._epoch_recoveries = 0

    def train_end(self, state: TrainState) -> None:
        if state.phase == "train" and self._snapshot is not None and self._batches:
            self._check(state)  # a later save (a signal's) then saves this state: no batch runs in between
        self._snapshot = None  # the device memory of the copies

    def state_dict(self) -> dict:
        """The recent losses (the median's window; in training, the snapshot's too: a save takes one), how many
        are known, the recoveries so far and this epoch's, and the batches (a resume checks at the same ones)."""
        return {
            "losses": self._losses.tolist(),
            "known": self._known,
            "recoveries": list(self.recoveries),
            "epoch_recoveries": self._epoch_recoveries,
            "batches": self._batches,
        }

    def load_state_dict(self, state: dict) -> None:
        self._losses.copy_(torch.tensor(state["losses"], dtype=self._losses.dtype))
        self._known, self.recoveries = state["known"], [(int(e), int(b)) for e, b in state["recoveries"]]
        self._epoch_recoveries, self._batches = state.get("epoch_recoveries", 0), state.get("batches", 0)
