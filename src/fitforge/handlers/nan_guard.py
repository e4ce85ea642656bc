"""NaNGuardHandler: stop, skip the step, or fail when the training loss or a gradient is not finite."""

from __future__ import annotations

import logging
import math

import torch

from fitforge.checkpoint.finite import GradientCheck
from fitforge.core.events import BackwardEnd, EpochEnd, Stage, TrainBegin
from fitforge.core.roles import Stopping
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import CancelBatch, FitforgeTypeError, FitforgeValueError, check_positive, describe

log = logging.getLogger("fitforge")
_NONE = 2**62  # "no non-finite loss so far"
_SHIFT = 2**32  # a batch is recorded on the device as global_step * _SHIFT + batch_idx: one int64
_POLICIES = ("stop", "skip", "raise")


class NonFiniteLossError(FitforgeValueError):
    """The training loss (or a gradient) was not finite under ``NaNGuardHandler(policy="raise")``."""


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a step on a device flag (``found_inf``), its state untouched: fused Adam and AdamW.
    Not fused SGD: a skipped first step leaves its momentum ``empty_like``, and on CUDA a skipped step moves it."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(
        getattr(optimizer, "_step_supports_amp_scaling", False)
    )


class NaNGuardHandler(TrainBegin, BackwardEnd, EpochEnd, Stopping):
    """Act when the training loss or a gradient is nan or infinite, and never let the optimizer step on such a batch.

    It decides on the device at ``backward_end``. With optimizers that skip a step on a device flag (``fused=True``
    Adam and AdamW) it offers its flag to the stepping (``services.step_skips``) and reads it once per epoch (or
    every ``check_every`` batches); otherwise, and for ``"skip"``, it reads it every batch and cancels a bad one.
    docs/handlers.md and docs/checkpoints.md have the details and costs.

    Args:
        policy: ``"stop"`` (a stop whose reason names the first bad batch), ``"skip"`` (cancel every bad batch and go
            on) or ``"raise"`` (a :class:`NonFiniteLossError`).
        check_every: for "stop"/"raise" on the device-skip path, also read the record every n batches and act at
            once (None: only at epoch end). "skip" reads every batch anyway (only None or 1 allowed).
    """

    priority = Stage.GUARD
    reads = ("phase", "output", "epoch", "batch_idx", "global_step", "estimator", "run", "num_batches")
    writes = ("run", "services.step_skips")

    def __init__(self, policy: str = "stop", check_every: int | None = None) -> None:
        if not isinstance(policy, str):
            raise FitforgeTypeError(f"NaNGuardHandler: policy must be one of {_POLICIES}, got {describe(policy)}")
        if policy not in _POLICIES:
            raise FitforgeValueError(f"NaNGuardHandler: policy must be one of {_POLICIES}, got {policy!r}")
        check_positive("NaNGuardHandler", "check_every", check_every, allow_none=True)
        if policy == "skip" and check_every not in (None, 1):
            raise FitforgeValueError(
                f"NaNGuardHandler: policy='skip' decides every batch (a host read per batch); "
                f"check_every={check_every} applies only to 'stop' and 'raise'"
            )
        self.policy, self.check_every = policy, check_every
        self.stopped_epoch: int | None = None
        self.skipped, self._epoch_skips = 0, 0  # batches skipped in this run and epoch ("skip")
        self._device = torch.device("cpu")  # the estimator's from train_begin on
        self._gradients: GradientCheck | None = None  # None under a GradScaler, which guards them
        self._read_every_batch = False
        self._found = torch.zeros(())
        self._clear()

    def offer(self, services: Services) -> None:
        services.guards_nonfinite = True  # a diverged loss needs no hint to add a guard
        services.step_skips.append(self._skip_flag)  # read at the stepping's train_begin, after this one's

    def _skip_flag(self) -> torch.Tensor | None:
        """The device flag a fused step skips on, when the guard decides on the device (see the class docstring)."""
        return self._found if self._gradients is not None and not self._read_every_batch else None

    def train_begin(self, state: TrainState) -> None:
        estimator = state.estimator
        self._device = estimator.device
        self.stopped_epoch, self.skipped, self._epoch_skips = None, 0, 0
        self._clear()
        self._found = torch.zeros((), device=self._device)  # this batch is bad (float: what optimizers take)
        optimizers = estimator.optimizers
        params = (p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"])
        self._gradients = None if estimator.scaler is not None else GradientCheck(params)
        on_device = all(_skips_on_device(optimizer) for optimizer in optimizers)
        self._read_every_batch = self.policy == "skip" or (self._gradients is not None and not on_device)
        if self._read_every_batch and self.policy != "skip" and self._device.type != "cpu":
            log.info(
                "NaNGuardHandler: %s cannot skip its step on the device, so the guard reads one flag per "
                "batch (a device sync); a fused Adam or AdamW (fused=True) avoids it",
                ", ".join(type(o).__name__ for o in optimizers if not _skips_on_device(o)),
            )

    def _clear(self) -> None:
        self._first = torch.full((), _NONE, dtype=torch.int64, device=self._device)  # first bad batch's code
        self._value = torch.zeros((), device=self._device)  # and its loss

    def backward_end(self, state: TrainState) -> None:
        loss = state.output.loss if state.output is not None else None
        if state.phase != "train" or loss is None:
            return
        ranks, bad = state.run.ranks, self._found  # this batch's flag, on the device: 1 when not finite
        bad.copy_(~(torch.isfinite(loss) if loss.dim() == 0 else torch.isfinite(loss).all()))
        if self._gradients is not None:
            self._gradients.update(bad)
        if ranks.several and not self._read_every_batch:  # the ranks skip the step together (a device all-reduce)
            ranks.max_(bad)
        if self._read_every_batch:  # the host decides: the bad batch is cancelled, so never stepped
            if not ranks.any(bool(bad)):
                return
            if self.policy == "skip":
                self.skipped, self._epoch_skips = self.skipped + 1, self._epoch_skips + 1
                log.debug("NaNGuardHandler: skipping epoch %d batch %d", state.epoch + 1, state.batch_idx + 1)
            else:
                self._record(state, bad, loss.detach())
                self._act(state)
            raise CancelBatch("NaNGuardHandler: non-finite loss or gradient")
        self._record(state, bad, loss.detach())
        if self.check_every is not None and (state.global_step + 1) % self.check_every == 0 and self._act(state):
            raise CancelBatch("NaNGuardHandler: non-finite loss or gradient")  # no optimizer step for this batch

    def _record(self, state: TrainState, bad: torch.Tensor, loss: torch.Tensor) -> None:
        """Remember, on the device, the first bad batch since the last read and its loss (a few in-place operations
        on 0-d tensors: this runs every batch on the device-skip path)."""
        first = bad.bool().logical_and_(self._first == _NONE)
        self._first.masked_fill_(first, state.global_step * _SHIFT + state.batch_idx)
        self._value.masked_fill_(first, loss.reshape(-1)[0].float())

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train":
            return
        if self.policy == "skip":
            if self._epoch_skips:
                log.warning(
                    "NaNGuardHandler skipped %d batch(es) of epoch %d whose loss or gradients were not finite",
                    self._epoch_skips,
                    state.epoch + 1,
                )
            self._epoch_skips = 0
        elif not state.run.epoch_suspended:
            self._act(state)  # a preempted partial epoch is judged when the resumed run ends it

    def _act(self, state: TrainState) -> bool:
        """Read the record (one host read; two when there is a bad batch) and act on it. Under torch.distributed the
        ranks agree on the first bad batch of any rank (one all-reduce)."""
        own = int(self._first)
        code = state.run.ranks.min_int(own)
        if code == _NONE:
            return False
        step, batch = divmod(code, _SHIFT)
        # Every epoch end reads the record, so the bad batch is in the current epoch.
        loss = float(self._value) if own == code else None
        what = (
            "loss of another rank"
            if loss is None
            else f"loss {loss}"
            if not math.isfinite(loss)
            else f"gradient (loss {loss:.4g})"
        )
        where = f"{what} at epoch {state.epoch + 1}, batch {batch + 1} (global step {step})"
        self._clear()
        if self.policy == "raise":
            raise NonFiniteLossError(
                f"NaNGuardHandler(policy='raise'): the training {where} is not finite; lower the learning rate, clip "
                "gradients (GradientUpdateHandler(clip_norm=...)) or look for nan/inf in the data"
            )
        self.stopped_epoch = state.epoch
        state.run.stop(
            f"NaNGuardHandler: {where}" + ("" if loss is None or not math.isfinite(loss) else " is not finite"),
            every_rank=True,  # the record was reduced over the ranks: each stops here
        )
        return True

    def ended_run(self) -> bool:
        """Whether it had stopped the run at a non-finite loss (restored: a resumed fit is over)."""
        return self.stopped_epoch is not None

    def state_dict(self) -> dict:
        """The device record of the first bad batch not yet acted on, the stop epoch, the skip count."""
        return {
            "stopped_epoch": self.stopped_epoch,
            "skipped": self.skipped,
            "first": self._first,
            "value": self._value,
        }

    def load_state_dict(self, state: dict) -> None:
        self.stopped_epoch, self.skipped = state.get("stopped_epoch"), state.get("skipped", 0)
        if "first" in state:
            self._first, self._value = state["first"].to(self._device), state["value"].to(self._device)

    def __repr__(self) -> str:
        every = f", check_every={self.check_every}" if self.check_every is not None else ""
        return f"NaNGuardHandler(policy={self.policy!r}{every})"
