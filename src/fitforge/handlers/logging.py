"""LoggingHandler: training progress through python ``logging`` under the ``fitforge`` logger."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable

from tqdm import tqdm

from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin, TrainEnd, acts_as, unwrapped
from fitforge.core.history import History
from fitforge.core.state import TrainState
from fitforge.core.summary import model_summary
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers.formatting import epoch_label, format_values, pass_label
from fitforge.handlers.nan_guard import NaNGuardHandler
from fitforge.handlers.progress_bar import ProgressBarHandler

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
    """Writes through ``tqdm.write`` so log lines do not tear a progress bar apart. It stands in
    only while the application has configured no logging, so lines never print twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if _configured_above():
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def ensure_console_output() -> None:
    """Show fitforge's INFO lines on stderr when the application configured no logging at all.

    A configured application (any handler on the ``fitforge`` logger or its ancestors) is left alone.
    """
    if log.hasHandlers():
        return
    handler = _TqdmStream()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def console_output_for(handlers: Iterable[object]) -> None:
    """:func:`ensure_console_output` now if ``handlers`` (those a fit runs in this process) hold a
    LoggingHandler: ``Estimator.fit`` calls it before anything in the fit logs, so the lines logged
    before the LoggingHandler's ``train_begin`` (a checkpoint's "resuming from ..." or "training
    from scratch", a monitor's mode) show in a fresh process too."""
    if any(acts_as(handler, LoggingHandler) for handler in handlers):
        ensure_console_output()


_GUARD_HINT = ", or add NaNGuardHandler() to stop at the first nan/inf batch loss (or skip such batches)"


def _plural(count: int | None, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {'batches' if noun == 'batch' else noun + 's'}"


class LoggingHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd):
    """Log a line per epoch (and per ``log_interval`` batches if an int), and a summary at the end.

    The fit starts with a line describing the model (:func:`fitforge.core.summary.model_summary`:
    parameters, size, device, precision) and one with the fit's length. A line shows every value
    recorded in its epoch, a non-finite one too (``train_loss=nan``); the first epoch with a
    non-finite loss also logs a warning. Values read as :mod:`fitforge.handlers.formatting` says
    (4 significant digits). Epochs are numbered over the estimator's fits (a second ``fit(epochs=2)``
    after 5 epochs logs epochs 6/7 and 7/7), and an epoch cut short is marked ``partial``, with the
    batches it trained (a resumed run logs the whole epoch when it finishes it).

    Args:
        log_interval: "epoch", or log running values every n batches (a host read each time).
        level: the logging level of the lines.
    """

    priority = Stage.REPORT
    run_after = (ProgressBarHandler,)  # an epoch's bar closes before its log line
    main_rank_only = True  # under torch.distributed, rank 0 reports for all
    reads = (
        "estimator",
        "phase",
        "epoch",
        "epochs_before",
        "batch_idx",
        "global_step",
        "epoch_finished",
        "preempted",
        "prefix",
        "max_epochs",
        "max_batches",
        "num_batches",
        "metrics",
        "history",
        "handlers",
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

    def shows_epoch_lines(self) -> bool:
        """Whether its epoch lines reach the log now: a progress bar then clears each finished bar,
        which the epoch's line replaces."""
        return log.isEnabledFor(self.level)

    def train_begin(self, state: TrainState) -> None:
        ensure_console_output()
        self._started = time.perf_counter()
        self._warned = False
        if not log.isEnabledFor(self.level):
            return  # silenced: no summary to build (it walks the parameters)
        log.log(self.level, "%s", model_summary(state.estimator))
        limit = _plural(state.max_epochs, "epoch") if state.max_epochs else _plural(state.max_batches, "batch")
        per_epoch = f", {_plural(state.num_batches, 'batch')} per epoch" if state.num_batches else ""
        before = f" ({_plural(state.epochs_before, 'epoch')} trained before)" if state.epochs_before else ""
        log.log(self.level, "Training for %s%s%s", limit, per_epoch, before)

    def batch_end(self, state: TrainState) -> None:
        if self.log_interval and (state.batch_idx + 1) % self.log_interval == 0:
            values = state.running_metrics()
            log.log(self.level, "[%s Batch %d] %s", epoch_label(state), state.batch_idx + 1, format_values(values))

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train":  # inside evaluate: its values, no history row
            ensure_console_output()  # evaluate has no train_begin
            log.log(self.level, "[%s] %s", pass_label(state), format_values(state.metrics))
            return
        # The values recorded in this epoch: a key without one (no validation this epoch) is left
        # out, a recorded nan (a diverged loss) is shown.
        history = state.history
        row = {key: value for key in history if (value := history.current(key)) is not None}
        seconds = row.pop("epoch_time", math.nan)
        row = {k: v for k, v in row.items() if not k.startswith("lr")}
        log.log(self.level, "[%s%s] %s (%.1fs)", epoch_label(state), _partial(state), format_values(row), seconds)
        if not self._warned:
            self._warn_if_diverged(state, row)

    def _warn_if_diverged(self, state: TrainState, row: dict[str, float]) -> None:
        """Once a fit: a loss that is nan or infinite (the values are on the host already)."""
        losses = [key for key, value in row.items() if "loss" in key.split("_") and not math.isfinite(value)]
        if not losses:
            return
        self._warned = True
        guarded = any(acts_as(handler, NaNGuardHandler) for handler in state.handlers)
        log.warning(
            "epoch %d: %s not finite; training may have diverged. Lower the learning rate%s",
            state.epoch + 1,
            " and ".join(f"{key}={row[key]}" for key in losses) + (" are" if len(losses) > 1 else " is"),
            "" if guarded else _GUARD_HINT,
        )

    def train_end(self, state: TrainState) -> None:
        history = state.history
        final = {key: _final(history, key) for key in history if key.startswith(("train_", "val_"))}
        log.log(
            self.level,
            "Finished: %s, %s in %.1fs (%s).%s",
            _plural(history.epochs, "epoch"),
            _plural(state.global_step, "batch"),
            time.perf_counter() - self._started,
            state.history.stop_reason or "completed",
            f" Final: {format_values(final)}" if final else "",
        )


def _partial(state: TrainState) -> str:
    """``, partial: 2 of 4 batches`` for an epoch cut short by a stop or a signal, else nothing."""
    if state.epoch_finished:
        return ""
    done = f"{state.batch_idx + 1} of {state.num_batches}" if state.num_batches else f"{state.batch_idx + 1}"
    # A CheckpointHandler (a resume source) saved the epoch's state, which a resumed run finishes.
    saved = any(callable(getattr(unwrapped(handler), "take_resume_checkpoint", None)) for handler in state.handlers)
    why = "" if state.preempted is None else "; interrupted, a resumed run finishes it" if saved else "; interrupted"
    return f", partial: {done} batches{why}"


def _final(history: History, key: str) -> float:
    """The value of the last epoch (a nan it recorded included), else the latest one before."""
    value = history.current(key)
    return history.last(key) if value is None else value
