"""NaNGuardHandler: stop, skip the step, or fail when the training loss is not finite."""

from __future__ import annotations

import logging

import torch

from ..checks import check_positive
from ..distributed import any_rank, reduce_ints
from ..events import BatchEnd, EpochEnd, TrainBegin
from ..exceptions import CancelBatch, FitforgeTypeError, FitforgeValueError, describe
from ..resume import epoch_done
from ..state import TrainState

log = logging.getLogger("fitforge")
_NONE = 2**62  # "no non-finite loss so far"
_SHIFT = 2**32  # a batch is recorded on the device as global_step * _SHIFT + batch_idx: one int64
_POLICIES = ("stop", "skip", "raise")


class NonFiniteLossError(FitforgeValueError):
    """The training loss was nan or infinite and ``NaNGuardHandler(policy="raise")`` was asked to fail."""


class NaNGuardHandler(TrainBegin, BatchEnd, EpochEnd):
    """Act when the training loss (``state.output.loss``) is nan or infinite.

    Whether a loss is finite is known on the device; bringing that to the host waits for the device
    (a sync), so each policy's cost is stated:

    - ``"stop"`` (default): request a stop whose reason (in ``history.stop_reason``) names the first
      non-finite batch (epoch and batch counted from 1, and ``state.global_step``) and the loss value.
      By default the check costs a few tiny device operations per batch and **one host read per
      epoch**: the first bad batch is recorded on the device and read at epoch end, so the stop
      comes at the end of that epoch, after the optimizer has stepped on the bad gradients (the
      weights may already be nan). With ``check_every=n`` the record is also read every n batches
      (one read each time) and the guard acts at once: that batch is cancelled (no optimizer
      step, gradients cleared) and training stops. ``check_every=1`` stops before the first bad step.
    - ``"raise"``: like ``"stop"``, but fail with a :class:`NonFiniteLossError` (a ``ValueError``)
      naming the batch and the value; ``train_end`` still runs for every handler.
    - ``"skip"``: skip the optimizer step of every batch whose loss is not finite (the batch is
      cancelled with ``CancelBatch``: its gradients are cleared, it does not count towards
      ``batches=N`` nor in the epoch's metrics) and go on. Deciding per batch needs the value per
      batch: **one host read per batch**. With gradient accumulation, a skipped batch clears the
      gradients of its whole group so far. A warning at each epoch end says how many were skipped.

    It runs at priority -2100, before GradientUpdateHandler's optimizer step (-2000), and only in
    training. A run it stopped counts as finished: resuming from a checkpoint written after the stop
    trains no more (like EarlyStoppingHandler). Its record rides in checkpoints, so a run preempted
    after a bad batch reports it when the resumed epoch ends.

    Args:
        policy: ``"stop"``, ``"skip"`` or ``"raise"``.
        check_every: for "stop"/"raise", also read the record every n batches and act at once
            (None: only at epoch end). "skip" reads every batch anyway (only None or 1 allowed).

    Raises:
        FitforgeTypeError / FitforgeValueError: a bad ``policy`` or ``check_every``.

    Example:
        >>> from fitforge.handlers.nan_guard import NaNGuardHandler
        >>> guard = NaNGuardHandler("stop", check_every=1)   # stop before the first bad step
        >>> history = estimator.fit(train, epochs=10, event_handlers=[guard])  # doctest: +SKIP
        >>> history.stop_reason                                                # doctest: +SKIP
        'NaNGuardHandler: loss nan at epoch 3, batch 7 (global step 70)'
    """

    priority = -2100  # before GradientUpdateHandler's step (-2000)
    reads = ("phase", "output", "epoch", "batch_idx", "global_step", "estimator", "preempted",
             "epoch_complete", "epoch_cancelled", "num_batches")
    writes = ("stop_requested",)

    def __init__(self, policy: str = "stop", check_every: int | None = None) -> None:
        if not isinstance(policy, str):
            raise FitforgeTypeError(f"NaNGuardHandler: policy must be one of {_POLICIES}, got {describe(policy)}")
        if policy not in _POLICIES:
            raise FitforgeValueError(f"NaNGuardHandler: policy must be one of {_POLICIES}, got {policy!r}")
        check_positive("NaNGuardHandler", "check_every", check_every, allow_none=True)
        if policy == "skip" and check_every not in (None, 1):
            raise FitforgeValueError(f"NaNGuardHandler: policy='skip' decides every batch (a host read per batch); "
                                     f"check_every={check_every} applies only to 'stop' and 'raise'")
        self.policy, self.check_every = policy, check_every
        self.stopped_epoch: int | None = None
        self.skipped, self._epoch_skips = 0, 0  # batches skipped in this run and epoch ("skip")
        self._device = torch.device("cpu")  # the estimator's from train_begin on
        self._clear()

    def train_begin(self, state: TrainState) -> None:
        self._device = state.estimator.device
        self.stopped_epoch, self.skipped, self._epoch_skips = None, 0, 0
        self._clear()

    def _clear(self) -> None:
        self._first = torch.full((), _NONE, dtype=torch.int64, device=self._device)  # first bad batch's code
        self._value = torch.zeros((), device=self._device)  # and its loss

    def batch_end(self, state: TrainState) -> None:
        loss = state.output.loss if state.output is not None else None
        if state.phase != "train" or loss is None:
            return
        loss = loss.detach()
        if self.policy == "skip":
            return self._skip(state, loss)
        # On the device, no sync: remember the first batch whose loss is not finite, and its loss.
        finite = torch.isfinite(loss) if loss.dim() == 0 else torch.isfinite(loss).all()
        batch = torch.where(finite, _NONE, state.global_step * _SHIFT + state.batch_idx)
        earlier = batch < self._first
        self._first = torch.where(earlier, batch, self._first)
        self._value = torch.where(earlier, loss.reshape(-1)[0].float(), self._value)
        if self.check_every is not None and (state.global_step + 1) % self.check_every == 0 and self._act(state):
            raise CancelBatch("NaNGuardHandler: non-finite loss")  # no optimizer step for this batch

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train":
            return
        if self.policy == "skip":
            if self._epoch_skips:
                log.warning("NaNGuardHandler skipped %d batch(es) of epoch %d whose loss was not finite",
                            self._epoch_skips, state.epoch + 1)
            self._epoch_skips = 0
        elif state.preempted is None or epoch_done(state):
            self._act(state)  # a preempted partial epoch is judged when the resumed run ends it

    def _act(self, state: TrainState) -> bool:
        """Read the record (one host read; two when there is a bad batch) and act on it. Under
        torch.distributed the ranks agree on the first bad batch of any rank (one all-reduce)."""
        own = int(self._first)
        code = reduce_ints([own], "min")[0]
        if code == _NONE:
            return False
        step, batch = divmod(code, _SHIFT)
        # Every epoch end reads the record, so the bad batch is in the current epoch.
        loss = f"loss {float(self._value)}" if own == code else "loss of another rank"
        where = f"{loss} at epoch {state.epoch + 1}, batch {batch + 1} (global step {step})"
        self._clear()
        if self.policy == "raise":
            raise NonFiniteLossError(f"NaNGuardHandler(policy='raise'): the training {where} is not finite; lower "
                                     "the learning rate, clip gradients (GradientUpdateHandler(clip_norm=...)) or "
                                     "look for nan/inf in the data")
        self.stopped_epoch = state.epoch
        state.request_stop(f"NaNGuardHandler: {where}")
        return True

    def _skip(self, state: TrainState, loss: torch.Tensor) -> None:
        # The per-batch host read this policy needs; every rank skips if any rank's loss is bad.
        if not any_rank(not bool(torch.isfinite(loss).all())):
            return
        self.skipped += 1
        self._epoch_skips += 1
        log.debug("NaNGuardHandler: skipping epoch %d batch %d", state.epoch + 1, state.batch_idx + 1)
        raise CancelBatch("NaNGuardHandler: non-finite loss")

    def state_dict(self) -> dict:
        """The device record of the first bad batch not yet acted on, the stop epoch, the skip count."""
        return {"stopped_epoch": self.stopped_epoch, "skipped": self.skipped, "first": self._first,
                "value": self._value}

    def load_state_dict(self, state: dict) -> None:
        self.stopped_epoch, self.skipped = state.get("stopped_epoch"), state.get("skipped", 0)
        if "first" in state:
            self._first, self._value = state["first"].to(self._device), state["value"].to(self._device)

    def __repr__(self) -> str:
        every = f", check_every={self.check_every}" if self.check_every is not None else ""
        return f"NaNGuardHandler(policy={self.policy!r}{every})"
