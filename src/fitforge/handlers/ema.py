"""EMAHandler: an exponential moving average of the weights, which evaluation runs with."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, Stage, TrainBegin
from fitforge.core.roles import WeightAveraging
from fitforge.core.services import Services, Undoable
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, check_positive, describe

log = logging.getLogger("fitforge")
_BUFFERS = ("average", "live")


class EMAHandler(TrainBegin, EpochBegin, BatchEnd, EpochEnd, WeightAveraging):
    """Keep an exponential moving average of the net's weights, and evaluate with it (validation, ``evaluate``,
    ``predict`` and the best checkpoint, while ``evaluate_averaged``); the raw weights keep training. The average is
    updated on the device and rides in checkpoints; docs/handlers.md (Averaged weights) has the details.

    Args:
        decay: the weight of the old average at each update, in [0, 1) (0.999: about the last 1,000 updates count).
        every: update after every n-th optimizer step (with accumulation, one per ``accumulate`` batches).
        buffers: ``"average"``, average the finite floating-point buffers as the weights, or ``"live"``: evaluate
            with the trained net's own.
        evaluate_averaged: evaluation uses the average (False: the raw weights; the average is still kept).
    """

    # After the step (and DiLoCo's outer one): validation (after it) and checkpoints see the average.
    priority = Stage.METRICS
    reads = ("estimator", "optimizer_steps", "run")
    writes = ("services.averages",)  # its average, updated at each step: readers of it run after

    def __init__(
        self, decay: float = 0.999, every: int = 1, buffers: str = "average", evaluate_averaged: bool = True
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            raise FitforgeTypeError(f"EMAHandler: decay must be a number in [0, 1), got {describe(decay)}")
        if not 0.0 <= decay < 1.0:  # nan too
            raise FitforgeValueError(f"EMAHandler: decay must be in [0, 1) (e.g. 0.999), got {decay!r}")
        check_positive("EMAHandler", "every", every)
        if buffers not in _BUFFERS:
            raise FitforgeValueError(f"EMAHandler: buffers must be 'average' or 'live', got {buffers!r}")
        self.decay, self.every, self.buffers = float(decay), every, buffers
        self.evaluate_averaged = check_flag("EMAHandler", "evaluate_averaged", evaluate_averaged)
        self.updates = 0  # averaging updates made, over every fit
        self._net: nn.Module | None = None
        self._names: list[str] = []
        self._averages: list[torch.Tensor] = []  # as the weights are: DTensors under FSDP
        self._local_averages: list[torch.Tensor] = []  # their local tensors, which the maths runs on
        self._live: list[torch.Tensor] = []  # the weights' local tensors (detached: written in place)
        self._kept: list[torch.Tensor] | None = None  # the trained weights while the average is swapped in
        self._swapped = 0
        self._sharded = False
        self._hold: Any = None  # the engine's hold_shards: units gathered by a forward read their shards again
        self._pending = False  # start the average from the weights the first epoch starts with
        self._seen = 0  # the optimizer steps at the last batch_end

    @property
    def evaluates_averaged(self) -> bool:
        """The role's switch (:class:`~fitforge.core.roles.WeightAveraging`): ``evaluate_averaged``."""
        return self.evaluate_averaged

    def train_begin(self, state: TrainState) -> None:
        self.attach(state.estimator)
        self._seen = state.optimizer_steps

    def attach(self, estimator: Any) -> None:
        """Track ``estimator.net``: start an average of its weights, unless this handler holds one of the same net
        already (a second fit continues it). A checkpoint's average can then be loaded into it (``load_state_dict``,
        or ``estimator.load_checkpoint`` once this is the estimator's ``weight_average``)."""
        net = estimator.net
        self._sharded, self._hold = estimator.strategy.sharded, estimator.strategy.hold_shards
        self._hold(net)  # the sharded parameters, which the optimizers step
        # Every parameter, then (buffers="average") the floating buffers finite at fit start (a -inf mask gives nan).
        averaged = self.buffers == "average"
        finite = [(n, b) for n, b in net.named_buffers() if averaged and b.is_floating_point() and b.isfinite().all()]
        tracked = [*net.named_parameters(), *finite]
        names = [name for name, _ in tracked]
        same = (
            net is self._net
            and names == self._names
            and all(a.shape == t.shape for a, (_, t) in zip(self._averages, tracked))
        )
        self._live = [_local(t.detach()) for _, t in tracked]
        if not same:  # a first fit, or another net: start afresh (a resume loads the average next)
            self._net, self._names = net, names
            low = (torch.bfloat16, torch.float16)  # averaged in float32
            self._averages = [
                t.detach().to(torch.float32 if t.dtype in low else t.dtype, copy=True) for _, t in tracked
            ]
            self._local_averages = [_local(a) for a in self._averages]
            self._pending, self.updates = True, 0
        # the live tensors as the average's dtype, for the lerp: a cast per step for low-precision weights only
        self._cast = any(a.dtype != t.dtype for a, t in zip(self._local_averages, self._live))

    def epoch_begin(self, state: TrainState) -> None:
        if self._pending:  # after any resume restored the weights: the average starts from the run's start
            self._pending = False
            if state.run.resumed:
                log.info("EMAHandler: the checkpoint resumed from holds no average: it starts from its weights")
            torch._foreach_copy_(self._local_averages, self._live)

    def batch_end(self, state: TrainState) -> None:
        steps = state.optimizer_steps
        if steps != self._seen:  # else no step this batch (accumulating, or a skipped one): nothing new
            self._update(steps)

    epoch_end = batch_end  # a trailing partial accumulation group is stepped at epoch end

    def _update(self, steps: int) -> None:
        due = steps // self.every > self._seen // self.every  # an every-th step was taken since the last look
        self._seen = steps
        if not due:
            return
        live = [t.to(a.dtype) for t, a in zip(self._live, self._local_averages)] if self._cast else self._live
        # average + (1 - decay) * (weight - average): decay * average + (1 - decay) * weight, fused
        torch._foreach_lerp_(self._local_averages, live, 1.0 - self.decay)
        self.updates += 1

    def swap_in(self) -> None:
        if not self._averages:
            return
        if self._swapped == 0:
            self._hold(self._net)  # a unit left gathered by a forward would not read its shards again
            self._kept = [t.clone() for t in self._live]
            torch._foreach_copy_(self._live, self._local_averages)
        self._swapped += 1  # nested: an evaluate() run from a handler during a validation

    def swap_out(self) -> None:
        if self._swapped == 0:
            return
        self._swapped -= 1
        if self._swapped == 0 and self._kept is not None:
            self._hold(self._net)
            torch._foreach_copy_(self._live, self._kept)
            self._kept = None

    def sharded_averages(self) -> dict[str, Any]:
        return dict(zip(self._names, self._averages)) if self._sharded else {}

    def averaged_net(self) -> nn.Module | None:
        return self._net

    def load_averaged(self, weights: dict[str, Any]) -> None:
        """Copy ``weights`` (a ``state_dict`` of the net, e.g. the best epoch's averaged weights) into the average."""
        for name, average in zip(self._names, self._averages):
            if name in weights:
                average.copy_(weights[name])

    def offer(self, services: Services) -> None:
        """Its average: the run's averaged weights, set back with the weights when batches are undone."""
        services.averages.append(self)  # fit evaluates with it
        services.undoables.append(Undoable(self._mark, self._rewind))

    def _mark(self) -> tuple[list[torch.Tensor], tuple]:
        """Copies of the average (its shards under FSDP, which ``state_dict`` leaves out) and its counters."""
        return [average.detach().clone() for average in self._averages], (self.updates, self._seen, self._pending)

    def _rewind(self, mark: tuple[list[torch.Tensor], tuple]) -> None:
        averages, (self.updates, self._seen, self._pending) = mark
        for average, saved in zip(self._averages, averages):  # copied: the mark may be rewound to again
            average.copy_(saved)

    def state_dict(self) -> dict:
        """The average by name (under FSDP, saved with the weights' shards instead), the updates and the steps seen."""
        averages = {} if self._sharded else dict(zip(self._names, self._averages))
        return {"averages": averages, "updates": self.updates, "seen": self._seen, "pending": self._pending}

    def load_state_dict(self, state: dict) -> None:
        if self._net is None:
            raise FitforgeValueError("EMAHandler: load_state_dict before any fit: call attach(estimator) first")
        averages = state["averages"]
        if not self._sharded:
            missing = [name for name in self._names if name not in averages]
            unexpected = [name for name in averages if name not in self._names]
            if missing or unexpected:
                raise FitforgeValueError(
                    f"EMAHandler: the checkpoint's average is of other weights (missing: {missing[:5]}, unexpected: "
                    f"{unexpected[:5]}): resume with the net it was saved with"
                )
            for name, average in zip(self._names, self._averages):
                average.copy_(averages[name])
        self.updates, self._seen, self._pending = state["updates"], state["seen"], state["pending"]

    def __repr__(self) -> str:
        return f"EMAHandler(decay={self.decay}, every={self.every})"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage), else the tensor."""
    return getattr(tensor, "to_local", lambda: tensor)()
