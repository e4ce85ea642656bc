"""LoggingHandler: training progress through python ``logging`` under the ``fitforge`` logger."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time

from tqdm import tqdm

from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.reporting.closing import ended_line, failed_line, finished_line, plural, time_advice
from fitforge.reporting.formatting import epoch_label, format_values, pass_label
from fitforge.reporting.summary import model_summary

log = logging.getLogger("fitforge")


def _configured_above() -> bool:
    """Whether a logger above ``fitforge`` that its records reach has handlers of its own."""
    logger = log
    while logger.propagate and logger.parent is not None:
        logger = logger.parent
        if logger.handlers:
            return True
    return False


class _TqdmStream(logging.Handler):
    """Writes through ``tqdm.write`` so log lines do not tear a progress bar apart. It stands in only while the
    application has configured no logging, so lines never print twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if _configured_above():
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def ensure_console_output() -> None:
    """Show fitforge's INFO lines on stderr when the application configured no logging at all (no handler on the
    ``fitforge`` logger or its ancestors)."""
    if log.hasHandlers():
        return
    handler = _TqdmStream()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def flush_console() -> None:
    """Flush the streams of the handlers fitforge's records reach, and ``sys.stderr`` (the stand-in's ``tqdm.write``
    does not flush): in a notebook an unflushed last line would show after what the cell prints next."""
    logger: logging.Logger | None = log
    while logger is not None:
        for handler in logger.handlers:
            with contextlib.suppress(ValueError, OSError):  # a closed stream: nothing to push
                handler.flush()
        logger = logger.parent if logger.propagate else None
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()


def console_output_for(services: Services) -> None:
    """:func:`ensure_console_output` now if a handler of the fit prints epoch lines, so that what is logged before
    its ``train_begin`` (a checkpoint's "resuming from ...") shows in a fresh process too."""
    if services.epoch_lines:
        ensure_console_output()


_GUARD_HINT = ", or add NaNGuardHandler() to stop at the first nan/inf batch loss (or skip such batches)"


class LoggingHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd):
    """Log a line per epoch (and per ``log_interval`` batches if an int), and a summary at the end
    (docs/output.md, Log lines).

    Args:
        log_interval: "epoch", or log running values every n batches (a host read each time).
        level: the logging level of the lines.
    """

    priority = Stage.REPORT
    main_rank_only = True  # under torch.distributed, rank 0 reports for all
    reads = (
        "estimator",
        "phase",
        "epoch",
        "run",
        "batch_idx",
        "global_step",
        "optimizer_steps",
        "prefix",
        "num_batches",
        "metrics",
        "history",
        "services",
    )

    def __init__(self, log_interval: int | str = "epoch", level: int = logging.INFO) -> None:
        if log_interval != "epoch" and (
            isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 1
        ):
            raise (FitforgeValueError if isinstance(log_interval, (int, str)) else FitforgeTypeError)(
                f"LoggingHandler: log_interval must be 'epoch' or a positive int, got {log_interval!r}"
            )
        self.log_interval: int | None = None if log_interval == "epoch" else int(log_interval)
        self.level = level
        self._started = time.perf_counter()
        self._warned = False

    def offer(self, services: Services) -> None:
        services.epoch_lines.append(self.shows_epoch_lines)

    def shows_epoch_lines(self) -> bool:
        """Whether its epoch lines reach the log now (a progress bar then clears each finished bar for them)."""
        return log.isEnabledFor(self.level)

    def train_begin(self, state: TrainState) -> None:
        ensure_console_output()
        self._started = time.perf_counter()
        self._warned = False
        if not log.isEnabledFor(self.level):
            return  # silenced: no summary to build (it walks the parameters)
        log.log(self.level, "%s", model_summary(state.estimator))
        limit = (
            plural(state.run.max_epochs, "epoch") if state.run.max_epochs else plural(state.run.max_batches, "batch")
        )
        per_epoch = f", {plural(state.num_batches, 'batch')} per epoch" if state.num_batches else ""
        before = f" ({plural(state.run.epochs_before, 'epoch')} trained before)" if state.run.epochs_before else ""
        log.log(self.level, "Training for %s%s%s", limit, per_epoch, before)

    def batch_end(self, state: TrainState) -> None:
        if self.log_interval and (state.batch_idx + 1) % self.log_interval == 0:
            values = state.running_metrics()
            log.log(self.level, "[%s Batch %d] %s", epoch_label(state), state.batch_idx + 1, format_values(values))

    def epoch_end(self, state: TrainState) -> None:
        for end_bar in state.services.bars:  # the epoch's bar ends above its line, whatever the handlers' order
            end_bar(state)
        if state.phase != "train":  # inside evaluate: its values, no history row
            ensure_console_output()  # evaluate has no train_begin
            log.log(self.level, "[%s] %s", pass_label(state), format_values(state.metrics))
            flush_console()  # evaluate's one line, out before it returns
            return
        # This epoch's values: a key without one (no validation) is left out, a recorded nan (diverged) is shown.
        history = state.history
        row = history.current_row()
        seconds = row.pop("epoch_time", math.nan)
        row = {k: v for k, v in row.items() if not k.startswith(("lr", "time_"))}  # time by cause: the closing line
        if log.isEnabledFor(self.level):  # the line's arguments are built only to be shown
            partial = ""
            if not state.run.epoch_finished:  # cut short by a stop or a signal
                total = f" of {state.num_batches}" if state.num_batches else ""
                # A CheckpointHandler (a resume source) saved the epoch's state, which a resumed run finishes.
                saved = ", a resumed run finishes it" if state.services.checkpoints else ""
                why = "" if state.run.preempted is None else f"; interrupted{saved}"
                partial = f", partial: {state.batch_idx + 1}{total} batches{why}"
            log.log(self.level, "[%s%s] %s (%.1fs)", epoch_label(state), partial, format_values(row), seconds)
        # Once a fit: a loss that is nan or infinite (the values are on the host already).
        losses = [] if self._warned else [k for k, v in row.items() if "loss" in k.split("_") and not math.isfinite(v)]
        if losses:
            self._warned = True
            log.warning(
                "epoch %d: %s not finite; training may have diverged. Lower the learning rate%s",
                state.epoch + 1,
                " and ".join(f"{key}={row[key]}" for key in losses) + (" are" if len(losses) > 1 else " is"),
                "" if state.services.guards_nonfinite else _GUARD_HINT,
            )

    def train_end(self, state: TrainState) -> None:
        if not log.isEnabledFor(self.level):
            flush_console()  # no line to build; what others wrote still comes before what follows fit
            return
        seconds = time.perf_counter() - self._started
        # An exception is raised again after train_end (the line says where); a stop with an ending is no failure.
        line = (
            failed_line
            if state.run.error is not None
            else ended_line
            if state.run.stop_ending is not None
            else finished_line
        )
        advice = None if state.run.error is not None else time_advice(state)
        if advice is not None:  # before the closing line, which stays the fit's last
            log.log(self.level, "%s", advice)
        log.log(self.level, "%s", line(state, seconds))
        flush_console()  # before fit returns: what the caller prints next comes after these lines
