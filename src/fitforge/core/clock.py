"""Where a fit's wall-clock time went, by cause: :class:`RunClock`, ``state.run.clock``, which feeds the
History's ``time_<cause>_s`` columns (docs/handlers.md, "Where the time goes").

The loop times each training batch with the host's clock (no device read): the wait for the loader's
next batch (``data``), the step (``step``: forward, loss, backward, the optimizer's update), and the hooks
around it (``handlers``). Handlers whose work is a cause of its own report it: a validation, a
checkpoint's save (the time training stands still for it), a spike's rollback (the steps it undid, and
its own); a resume's restoring (``replay``: the checkpoint loaded, and for data without positions the
batches before it read and discarded); the first step of a compiled net beyond an ordinary step
(``compile``). ``train_begin``'s hooks are the handlers' too. The goodput is the step's share of the wall
clock, whose rest (the fit's checks and set-up before ``train_begin``, the loop's own work) no cause claims.

Each epoch's row gets the seconds since the row before, recorded before ``epoch_end``: the time of an
epoch's end (its validation, its checkpoint) counts in the next row. The run's totals, across resumes,
go in every checkpoint. On a GPU the host's clock sees the device's time where the host waits for it: in
a step that reads a value, or in the next data wait; the shares are of the host's wall clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fitforge.exceptions import FitforgeValueError

CAUSES = ("step", "data", "handlers", "validation", "checkpoint", "compile", "replay", "rollback", "quorum")
ALWAYS = ("step", "data", "handlers")  # in every History row; the others where the fit has their handlers
ADVICE = {  # what to try when a cause took much of a run's time
    "data": "give the DataLoader more num_workers (and persistent_workers=True; on a GPU, pin_memory=True), "
    "or make its __getitem__ cheaper",
    "checkpoint": "save in the background, CheckpointHandler(async_save=True), or less often (a larger "
    "batch_period or epoch_period)",
    "validation": "validate less often (ValidationHandler's epoch_period or batch_period) or on less data",
    "handlers": "fit(profile=True) times each handler in each event",
    "compile": "a longer run repays it, or Estimator(compile=False) saves it",
    "replay": "a resume loads its checkpoint (a local or smaller one loads faster) and, for data without "
    "batch positions, reads the batches before it again (a map-style DataLoader, or data with a state, skips that)",
    "rollback": "lower the learning rate, or raise SpikeGuardHandler's factor",
    "quorum": "every step waits for the slowest replica group and for round trips to the lighthouse: give the "
    "groups equal machines and larger steps (a larger batch_size), see docs/distributed.md#fault-tolerance",
}


def history_key(cause: str) -> str:
    return f"time_{cause}_s"


class RunClock:
    """``state.run.clock``: the seconds of the fit by cause, this epoch's and the run's (across resumes).

    Handlers time a cause of their own with ``with state.run.clock.timing("validation"): ...``.
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.epoch = dict.fromkeys(CAUSES, 0.0)  # since the last History row
        self.before: dict[str, float] = {}  # the run's before this fit (a resume's checkpoint), "wall" included
        self._done = dict.fromkeys(CAUSES, 0.0)  # this fit's, in its History rows
        self.causes: tuple[str, ...] = ALWAYS  # those the History rows record (a resume's replay: the totals only)
        self.last = 0.0  # the batch's last mark (the loop's, to_step's, to_hooks')
        self.in_step = False  # whether the time since then is a step's
        self.waited = self.stepping = self.hooked = 0.0  # the open pass's seconds, added by the loop batch by batch
        self._pass_reported = 0.0  # :attr:`reported` when the open pass began
        self.reported = 0.0  # the seconds of the causes reported within hooks, ever (the hooks' own are the rest)
        self._undone = 0.0  # seconds of steps a rollback undid, not yet taken out of the step's
        self._stepped = 0.0  # this fit's seconds in the steps of its closed passes, undone ones included

    @contextmanager
    def timing(self, cause: str) -> Iterator[None]:
        """Add the block's seconds to ``cause`` (one of :data:`CAUSES`); in a hook, they are not the hooks'."""
        if cause not in CAUSES:
            raise FitforgeValueError(f"RunClock.timing: cause must be one of {CAUSES}, got {cause!r}")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(cause, time.perf_counter() - started)

    def add(self, cause: str, seconds: float) -> None:
        self.epoch[cause] += seconds
        if cause != "handlers":  # a cause timed within hooks: not the hooks' own time
            self.reported += seconds

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """The block's seconds (hooks) to ``handlers``, but for the causes reported within it."""
        started, reported = time.perf_counter(), self.reported
        try:
            yield
        finally:
            self.add("handlers", max(0.0, time.perf_counter() - started - (self.reported - reported)))

    def to_step(self, state: Any) -> None:
        """A mark in a batch's hooks: the time since the last mark was the hooks', a step's from here."""
        now = time.perf_counter()
        self.hooked += now - self.last
        self.last, self.in_step = now, True

    def to_hooks(self, state: Any) -> None:
        """A mark in a batch's hooks: the time since the last mark was the step's, the hooks' from here."""
        now = time.perf_counter()
        self.stepping += now - self.last
        self.last, self.in_step = now, False

    def within_data(self, cause: str, seconds: float) -> None:
        """``seconds`` of the wait for the next batch were ``cause``'s (a quorum formed as the batch is read)."""
        self.epoch[cause] += seconds
        self.waited -= seconds

    def end_batch(self, now: float) -> None:
        """A batch's end (``now``), also where it raised: the time since its last mark to the step or the hooks."""
        if self.in_step:  # a step cancelled from within (a guard's CancelBatch at backward_end)
            self.stepping += now - self.last
            self.in_step = False
        else:
            self.hooked += now - self.last

    def open_batches(self) -> float:
        """The start of a pass over batches, whose seconds the loop adds batch by batch; returns the time."""
        self._pass_reported = self.reported
        return time.perf_counter()

    def close_batches(self) -> None:
        """The end of a pass over batches: its seconds go to the epoch's."""
        for cause, seconds in self._open_pass().items():
            self.epoch[cause] += seconds
        self._undone = 0.0  # never more than the pass's steps
        self._stepped += self.stepping
        self.waited = self.stepping = self.hooked = 0.0

    def _open_pass(self) -> dict[str, float]:
        """The open pass's seconds by cause: the hooks' but for causes reported within them (a checkpoint's),
        the steps' but for those a rollback undid."""
        return {
            "data": self.waited,
            "step": self.stepping - min(self._undone, self.stepping),
            "handlers": max(0.0, self.hooked - (self.reported - self._pass_reported)),
        }

    def steps_so_far(self) -> float:
        """This fit's seconds in steps until now (a rollback's measure of the steps it undoes)."""
        return self._stepped + self.stepping

    def undo(self, seconds: float) -> None:
        """A rollback undid ``seconds`` of steps (and took some itself, within a step's time): the rollback's, taken
        from the open pass's steps, then from the open row's; steps of rows already written stay steps."""
        from_pass = min(seconds, self.stepping - self._undone)
        from_row = min(seconds - from_pass, self.epoch["step"])
        self._undone += from_pass
        self.epoch["step"] -= from_row
        self.add("rollback", from_pass + from_row)
        self.reported -= from_pass + from_row  # no time of the hooks: the batches' own

    def record_epoch(self, history: Any) -> None:
        """Put the seconds since the last row in ``history``'s open row, before ``epoch_end`` (which loggers
        write): an epoch's end (its validation, its checkpoint) counts in the next row."""
        for cause, seconds in self.epoch.items():
            if cause in self.causes:
                history.record(history_key(cause), seconds)
            self._done[cause] += seconds
        self.epoch = dict.fromkeys(CAUSES, 0.0)

    def first_step(self, seconds: float, steps: int, compiled: bool) -> None:
        """The epoch's first step took ``seconds`` of its ``steps``: beyond an ordinary one, a compiled net's
        compilation."""
        if compiled:
            ordinary = (self.epoch["step"] - seconds) / (steps - 1) if steps > 1 else 0.0
            extra = max(0.0, seconds - ordinary)
            self.epoch["step"] -= extra
            self.epoch["compile"] += extra

    def totals(self) -> dict[str, float]:
        """The run's seconds by cause, and ``wall`` (this fit's from its start, and earlier fits' of the run)."""
        open_pass = self._open_pass()
        totals = {c: self.before.get(c, 0.0) + self._done[c] + self.epoch[c] + open_pass.get(c, 0.0) for c in CAUSES}
        totals["wall"] = self.before.get("wall", 0.0) + time.perf_counter() - self.started
        return totals

    def state_dict(self) -> dict[str, float]:
        return self.totals()

    def load_state_dict(self, totals: dict[str, float]) -> None:
        self.before = {key: float(value) for key, value in totals.items()}


def goodput(totals: dict[str, float]) -> tuple[float, str | None, float]:
    """``(the step's share of the wall clock, the cause that lost the most, its share)``; ``"other"`` is the time
    no cause claims (the fit's checks and set-up before ``train_begin``, the loop's own work)."""
    wall = totals.get("wall", 0.0)
    if wall <= 0:
        return 1.0, None, 0.0
    losses = {cause: totals.get(cause, 0.0) for cause in CAUSES if cause != "step"}
    losses["other"] = max(0.0, wall - sum(totals.get(cause, 0.0) for cause in CAUSES))
    top = max(losses, key=losses.__getitem__)
    return totals.get("step", 0.0) / wall, (top if losses[top] > 0 else None), losses[top] / wall


def compiled(net: Any) -> bool:
    """Whether ``net`` runs compiled: by ``Estimator(compile=...)``, or a ``torch.compile``'d module."""
    return getattr(vars(net).get("forward"), "fitforge_compiled", False) or hasattr(net, "_orig_mod")
