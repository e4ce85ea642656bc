"""GradientUpdateHandler: the optimizer step after the backward, with optional accumulation and clipping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fitforge.core.events import BatchBegin, BatchEnd, EpochEnd, Event, Stage, TrainBegin, TrainEnd
from fitforge.core.roles import Accumulating
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, check_positive, describe
from fitforge.optim.item_counts import ItemCounter, UnweightedNote, fit_counter
from fitforge.optim.optimizer_choice import OptimizerChoice


def step_optimizers(
    optimizers: list, scaler: torch.amp.GradScaler | None, found_inf: torch.Tensor | None = None
) -> None:
    """Step every optimizer (through the fp16 scaler, which skips a step on inf/nan gradients), zero its gradients,
    then update the scaler. Fused optimizers skip their update on ``found_inf``, a device flag (float 0-d)."""
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


class GradientUpdateHandler(TrainBegin, BatchBegin, BatchEnd, EpochEnd, TrainEnd, Accumulating):
    """Step the optimizers, then ``zero_grad(set_to_none=True)``, first at ``batch_end`` (``Stage.STEP``).

    With several optimizers a batch's ``BatchOutput.step`` may name those it steps (docs/custom-steps.md), each then
    counting its own accumulation group; ``state.optimizer_steps`` counts the batches on which any stepped. Under DDP
    with ``accumulate > 1`` only a group's last batch all-reduces (docs/distributed.md); a loss that is a mean over
    items is divided by the group's items (docs/handlers.md, Gradient accumulation by items).

    Args:
        accumulate: step once every this many batches (a trailing partial group at epoch end, unless a signal stopped
            training mid-epoch).
        items: with ``accumulate > 1``, how a batch's items are counted: ``"auto"``, a function
            ``(inputs, label) -> count`` (a device tensor), or None to weigh the batches alike.
        clip_norm: clip the total gradient norm of the stepping optimizers' parameters to this before each step.
        clip_value: clip every gradient element to ``[-clip_value, clip_value]`` before each step.
        sync_each_batch: under DDP, all-reduce in every batch's backward, not only in a group's last.
    """

    priority = Stage.STEP
    reads = ("estimator", "phase", "run", "epoch", "batch_idx", "num_batches", "global_step", "output", "services")
    writes = ("accumulated_batches", "optimizer_steps")

    def __init__(
        self,
        accumulate: int = 1,
        clip_norm: float | None = None,
        clip_value: float | None = None,
        sync_each_batch: bool = False,
        items: Callable[[Any, Any], torch.Tensor] | str | None = "auto",
    ) -> None:
        check_positive("GradientUpdateHandler", "accumulate", accumulate)
        if items is not None and items != "auto" and not callable(items):
            raise FitforgeTypeError(
                f"GradientUpdateHandler: items must be 'auto', None or a function (inputs, label) -> the batch's "
                f"item count (a tensor), got {describe(items)}"
            )
        self.items = items
        check_positive("GradientUpdateHandler", "clip_norm", clip_norm, (int, float), allow_none=True)
        check_positive("GradientUpdateHandler", "clip_value", clip_value, (int, float), allow_none=True)
        self.accumulate, self.clip_norm, self.clip_value = accumulate, clip_norm, clip_value
        self.sync_each_batch = check_flag("GradientUpdateHandler", "sync_each_batch", sync_each_batch)
        if accumulate == 1 or sync_each_batch:  # every batch syncs: no call per batch_begin
            self.handled_events = (Event.TRAIN_BEGIN, Event.BATCH_END, Event.EPOCH_END)
        self._open: list[int] = []  # per optimizer: batches in its open accumulation group
        self._skipped: list[int] = []  # per optimizer: optimizer_steps it took no part in
        self._deferred: Any = None  # DDP's all-reduce, when a group's last batch alone syncs
        self._items: torch.Tensor | None = None  # the open group's item count (on the device), when counted
        self._ranks = 1  # the ranks whose gradients DDP or FSDP average (set at train_begin)
        self._counting: ItemCounter | None = None  # this fit's counter (None: the batches weigh alike)
        self._uncounted_until_step = False  # a resumed group of batches that were not counted is still open
        self._fitting = False  # between train_begin and train_end: a resume changes the counting
        self.count_items: ItemCounter | None = None  # what the default fit_batch weighs each batch's loss by
        self._note: UnweightedNote | None = None  # watches the first group of batches that weigh alike

    def offer(self, services: Services) -> None:
        services.steps = self  # the run's optimizer stepping: schedules count its steps, checkpoints its groups
        services.first_batch_checks.append(self.check_first_batch)

    def train_begin(self, state: TrainState) -> None:
        self._scaler = state.estimator.scaler
        flags = [flag for skip in state.services.step_skips if (flag := skip()) is not None]
        self._found_inf = flags[0] if flags else None
        extras = (self.clip_norm, self.clip_value, self._scaler, self._found_inf)
        self._step_only = self.accumulate == 1 and all(extra is None for extra in extras)
        self._optimizers = list(state.estimator.optimizers)
        self._choice = OptimizerChoice(self._optimizers)
        for optimizer, params in zip(self._optimizers, self._choice.params):
            # nothing to clear: skip torch's zero_grad (a profiler record and a pass); an optimizer's own always runs
            own = type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad
            if own or any(p.grad is not None for p in params):
                optimizer.zero_grad(set_to_none=True)
        state.accumulated_batches = 0
        self._open, self._skipped = [0] * len(self._optimizers), [0] * len(self._optimizers)
        # One optimizer only: a batch picks its optimizers after its forward, too late to know if it ends a group.
        defers = self.accumulate > 1 and not self.sync_each_batch and len(self._optimizers) == 1
        estimator = state.estimator
        self._deferred = estimator.strategy.gradient_sync(estimator) if defers else None
        # DDP and FSDP average the ranks' gradients: a group's items are then summed over the ranks.
        averaged = state.run.ranks.several and estimator.strategy.averages_gradients(estimator)
        self._items, self._ranks = None, state.run.ranks.size if averaged else 1
        self._counting, why = fit_counter(self.items, state.estimator) if self.accumulate > 1 else (None, "")
        self._note = UnweightedNote(why, self.accumulate) if self._counting is None and why else None
        self.count_items, self._fitting = self._counting, True

    def batch_begin(self, state: TrainState) -> None:
        """Under DDP, whether this batch's backward all-reduces: it completes a group, or is the last of the epoch
        or of ``batches=N`` (every rank decides alike from the same counts)."""
        if self._deferred is not None:
            self._deferred.before_batch(
                state.accumulated_batches + 1 >= self.accumulate
                or state.batch_idx + 1 == state.num_batches
                or (state.run.max_batches is not None and state.global_step + 1 >= state.run.max_batches)
            )

    def check_first_batch(self, state: TrainState) -> None:
        """The first batch's ``step`` choice, checked before any handler's ``batch_end``."""
        if state.phase == "train" and state.output is not None and state.output.step is not None:
            self._choice.resolve(state.output.step, state)

    def batch_end(self, state) -> None:  # untyped: state.output is set at batch_end
        output = state.output
        if self._step_only and output.step is None and output.items is None:  # the common case (no accumulation,
            for optimizer in self._optimizers:  # clipping, fp16 scaler, choice of optimizers or counts), kept short
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state.optimizer_steps += 1
            return
        if self._note is not None and self._note.seen(output):
            self._note = None
        choice, counts = state.output.step, self._open
        chosen = self._choice.every if choice is None else self._choice.resolve(choice, state)
        if state.accumulated_batches != max(counts):
            self._sync(state)
        items = state.output.items
        if items is not None:  # the group's items, summed on the device
            items = torch.as_tensor(items, dtype=torch.float32)
            self._items = items if self._items is None else self._items + items
        due = []
        for i in chosen:
            counts[i] += 1
            if counts[i] >= self.accumulate:
                due.append(i)
        if len(chosen) < len(counts):  # the gradients it left on the others' parameters must not leak
            live = [i for i, count in enumerate(counts) if count]
            self._choice.discard([i for i in self._choice.every if not counts[i]], live)
        if due:
            self.step(state, due)
        else:
            state.accumulated_batches = max(counts)

    def epoch_end(self, state: TrainState) -> None:
        if state.phase == "train" and state.accumulated_batches:  # trailing partial groups
            if state.run.epoch_suspended:
                return  # the groups go on when the run resumes: its checkpoint keeps the gradients
            if self._deferred is not None:
                self._deferred.average()  # a group a stop or data without len ended before its synced batch
            if state.accumulated_batches != max(self._open):
                self._sync(state)
            self.step(state, [i for i, count in enumerate(self._open) if count])

    def train_end(self, state: TrainState) -> None:
        self.count_items, self._fitting = None, False
        if self._deferred is not None:  # also when an error ends training: evaluate and later fits sync
            self._deferred.restore()

    def share_open_group(self, state: TrainState) -> None:
        """Before a checkpoint saves an open group (every rank, at the same point): under DDP, average its gradients
        over the ranks, for any number of ranks to resume with; the group's last all-reduce then gives the same."""
        if self._deferred is not None and state.accumulated_batches:
            self._deferred.average()
        if self._items is not None and self._ranks > 1:  # each rank's share of the group's items, as its gradients
            state.run.ranks.sum_(self._items)
            self._items = self._items / self._ranks

    def _sync(self, state: TrainState) -> None:
        """Follow a change of ``accumulated_batches`` made elsewhere: 0 after a CancelBatch (or a resume) dropped the
        gradients; a count from a checkpoint older than per-optimizer groups is one group every optimizer shared."""
        self._open[:] = [state.accumulated_batches] * len(self._open)
        if not state.accumulated_batches:
            self._items = None

    def step(self, state: TrainState, optimizers: list[int] | None = None) -> None:
        """Average, clip, step and zero the gradients of the optimizers ``optimizers`` (indices; None: all)."""
        due = list(self._choice.every) if optimizers is None else optimizers
        scaler, clipping = self._scaler, self.clip_norm is not None or self.clip_value is not None
        if scaler is not None and clipping:
            for i in due:
                scaler.unscale_(self._optimizers[i])  # clip true gradients, not scaled ones
        self._average(due, state)
        params = self._choice.params_of(due)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.clip_value)
        waiting = [i for i, count in enumerate(self._open) if count and i not in due]
        # The fp16 scale, a device tensor (get_scale() would wait for the device): the update changes it in place.
        scale = None if scaler is None or not waiting else scaler._scale
        before = None if scale is None else scale.clone()
        step_optimizers([self._optimizers[i] for i in due], scaler, self._found_inf)
        if scale is not None and before is not None:  # the open groups hold gradients of the old scale
            grads = [p.grad for p in self._choice.params_of(waiting) if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale / before)
        for i in self._choice.every:
            if i in due:
                self._open[i] = 0
            else:
                self._skipped[i] += 1
        state.accumulated_batches = max(self._open)
        state.optimizer_steps += 1
        if self._uncounted_until_step:  # the group resumed from a run that did not count: counted from the next
            self._uncounted_until_step, self.count_items = False, self._counting

    def _average(self, due: list[int], state: TrainState) -> None:
        """Divide each group's summed gradients by its batch count (a shared parameter once), or by its items."""
        if self._items is not None:  # DDP and FSDP average the ranks' gradients: the items summed over the ranks
            items, self._items = self._items, None
            grads = [p.grad for p in self._choice.params_of(due) if p.grad is not None]
            if not grads:
                return
            items = torch.as_tensor(items, dtype=torch.float32, device=grads[0].device)
            if self._ranks > 1:
                state.run.ranks.sum_(items)
            # A group without items (every label padding) has zero gradients: they stay zero.
            torch._foreach_mul_(grads, torch.where(items > 0, self._ranks / items, 0.0))
            return
        seen: set[int] = set()
        for i in due:
            count = self._open[i]
            params = [p for p in self._choice.params[i] if p.grad is not None and id(p) not in seen]
            if self._choice.shared:
                seen.update(id(p) for p in self._choice.params[i])
            if count > 1 and params:
                torch._foreach_div_([p.grad for p in params], count)

    def steps_per_optimizer(self, state: TrainState) -> list[int]:
        """How many steps each optimizer (in ``estimator.optimizers`` order) took in this run, resumed runs included."""
        return [state.optimizer_steps - skipped for skipped in self._skipped]

    def state_dict(self) -> dict:
        """Each optimizer's open group (batches), the steps it took no part in, and the group's items if counted."""
        own = {"accumulated": list(self._open), "skipped_steps": list(self._skipped)}
        return own if self._items is None else {**own, "items": float(self._items), "ranks": self._ranks}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (an empty state, from a checkpoint that predates it, keeps every optimizer on
        ``state.optimizer_steps``, as all of them stepped together then)."""
        accumulated, skipped = state.get("accumulated"), state.get("skipped_steps")
        if accumulated is None or skipped is None:
            return
        if len(accumulated) != len(self._open) or len(skipped) != len(self._open):
            raise FitforgeValueError(
                f"GradientUpdateHandler: the checkpoint holds the state of {len(accumulated)} optimizer(s), "
                f"but the estimator has {len(self._open)}; resume with the optimizers it was written with"
            )
        self._open[:], self._skipped[:] = accumulated, skipped
        items = state.get("items")
        self._items = None if items is None or not max(accumulated) else torch.tensor(items)
        grads = [p.grad for p in self._choice.params_of(list(self._choice.every)) if p.grad is not None]
        if max(accumulated) and self._items is None and self._counting is not None and self._fitting:
            # An open group of batches that weighed alike: it ends so, and the next group is counted.
            self._uncounted_until_step, self.count_items = True, None
        if self._items is not None and self._counting is None:  # a counted group, in a run that does not count
            if grads:  # its summed losses' gradients as those of batch means: it ends weighing its batches alike
                torch._foreach_mul_(grads, max(accumulated) / float(self._items))
            self._items = None
        saved_ranks = state.get("ranks", self._ranks)
        if self._items is not None and saved_ranks != self._ranks:
            # Shares per rank of the ranks that saved them: their sums over this number of ranks must stay the same.
            share = saved_ranks / self._ranks
            self._items = self._items * share
            if grads:
                torch._foreach_mul_(grads, share)
