"""throttle(): call a handler's batch or epoch hooks every n batches or epochs, or at most once per T seconds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from fitforge.core.dispatch import check_handler
from fitforge.core.events import (
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    Event,
    EventHandler,
    TrainBegin,
    TrainEnd,
    Wrapping,
    events_of,
    hook_of,
)
from fitforge.core.processes import Processes
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_positive, describe

_BATCH = (Event.BATCH_BEGIN, Event.BACKWARD_END, Event.BATCH_END)
_EPOCH = (Event.EPOCH_BEGIN, Event.EPOCH_END)
_OWN_READS = ("phase", "epoch", "batch_idx", "global_step", "run")  # what the wrapper reads to decide


class _Gate:
    """Decides once per batch (or epoch) whether the wrapped hooks run: the first hook of the pair decides, the
    second follows that decision, so a batch_begin is never without its batch_end."""

    def __init__(self, every: int | None, seconds: float | None, clock: Callable[[], float], agree: bool) -> None:
        self.every, self.seconds, self.clock, self.agree = every, seconds, clock, agree
        self.last = -math.inf  # clock time of the last call let through
        self.pending: bool | None = None  # the decision of a pair's first hook, for its second

    def open(self, position: int, ranks: Processes | None) -> bool:
        if self.every is not None and (position + 1) % self.every:
            return False
        if self.seconds is not None:
            now = self.clock()
            due = now - self.last >= self.seconds
            # Training: the ranks agree (a collective); evaluation shares may differ in length: each rank decides.
            if self.agree and ranks is not None and ranks.several:
                due = ranks.any(due)
            if not due:
                return False
            self.last = now
        return True

    def first(self, position: int, ranks: Processes | None) -> bool:
        self.pending = self.open(position, ranks)
        return self.pending

    def second(self, position: int, ranks: Processes | None) -> bool:
        """The first hook's decision, or (no first hook ran for this batch or epoch) a new one."""
        due, self.pending = self.pending, None
        return self.open(position, ranks) if due is None else due


def _agreeing(state: TrainState) -> Processes | None:
    """The processes that decide a batch's gate together: every rank in training, none elsewhere."""
    return state.run.ranks if state.phase == "train" else None


class Throttled(Wrapping, TrainBegin, EpochBegin, BatchBegin, BackwardEnd, BatchEnd, EpochEnd, TrainEnd):
    """The handler :func:`throttle` returns: called for the wrapped handler's events, it plays that handler's roles."""

    def __init__(
        self,
        handler: EventHandler,
        every_n_batches: int | None,
        every_n_epochs: int | None,
        seconds: float | None,
        clock: Callable[[], float],
    ) -> None:
        self.handler = handler
        self.every_n_batches, self.every_n_epochs = every_n_batches, every_n_epochs
        self.seconds, self.clock = seconds, clock
        # Its own place in the order and declared access: the wrapped handler's, and what it reads to decide.
        self.priority, self.run_after = handler.priority, tuple(handler.run_after or ())
        reads, writes = handler.reads, handler.writes
        self.reads = None if reads is None else tuple(reads) + tuple(r for r in _OWN_READS if r not in reads)
        self.writes = None if writes is None else tuple(writes)
        self.main_rank_only = handler.main_rank_only
        self._hooks = {event: hook_of(handler, event) for event in events_of(handler)}
        self.handled_events = tuple(self._hooks)
        self._gates()

    def _gates(self) -> None:
        # A handler every rank runs (a checkpoint: a collective) passes on every rank at once; a rank-0 one alone.
        agree = not self.main_rank_only
        self._batch = _Gate(self.every_n_batches, self.seconds, self.clock, agree)
        self._epoch = _Gate(self.every_n_epochs, self.seconds, self.clock, agree)

    @staticmethod
    def _batch_position(state: TrainState) -> int:
        # global_step in training (run-wide, resumed); in evaluate/predict (global_step 0) the position in the pass
        return state.global_step if state.phase == "train" else state.batch_idx

    def train_begin(self, state: TrainState) -> None:
        self._gates()
        self._hooks[Event.TRAIN_BEGIN](state)

    def epoch_begin(self, state: TrainState) -> None:
        if state.phase != "train" or self._epoch.first(state.epoch, state.run.ranks):
            self._hooks[Event.EPOCH_BEGIN](state)

    def batch_begin(self, state: TrainState) -> None:
        if self._batch.first(self._batch_position(state), _agreeing(state)):
            self._hooks[Event.BATCH_BEGIN](state)

    def backward_end(self, state: TrainState) -> None:
        # Training only: follow batch_begin's decision (or decide, without a batch_begin); batch_end follows this one.
        gate = self._batch
        due = (
            gate.pending
            if Event.BATCH_BEGIN in self._hooks
            else gate.open(self._batch_position(state), state.run.ranks)
        )
        gate.pending = due if Event.BATCH_END in self._hooks else None
        if due:
            self._hooks[Event.BACKWARD_END](state)

    def batch_end(self, state: TrainState) -> bool | None:
        due = self._batch.second(self._batch_position(state), _agreeing(state))
        return self._hooks[Event.BATCH_END](state) if due else None

    def epoch_end(self, state: TrainState) -> bool | None:
        if state.phase != "train" or self._epoch.second(state.epoch, state.run.ranks):
            return self._hooks[Event.EPOCH_END](state)
        return None

    def train_end(self, state: TrainState) -> None:
        self._hooks[Event.TRAIN_END](state)

    def state_dict(self) -> dict:
        """The wrapped handler's state (the wrapper keeps none worth saving)."""
        return self.handler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.handler.load_state_dict(state)

    def __repr__(self) -> str:
        options = {
            "every_n_batches": self.every_n_batches,
            "every_n_epochs": self.every_n_epochs,
            "seconds": self.seconds,
        }
        given = ", ".join(f"{name}={value}" for name, value in options.items() if value is not None)
        return f"throttle({self.handler!r}, {given})"


def throttle(
    handler: EventHandler,
    every_n_batches: int | None = None,
    every_n_epochs: int | None = None,
    seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Throttled:
    """Wrap ``handler`` so that its batch hooks run every ``every_n_batches`` batches (by ``global_step`` in
    training, by position in evaluate/predict), its epoch hooks every ``every_n_epochs`` training epochs, and/or each
    kind at most once per ``seconds``. A batch's (epoch's) begin and end hooks run together or not at all;
    ``train_begin``/``train_end`` always run. The wrapper keeps the handler's order, declared access, state and roles
    (docs/handlers.md).

    Args:
        handler: an event handler instance.
        every_n_batches: run the batch hooks every n batches.
        every_n_epochs: run the epoch hooks every n epochs.
        seconds: run each kind of hook at most once per this many seconds. Under torch.distributed the ranks agree
            each time (a host all-reduce) unless the handler reports from rank 0 only.
        clock: a function returning seconds (``time.monotonic``); inject a fake one in tests.
    """
    check_handler(handler, "throttle(handler)")
    if every_n_batches is None and every_n_epochs is None and seconds is None:
        raise FitforgeValueError(f"throttle({handler!r}) needs every_n_batches, every_n_epochs or seconds; got none")
    check_positive("throttle", "every_n_batches", every_n_batches, allow_none=True)
    check_positive("throttle", "every_n_epochs", every_n_epochs, allow_none=True)
    check_positive("throttle", "seconds", seconds, (int, float), allow_none=True)
    if not callable(clock):
        raise FitforgeTypeError(f"throttle: clock must be a function returning seconds, got {describe(clock)}")
    events = events_of(handler)
    has_batch, has_epoch = any(e in events for e in _BATCH), any(e in events for e in _EPOCH)
    for name, value, present, kind in (
        ("every_n_batches", every_n_batches, has_batch, "batch"),
        ("every_n_epochs", every_n_epochs, has_epoch, "epoch"),
        ("seconds", seconds, has_batch or has_epoch, "batch or epoch"),
    ):
        if value is not None and not present:
            raise FitforgeValueError(
                f"throttle: {name}={value} has nothing to throttle: {handler!r} has no "
                f"{kind} hooks (it handles {', '.join(e.value for e in events)})"
            )
    return Throttled(handler, every_n_batches, every_n_epochs, seconds, clock)
