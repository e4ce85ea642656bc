"""ScheduleHandler: any optimizer hyper-parameter (momentum, weight decay...) as a function of training progress."""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fitforge.core.events import BatchEnd, EpochBegin, Event, Stage, TrainBegin
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.optim.schedules import fit_steps, own_steps, scheduled_optimizer, step_counter, warn_taking_turns

log = logging.getLogger("fitforge")
_ENTRY = re.compile(r"^(?P<key>[A-Za-z_]\w*)(\[(?P<index>\d+)\])?$")  # "momentum", "betas[0]"


class ScheduleHandler(TrainBegin, EpochBegin, BatchEnd):
    """Set optimizer hyper-parameters from functions of training progress, from 0 (the fit's first optimizer step)
    to 1 (its last). A key names a param-group setting (``"momentum"``) or a tuple entry (``"betas[0]"``).

    Args:
        schedules: ``{key: function(progress) -> value}`` (a real number).
        interval: ``"batch"``, a new value before every optimizer step, or ``"epoch"``, one at each epoch's start
            (from the steps taken before it: the last epoch's progress is below 1).
        optimizer: the index of the optimizer in ``estimator.optimizers``.
        groups: the indices of the param groups to set (None: all).
        total_steps: the optimizer's steps in the fit, for optimizers stepped by turns (``BatchOutput.step``).
    """

    priority = Stage.PERSIST
    reads = ("optimizer_steps", "num_batches", "run", "services", "batch_idx")
    writes = ("estimator",)  # its optimizers' settings: a checkpoint (after it) holds the values set

    def __init__(
        self,
        schedules: Mapping[str, Callable[[float], Any]],
        interval: str = "batch",
        optimizer: int = 0,
        groups: Sequence[int] | None = None,
        total_steps: int | None = None,
    ) -> None:
        if not isinstance(schedules, Mapping) or not schedules:
            raise FitforgeTypeError(
                f"ScheduleHandler: schedules must be a non-empty dict of key -> function(progress), got "
                f"{describe(schedules)}"
            )
        self._entries: dict[str, tuple[str, str | None]] = {}  # key -> setting, tuple index: ("betas", "0")
        for key, fn in schedules.items():
            match = _ENTRY.match(key) if isinstance(key, str) else None
            if match is None:
                raise FitforgeValueError(
                    f"ScheduleHandler: {key!r} is no param-group key: use a name such as 'momentum', or an entry "
                    "of a tuple by index such as 'betas[0]'"
                )
            if not callable(fn):
                raise FitforgeTypeError(
                    f"ScheduleHandler: the schedule of {key!r} must be a function, got {describe(fn)}"
                )
            self._entries[key] = match["key"], match["index"]
        if interval not in ("batch", "epoch"):
            raise FitforgeValueError(f"ScheduleHandler: interval must be 'batch' or 'epoch', got {interval!r}")
        if isinstance(optimizer, bool) or not isinstance(optimizer, int) or optimizer < 0:
            raise FitforgeTypeError(
                f"ScheduleHandler: optimizer must be an index into estimator.optimizers, got {describe(optimizer)}"
            )
        if groups is not None and (
            isinstance(groups, str)
            or not groups
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in groups)
        ):
            raise FitforgeTypeError(
                f"ScheduleHandler: groups must be a non-empty list of group indices (ints >= 0), got {describe(groups)}"
            )
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise FitforgeTypeError(
                f"ScheduleHandler: total_steps must be an int >= 1 or None, got {describe(total_steps)}"
            )
        self.schedules, self.interval, self.optimizer = dict(schedules), interval, optimizer
        self.groups = None if groups is None else list(groups)
        self.total_steps = total_steps
        self._warned_turns = False
        if interval == "epoch":  # nothing to do per batch
            self.handled_events = (Event.TRAIN_BEGIN, Event.EPOCH_BEGIN)
        self._total = 1
        self._applied_at = -1  # the optimizer steps the values were last set for

    def train_begin(self, state: TrainState) -> None:
        optimizer = scheduled_optimizer("ScheduleHandler", self.optimizer, state)
        groups = optimizer.param_groups
        indices = range(len(groups)) if self.groups is None else self.groups
        bad = [i for i in indices if not 0 <= i < len(groups)]
        if bad:
            raise FitforgeValueError(f"ScheduleHandler: groups {bad} are not among the optimizer's {len(groups)}")
        kind, settings = type(optimizer).__name__, groups[0]
        for name, index in self._entries.values():
            if name not in settings or name == "params":
                known = sorted(k for k in settings if k != "params")
                raise FitforgeValueError(f"ScheduleHandler: {kind} has no setting {name!r}; its settings: {known}")
            value = settings[name]
            if isinstance(value, bool) or value is None:
                raise FitforgeValueError(f"ScheduleHandler: {kind}'s {name!r} is {value!r}, no number to schedule")
            if index is None and isinstance(value, (tuple, list)):
                raise FitforgeValueError(
                    f"ScheduleHandler: {kind}'s {name!r} is a tuple {tuple(value)}: schedule its entries by index, "
                    f"{name}[0], {name}[1]"
                )
            if index is not None and (not isinstance(value, (tuple, list)) or int(index) >= len(value)):
                raise FitforgeValueError(f"ScheduleHandler: {kind}'s {name!r} is {value!r}, which has no entry {index}")
        self._indices = list(indices)  # looked up at each change: a resume's load_state_dict makes new groups
        self._total = self.total_steps or fit_steps(state, "ScheduleHandler", "pass batches=N to fit, or total_steps=N")
        self._applied_at, self._warned_turns, self._counter = -1, False, step_counter(state)

    def epoch_begin(self, state: TrainState) -> None:
        if self.interval == "epoch" and state.batch_idx >= 0:  # a resume continues this epoch: the
            self._applied_at = state.optimizer_steps  # optimizer's loaded state holds its values
            return
        self._apply(state)  # also the first values of a fit, after any resume restored its steps

    def batch_end(self, state: TrainState) -> None:
        if state.optimizer_steps != self._applied_at:  # an int compare per batch: values change per step
            self._apply(state)

    def _apply(self, state: TrainState) -> None:
        steps = own_steps(state, self._counter, self.optimizer)
        if steps != state.optimizer_steps and not self._warned_turns and self.total_steps is None:
            self._warned_turns = True
            warn_taking_turns("ScheduleHandler", self.optimizer, steps, state, self._total)
        groups = state.estimator.optimizers[self.optimizer].param_groups
        progress = min(1.0, steps / (self._total - 1)) if self._total > 1 else 1.0
        for key, fn in self.schedules.items():
            value = fn(progress)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()  # once per step or epoch, not per batch
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise FitforgeValueError(
                    f"ScheduleHandler: the schedule of {key!r} gave {describe(value)} at progress {progress:.4g}; it "
                    "must give a finite number"
                )
            for index in self._indices:
                _set(groups[index], *self._entries[key], float(value))
        self._applied_at = state.optimizer_steps

    def __repr__(self) -> str:
        return f"ScheduleHandler({sorted(self.schedules)}, interval={self.interval!r})"


def _set(group: dict, name: str, index: str | None, value: float) -> None:
    if index is None:
        group[name] = value
        return
    entries = list(group[name])
    entries[int(index)] = value
    group[name] = tuple(entries)
