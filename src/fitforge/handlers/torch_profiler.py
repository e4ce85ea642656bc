"""ProfilerHandler: ``torch.profiler`` traces of a few scheduled training steps, as Chrome trace files.

Not ``fit(profile=True)`` (:mod:`fitforge.tools.profiler`), which times each handler's hooks on the host over
the whole fit: this one records what torch ran (operators, kernels, memory) in the steps it is asked for.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from fitforge.core.events import BatchEnd, EpochBegin, Stage, TrainBegin, TrainEnd
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import (
    FitforgeTypeError,
    FitforgeValueError,
    check_flag,
    check_non_negative,
    check_positive,
    describe,
)

log = logging.getLogger("fitforge")

DEFAULT_FOLDER = Path("runs", "profile")  # without a log_dir or a local checkpoint folder to sit beside
_NEVER = sys.maxsize  # no window left: batch_end's one comparison never passes


class ProfilerHandler(TrainBegin, EpochBegin, BatchEnd, TrainEnd):
    """Trace training steps with ``torch.profiler`` on ``torch.profiler.schedule``'s plan: ``wait`` steps
    idle, ``warmup`` steps with the profiler started but not recording, ``active`` steps recorded; ``repeat``
    such cycles (0: until the fit ends). Each cycle's ``active`` steps become one Chrome trace,
    ``rank<R>.<time ns>.pt.trace.json``, the file ``torch.profiler.tensorboard_trace_handler`` writes
    (TensorBoard's profiler plugin, Perfetto and ``chrome://tracing`` open it); in it, each step is
    ``ProfilerStep#<global_step>``. Steps are counted from the fit's first batch (a resumed fit's too).

    Outside its cycles' warmup and active steps the profiler is not running: the handler then costs one
    comparison per batch, and after its last cycle it never acts again. A cycle the fit's end cuts short is
    written with the steps it recorded. (``fit(profile=True)`` is another tool: the host time of each
    handler's hooks over the whole fit.)

    Args:
        wait: steps before each cycle's warmup, untouched.
        warmup: steps with the profiler started, not recorded (its start-up cost stays out of the trace).
        active: steps recorded, one trace per cycle.
        repeat: cycles; 0 repeats them until the fit ends.
        log_dir: the traces' folder (created when the first is written). None: ``profile`` beside the
            local folder of the fit's ``CheckpointHandler`` (``runs/a/checkpoints`` gives ``runs/a/profile``),
            else ``runs/profile``.
        ranks: under torch.distributed, the ranks traced; None: every rank.
        record_shapes, profile_memory, with_stack: ``torch.profiler.profile``'s options.

    Attributes:
        folder: where the last fit wrote (or would write) its traces.
        traces: the files the last fit wrote, oldest first.

    Example:
        >>> from fitforge.handlers import ProfilerHandler
        >>> tracer = ProfilerHandler(wait=1, warmup=1, active=2, repeat=2, log_dir="runs/profile")
        >>> history = estimator.fit(train, epochs=1, event_handlers=[tracer])  # doctest: +SKIP
    """

    _running: ClassVar[ProfilerHandler | None] = None  # the one whose cycle runs torch's profiler (one per process)
    # Last among every event's handlers: a step's trace holds all of its batch_end hooks.
    priority = Stage.REPORT + 1
    reads = ("estimator", "global_step", "run", "services")
    writes = ()

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        log_dir: str | os.PathLike | None = None,
        ranks: Iterable[int] | None = (0,),
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        owner = "ProfilerHandler"
        for name, value in (("wait", wait), ("warmup", warmup), ("repeat", repeat)):
            check_non_negative(owner, name, value)
        check_positive(owner, "active", active)
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise FitforgeTypeError(f"{owner}: log_dir must be a folder path or None, got {describe(log_dir)}")
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.ranks = _checked_ranks(ranks)
        self.record_shapes = check_flag(owner, "record_shapes", record_shapes)
        self.profile_memory = check_flag(owner, "profile_memory", profile_memory)
        self.with_stack = check_flag(owner, "with_stack", with_stack)
        self.folder: Path | None = None
        self.traces: list[Path] = []
        self._profiler: profile | None = None
        self._activities: list[ProfilerActivity] = [ProfilerActivity.CPU]
        self._rank, self._traced = 0, False
        self._origin: int | None = None  # the fit's first global step; None until its first epoch_begin
        self._cycle = 0  # cycles begun this fit
        self._first = self._last = 0  # the global steps of the current cycle's first warmup and last active step
        self._next = _NEVER  # the global step whose batch_end acts next (an evaluation's batches: never)

    def train_begin(self, state: TrainState) -> None:
        self._close()
        self.traces, self._cycle, self._origin, self._next = [], 0, None, _NEVER
        self._rank = state.run.ranks.rank
        self._traced = self.ranks is None or self._rank in self.ranks
        self._activities = _activities(state.estimator.device)
        self.folder = self.log_dir or _beside_checkpoints(state.services)

    def epoch_begin(self, state: TrainState) -> None:
        if self._origin is not None or not self._traced:
            return
        self._origin = state.global_step  # after a resume, which comes after train_begin
        self._plan_cycle()
        if self._next < self._origin:  # the first cycle warms up on the fit's first batch: no batch_end before it
            self._start()

    def batch_end(self, state: TrainState) -> None:
        if state.global_step < self._next:  # the one comparison outside the cycles
            return
        step = state.global_step
        if self._profiler is not None:
            if step < self._last:
                self._profiler.step()
                self._next = step + 1
                return
            self._stop()  # plans the next cycle, which may start right away (wait=0)
        if step >= self._next:  # the step before a cycle's first warmup step
            self._start()

    def train_end(self, state: TrainState) -> None:
        if self._profiler is not None:
            log.info(
                "ProfilerHandler: the fit ended inside a profiling cycle; the steps it recorded are written, the "
                "last label after them (ProfilerStep#%d) holding the fit's end, not a batch",
                state.global_step,
            )
        self._close()
        self._next = _NEVER

    def _plan_cycle(self) -> None:
        """Set ``_next`` to the step before the next cycle's first warmup step, or to never after the last."""
        if self._origin is None or (self.repeat and self._cycle >= self.repeat):
            self._next = _NEVER
            return
        length = self.wait + self.warmup + self.active
        self._first = self._origin + self._cycle * length + self.wait
        self._last = self._first + self.warmup + self.active - 1
        self._next = self._first - 1

    def _start(self) -> None:
        if ProfilerHandler._running is not None or torch.autograd._profiler_enabled():
            log.warning(
                "ProfilerHandler: another profiler is running in this process (%s), and torch runs one at a "
                "time; this fit is not traced from step %d on",
                ProfilerHandler._running or "torch.profiler",
                self._first,
            )
            self._next = _NEVER
            return
        self._cycle += 1
        prof = profile(
            activities=self._activities,
            schedule=_cycle_actions(self._first, self.warmup, self.active),
            on_trace_ready=self._export,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        prof.step_num = self._first  # the steps' labels: ProfilerStep#<global step>
        prof.__enter__()
        self._profiler, self._next, ProfilerHandler._running = prof, self._first, self

    def _stop(self) -> None:
        self._close()  # writes the trace (the schedule's last action saves it)
        self._plan_cycle()

    def _close(self) -> None:
        prof, self._profiler = self._profiler, None
        if prof is not None:
            ProfilerHandler._running = None
            prof.__exit__(None, None, None)

    def _export(self, prof: profile) -> None:
        assert self.folder is not None  # set at train_begin
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self._rank}.{time.time_ns()}.pt.trace.json"  # a fresh name: no run overwritten
        prof.export_chrome_trace(str(path))
        self.traces.append(path)
        first, last = self._first + self.warmup, prof.step_num
        log.info("ProfilerHandler: %s traced to %s", f"step {last}" if first == last else f"steps {first}-{last}", path)

    def __repr__(self) -> str:
        return (
            f"ProfilerHandler(wait={self.wait}, warmup={self.warmup}, active={self.active}, repeat={self.repeat}, "
            f"log_dir={None if self.log_dir is None else str(self.log_dir)!r})"
        )


def _cycle_actions(first: int, warmup: int, active: int) -> Callable[[int], ProfilerAction]:
    """The schedule of one cycle whose first warmup step is the global step ``first``. The profile asks for
    its step 0 when built, before its steps are numbered from ``first``: steps before ``first`` count as it."""

    def action(step: int) -> ProfilerAction:
        into = max(step - first, 0)
        if into < warmup:
            return ProfilerAction.WARMUP
        if into < warmup + active - 1:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if into == warmup + active - 1 else ProfilerAction.NONE

    return action


def _activities(device: torch.device) -> list[ProfilerActivity]:
    """The host's operators, and the device's kernels where torch's profiler traces that kind of device."""
    activities = [ProfilerActivity.CPU]
    kind = getattr(ProfilerActivity, device.type.upper(), None)  # CUDA, XPU, MTIA, HPU...
    if kind not in (None, ProfilerActivity.CPU) and kind in torch.profiler.supported_activities():
        activities.append(kind)
    return activities


def _beside_checkpoints(services: Services) -> Path:
    """``profile`` beside the local folder of the fit's first checkpoint saver, else :data:`DEFAULT_FOLDER`."""
    for saver in services.checkpoints:
        saved = saver.saved_checkpoints()
        if saved is not None and isinstance(saved.root, Path):
            return saved.root.parent / "profile"
    return DEFAULT_FOLDER


def _checked_ranks(ranks: Iterable[int] | None) -> frozenset[int] | None:
    if ranks is None:
        return None
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise FitforgeTypeError(
            f"ProfilerHandler: ranks must be the ranks to trace, e.g. (0,) or [0, 4], or None for every rank; "
            f"got {describe(ranks)}"
        )
    chosen = tuple(ranks)
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in chosen):
        raise FitforgeTypeError(f"ProfilerHandler: ranks must hold ints, e.g. (0,), got {describe(ranks)}")
    if not chosen or min(chosen) < 0:
        raise FitforgeValueError(
            f"ProfilerHandler: ranks must hold one or more non-negative ints, e.g. (0,), or be None for every "
            f"rank; got {describe(ranks)}"
        )
    return frozenset(chosen)
