"""ValidationHandler: evaluates on held-out data every n epochs or n batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, EventHandler, Stage, TrainBegin
from fitforge.core.roles import KeyRecording, Validating, ValidationSetup, WeightAveraging
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, check_positive, describe


class ValidationHandler(TrainBegin, EpochBegin, BatchEnd, EpochEnd, Validating):
    """Run ``eval_fn(val_data, event_handlers=...)`` and merge its dict into the epoch's history row.

    Args:
        val_data: re-iterable validation batches, or arrays ``(X, y)`` (batched by 32; as they are for an ``eval_fn``).
        eval_fn: returns ``{"val_loss": ..., ...}``; default ``estimator.evaluate``.
        epoch_period: validate at the end of every n-th epoch (None: never at epoch end).
        batch_period: also validate after every n-th training batch (None: never mid-epoch).
        event_handlers: handlers for the evaluation run (never fit's).
        check_first: before training, evaluate a batch of the first few samples of ``val_data``; False skips it.
    """

    priority = Stage.METRICS
    run_after = (KeyRecording, WeightAveraging)  # after the training values and this step's weight average
    reads = ("estimator", "epoch", "global_step", "run", "batch_idx", "num_batches")
    writes = ("metrics", "history")

    def __init__(
        self,
        val_data: Iterable,
        eval_fn: Callable[..., dict] | None = None,
        epoch_period: int | None = 1,
        batch_period: int | None = None,
        event_handlers: Sequence[EventHandler] | None = None,
        check_first: bool = True,
    ) -> None:
        check_positive("ValidationHandler", "epoch_period", epoch_period, allow_none=True)
        check_positive("ValidationHandler", "batch_period", batch_period, allow_none=True)
        if epoch_period is None and batch_period is None:
            raise FitforgeValueError(
                "ValidationHandler: epoch_period and batch_period are both None, so it would never "
                "validate; set at least one of them"
            )
        if eval_fn is not None and not callable(eval_fn):
            raise FitforgeTypeError(
                "ValidationHandler: eval_fn must be callable (val_data, event_handlers=...) -> dict, "
                f"got {describe(eval_fn)}"
            )
        self.val_data, self.eval_fn = val_data, eval_fn
        self.epoch_period, self.batch_period = epoch_period, batch_period
        self.event_handlers = list(event_handlers or [])
        self.check_first = check_flag("ValidationHandler", "check_first", check_first)
        self.checked_first = False  # whether this fit checks val_data's first batch fully (check_first)
        self._evaluation: Callable[[], dict] | None = None  # this fit's validations, set up before training
        self._validated_at: int | None = None
        self._owed: int | None = None  # a batch_period validation a signal abandoned (completed batches)

    def validation_setup(self) -> ValidationSetup:
        """What fit checks and sets up before training: ``val_data``, and its evaluation unless ``eval_fn`` does it."""
        return ValidationSetup(
            self.val_data, tuple(self.event_handlers), self.check_first, bool(self.batch_period), self.eval_fn is None
        )

    def use_evaluation(self, evaluation: Callable[[], dict], checked: bool) -> None:
        self._evaluation, self.checked_first = evaluation, checked

    def train_begin(self, state: TrainState) -> None:
        self._validated_at = self._owed = None
        run, self._evaluation = self._evaluation, None  # this fit's: a later fit sets up its own
        if run is None:
            self._evaluate = self.eval_fn or state.estimator.evaluate
            return
        self._evaluate = lambda val_data, event_handlers: run()

    def epoch_begin(self, state: TrainState) -> None:
        if self._owed is not None:  # resumed after a signal abandoned it: where it was due, before the next batch
            self.validate(state)
            self._validated_at, self._owed = self._owed, None

    def batch_end(self, state: TrainState) -> None:
        if self.batch_period and (state.global_step + 1) % self.batch_period == 0:
            self._owed = state.global_step + 1  # completed batches once this one counts; owed until it is done
            self.validate(state)
            self._validated_at, self._owed = self._owed, None

    def epoch_end(self, state: TrainState) -> None:
        if state.run.epoch_suspended:
            return  # the epoch is not over: it resumes later (and the grace time is short)
        # An epoch ending right after a batch-period validation has the same weights: skip the repeat.
        if self.epoch_period and (state.epoch + 1) % self.epoch_period == 0 and self._validated_at != state.global_step:
            self.validate(state)

    def state_dict(self) -> dict:
        """When it last validated (so a resumed epoch does not validate the same weights twice), and the validation
        a signal abandoned, if any (the resumed run does it)."""
        return {"validated_at": self._validated_at, "owed": self._owed}

    def load_state_dict(self, state: dict) -> None:
        self._validated_at, self._owed = state["validated_at"], state.get("owed")  # no "owed": an older checkpoint

    def validate(self, state: TrainState) -> dict[str, float]:
        """Evaluate now and merge the result into ``state.metrics`` and the current history row."""
        with state.run.clock.timing("validation"):
            result = self._evaluate(self.val_data, event_handlers=self.event_handlers)
        if not isinstance(result, dict):
            raise FitforgeTypeError(f"eval_fn must return a dict of floats, got {describe(result)}")
        for key, value in result.items():
            state.metrics[key] = float(value)
            state.history.record(key, value)
        return result
