"""GradientUpdateHandler: the optimizer step after the batch processor's backward, with optional
gradient accumulation and clipping."""

from __future__ import annotations

import torch

from fitforge.core.arguments import check_positive
from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin


def step_optimizers(
    optimizers: list, scaler: torch.amp.GradScaler | None, found_inf: torch.Tensor | None = None
) -> None:
    """Step every optimizer (through the fp16 scaler, which skips a step on inf/nan gradients),
    zero its gradients, then update the scaler. ``found_inf``: a device flag (float 0-d) on which
    fused optimizers skip their update on the device, as they do for GradScaler (NaNGuardHandler's)."""
    for optimizer in optimizers:
        if scaler is not None:
            scaler.step(optimizer)
        elif found_inf is None:
            optimizer.step()
        else:
            optimizer.found_inf = found_inf  # the attribute a fused step reads (GradScaler sets it too)
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update()


class GradientUpdateHandler(TrainBegin, BatchEnd, EpochEnd):
    """Step every optimizer, then ``zero_grad(set_to_none=True)``.

    It runs first at ``batch_end`` (``Stage.STEP``), so later handlers see updated weights; a
    handler that must read the gradients before the step does so at ``backward_end``. Clipping
    happens in the step itself, right after the fp16 scaler's unscale (the two must not be split:
    a batch cancelled between them would leave the scaler unscaled). A flag in
    ``state.shared["found_inf"]`` when training starts (NaNGuardHandler's, for fused optimizers) is
    passed to every step: a step whose flag is set is skipped on the device.

    Args:
        accumulate: step once every this many batches; the summed gradients are divided by the
            number of batches in the group, so with a mean-reduced loss a group of N batches of B
            samples steps like one batch of N*B. A trailing partial group (the end of an epoch, or a
            stop) is stepped too, divided by its own size; not when SIGTERM/SIGINT stopped training
            mid-epoch, as the group goes on when the run resumes. ``state.optimizer_steps`` counts steps.
        clip_norm: clip the total gradient norm of the optimizers' parameters to this value before
            each step (``torch.nn.utils.clip_grad_norm_``).
        clip_value: clip every gradient element to ``[-clip_value, clip_value]`` before each step.

    A ``CancelBatch`` clears the gradients of the whole group accumulated so far (the loop cannot
    tell one batch's share from the others').
    """

    priority = Stage.STEP
    reads = (
        "estimator",
        "phase",
        "preempted",
        "epoch_finished",
        "batch_idx",
        "num_batches",
        "shared.found_inf",
    )
    writes = ("accumulated_batches", "optimizer_steps")

    def __init__(self, accumulate: int = 1, clip_norm: float | None = None, clip_value: float | None = None) -> None:
        check_positive("GradientUpdateHandler", "accumulate", accumulate)
        check_positive("GradientUpdateHandler", "clip_norm", clip_norm, (int, float), allow_none=True)
        check_positive("GradientUpdateHandler", "clip_value", clip_value, (int, float), allow_none=True)
        self.accumulate, self.clip_norm, self.clip_value = accumulate, clip_norm, clip_value

    def train_begin(self, state) -> None:
        self._scaler = state.estimator.scaler
        self._found_inf = state.shared.get("found_inf")
        self._step_only = (
            self.accumulate == 1
            and self.clip_norm is None
            and self.clip_value is None
            and self._scaler is None
            and self._found_inf is None
        )
        self._optimizers = list(state.estimator.optimizers)
        self._params = [p for o in self._optimizers for group in o.param_groups for p in group["params"]]
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        state.accumulated_batches = 0

    def batch_end(self, state) -> None:
        if self._step_only:  # the common case (no accumulation, clipping or fp16 scaler), kept short
            for optimizer in self._optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state.optimizer_steps += 1
            return
        state.accumulated_batches += 1
        if state.accumulated_batches >= self.accumulate:
            self.step(state)

    def epoch_end(self, state) -> None:
        if state.phase == "train" and state.accumulated_batches:  # a trailing partial group
            if state.epoch_suspended:
                return  # the group goes on when the run resumes: its checkpoint keeps the gradients
            self.step(state)

    def step(self, state) -> None:
        """Average the accumulated gradients, clip them, step and zero them. Under fp16 the
        GradScaler unscales before clipping and skips the step when a gradient is inf or nan."""
        scaler, clipping = self._scaler, self.clip_norm is not None or self.clip_value is not None
        if scaler is not None and clipping:
            for optimizer in self._optimizers:
                scaler.unscale_(optimizer)  # clip true gradients, not scaled ones
        grads = [p.grad for p in self._params if p.grad is not None]
        if state.accumulated_batches > 1 and grads:
            torch._foreach_div_(grads, state.accumulated_batches)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.clip_norm)
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self._params, self.clip_value)
        step_optimizers(self._optimizers, scaler, self._found_inf)
        state.accumulated_batches = 0
        state.optimizer_steps += 1
