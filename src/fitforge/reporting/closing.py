"""The closing line of a fit's log: how it ended, then the values that match the weights it left."""

from __future__ import annotations

import math
import signal

from fitforge.core.clock import ADVICE, goodput
from fitforge.core.history import History, is_speed
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.reporting.formatting import epoch_label, format_values

FT_COUNTS = ("ft_lost", "ft_joined", "ft_failed_steps")  # fitforge.fault_tolerance's History columns
_MESSAGE_LENGTH = 200  # an exception's message is cut here (its traceback follows in full)


def plural(count: int | None, noun: str) -> str:
    """``1 epoch``, ``3 epochs``, ``1 batch``, ``0 batches``."""
    return f"{count} {noun}" if count == 1 else f"{count} {'batches' if noun == 'batch' else noun + 's'}"


_LOST_TO = {
    "data": "waiting for data",
    "validation": "validation",
    "checkpoint": "checkpoint saves",
    "compile": "compilation",
    "replay": "restoring a resume",
    "rollback": "spike rollbacks",
    "quorum": "waiting for the replica groups",
    "handlers": "handlers",
    "other": "set-up and the loop's own work",
}
_ADVISED_SHARE, _ADVISED_SECONDS = 0.25, 1.0  # a cause this large (and long) gets its advice line


def goodput_sentence(state: TrainState) -> str:
    """``Goodput 81% (most lost: waiting for data, 12%).``: the run's share of training steps, across resumes."""
    share, top, lost = goodput(state.run.clock.totals())
    most = "" if top is None else f" (most lost: {_LOST_TO[top]}, {lost:.0%})"
    return f"Goodput {share:.0%}{most}."


def time_advice(state: TrainState) -> str | None:
    """What to try when one cause took a large share of the run (None: none did)."""
    totals = state.run.clock.totals()
    _, top, lost = goodput(totals)
    if top is None or top not in ADVICE or lost < _ADVISED_SHARE or lost * totals["wall"] < _ADVISED_SECONDS:
        return None
    return f"{_LOST_TO[top].capitalize()} took {lost:.0%} of the run's time: {ADVICE[top]}"


def finished_line(state: TrainState, seconds: float) -> str:
    """``Finished: 3 epochs, 12 batches in 0.1s (reached epochs=3). Final: train_loss=...``; after a
    resume, what this fit trained and where the run stands."""
    history = state.history
    reason = history.stop_reason or "completed"
    if state.run.preempted is not None and not reason.startswith("preempted"):  # a resume's history replaced it
        reason = f"preempted by {signal.Signals(state.run.preempted).name}"
    if state.run.resumed_at is None:
        line = (
            f"Finished: {plural(history.epochs, 'epoch')}, {plural(state.global_step, 'batch')} in {seconds:.1f}s "
            f"({reason})."
        )
    else:
        epochs, steps = state.run.resumed_at
        line = (
            f"Finished: {plural(state.global_step - steps, 'batch')} in {seconds:.1f}s, resumed after "
            f"{plural(epochs, 'epoch')}, {plural(steps, 'batch')}; the run stands at "
            f"{plural(history.epochs, 'epoch')}, {plural(state.global_step, 'batch')} ({reason})."
        )
    return _with_values(f"{line} {goodput_sentence(state)}{_replica_groups(history)}", state)


def _replica_groups(history: History) -> str:
    """`` Replica groups: 3 at the end; 1 lost, 1 joined, 2 failed steps.`` for a fault-tolerant run."""
    if "ft_groups" not in history:
        return ""
    lost, joined, failed = (int(sum(v for v in history[key] if not math.isnan(v))) for key in FT_COUNTS)
    counts = f"{lost} lost, {joined} joined, {plural(failed, 'failed step')}"
    return f" Replica groups: {history.last('ft_groups')} at the end; {counts}."


def ended_line(state: TrainState, seconds: float) -> str:
    """``Pruned at the end of epoch 3/15 (...): <the stop's reason>. Final: ...``: a stop with an ending."""
    ending = state.run.stop_ending
    word = ending.word if ending is not None else "Stopped"
    counts = f"{plural(state.history.epochs, 'epoch')}, {plural(state.global_step, 'batch')} in {seconds:.1f}s"
    line = f"{word} {_position(state)} ({counts}): {state.history.stop_reason}. {goodput_sentence(state)}"
    return _with_values(line, state)


def _with_values(line: str, state: TrainState) -> str:
    """``line`` and the values of the epoch whose weights the net holds."""
    history = state.history
    restored = history.restored_epoch
    if restored is not None:
        values = {key: value for key in _reported(history) if not math.isnan(value := history[key][restored - 1])}
        return f"{line} Restored epoch {state.run.epochs_before + restored}: {format_values(values)}".rstrip()
    # the last epoch's value (a nan it recorded included), else the latest one before
    final = {key: history.last(key) if (now := history.current(key)) is None else now for key in _reported(history)}
    return f"{line} Final: {format_values(final)}" if final else line


def failed_line(state: TrainState, seconds: float) -> str:
    """``Failed in epoch 2/3 at batch 3 of 4 (...): RuntimeError: ...`` (``Interrupted`` for a SystemExit)."""
    error = state.run.error
    verb = "Failed" if isinstance(error, Exception) else "Interrupted"
    counts = f"{plural(state.global_step, 'batch')} completed, {plural(state.optimizer_steps, 'optimizer step')} taken"
    # fitforge's own refusal at the start: its message (the fix) comes whole with the error raised next
    place = "at the end of training" if state.run.training_over else _position(state)  # a train_end hook failed
    refused = isinstance(error, (FitforgeValueError, FitforgeTypeError)) and place.startswith("before epoch")
    return f"{verb} {place} ({counts}, {seconds:.1f}s): {type(error).__name__ if refused else raised(error)}"


def _position(state: TrainState) -> str:
    """Where the loop left the epochs: before an epoch, at its start or end, or at a batch."""
    label = epoch_label(state).replace("Epoch", "epoch")
    if state.history.epochs <= state.epoch:  # the epoch's row is not open: it has not begun
        return f"before {label}"
    if state.run.epoch_finished:  # its batches are over: an epoch_end hook (validation, a checkpoint...)
        return f"at the end of {label}"
    if state.batch_idx < 0:
        return f"at the start of {label}"
    of = f" of {state.num_batches}" if state.num_batches else ""
    return f"in {label} at batch {state.batch_idx + 1}{of}"


def raised(error: BaseException | None) -> str:
    """``ValueError: the first line of its message`` (cut to 200 characters), or the type alone."""
    name = type(error).__name__
    lines = str(error).strip().splitlines()
    if not lines:
        return name
    message = lines[0] + (" …" if len(lines) > 1 else "")
    if len(message) > _MESSAGE_LENGTH:
        message = message[: _MESSAGE_LENGTH - 2].rstrip() + " …"
    return f"{name}: {message}"


def _reported(history: History) -> list[str]:
    """The values of the summary: not the speeds, which say nothing of the weights it describes."""
    return [key for key in history if key.startswith(("train_", "val_")) and not is_speed(key)]
