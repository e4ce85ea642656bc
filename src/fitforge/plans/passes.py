"""The plans of one-pass runs: an evaluation (``evaluate``, and each validation of a fit) and a
prediction (``predict``, ``predict_batches``). Each checks its data (arrays batched, split between
ranks or read in dataset order), the placement of ``val_net`` and its handlers once; the first batch
of its first pass is explained (:mod:`fitforge.checks.first_batch`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from fitforge.checks.first_batch import first_batch_check
from fitforge.checks.model import check_placement
from fitforge.checks.validation import check_first_val_batch
from fitforge.core.batches import rows_of
from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import EventHandler, offered
from fitforge.core.loop import pass_batches, run_pass
from fitforge.core.processor import bound_step
from fitforge.core.run import RunContext, Step
from fitforge.core.services import Services
from fitforge.core.state import EstimatorLike, RunControl, TrainState
from fitforge.distributed.data_split import gather_predictions, in_dataset_order, shard_eval
from fitforge.distributed.ranks import on_this_rank, processes, rank
from fitforge.evaluation import Evaluation
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.handlers.defaults import evaluate_handlers, user_handlers
from fitforge.inputs.arrays import eval_loader
from fitforge.inputs.order import OnePass
from fitforge.inputs.prediction import Predictions
from fitforge.inputs.sources import check_data

_DONE = object()  # the end of a pass that a stream steps through


def evaluation_of(
    estimator: EstimatorLike,
    val_data: Any,
    event_handlers: Sequence[EventHandler] | None = None,
    batch_size: Any = None,
    prefix: Any = "val",
    name: str = "val_data",
    passes: int | None = 1,
    judged: tuple[int | None] | None = None,
    placed: bool = False,
    checked: bool = False,
) -> tuple[Evaluation, Iterable]:
    """An :class:`~fitforge.evaluation.Evaluation` of ``val_data`` set up and checked, and the data
    unsplit between ranks (for a check before training). Already checked: the data with ``judged``
    (``(its length,)``), ``val_net``'s device with ``placed``, the first batch with ``checked``."""
    own_prefix = None if check_prefix(prefix) == "val" else prefix  # None: the phase's own, val
    data = unsplit = eval_loader(val_data, batch_size, "val_data")
    num_batches = check_data(data, name, passes) if judged is None else judged[0]
    sharded = False
    if estimator.splits_data:
        data, sharded = shard_eval(data, padded=estimator.strategy.collective_forward)
        num_batches = len(data) if sharded else num_batches  # type: ignore[arg-type]
    if not placed:
        check_placement(estimator, "val_net")
    first = None if checked else _explained
    return Evaluation(
        estimator, data, num_batches, evaluate_handlers(event_handlers), own_prefix, sharded, first
    ), unsplit


def _explained(step: Step, checks: Sequence[Callable[[TrainState], None]]) -> Step:
    return first_batch_check(step, checks, "val_data", "validate")


def check_first_batch_of(
    estimator: EstimatorLike, val_data: Iterable, name: str, event_handlers: Sequence[EventHandler] | None
) -> None:
    """``Estimator.check_first_val_batch``: a first batch of ``val_data`` evaluated through an
    evaluation's step and handlers (:func:`fitforge.checks.validation.check_first_val_batch`)."""
    step = bound_step(estimator.batch_processor, estimator, "evaluate_batch")
    checks = offered(evaluate_handlers(event_handlers), Services()).first_batch_checks
    check_first_val_batch(estimator, eval_loader(val_data, None, name), name, checks, step)  # arrays batched


class PredictPlan(NamedTuple):
    """What a prediction runs with, once every check passed: its outputs' keeper, state and run, and
    the number of rows of the dataset its ranks split (None: not split)."""

    predictions: Predictions
    state: TrainState
    run: RunContext
    split_rows: int | None

    def run_all(self) -> Any:
        """Every output, joined on the CPU; split between ranks, rank 0 gets them all (None elsewhere)."""
        estimator = self.state.estimator
        with estimator.strategy.evaluating(estimator.val_net, estimator.weight_average):
            run_pass(self.state, self.run)
        joined = self.predictions.joined(estimator.device)
        if self.split_rows is not None:  # rank 0 gets every rank's outputs (an empty share sends None)
            joined = gather_predictions(joined, self.split_rows)
            if joined is None and rank() != 0:
                return None
        if joined is None:
            raise FitforgeValueError("predict produced no output: every batch was cancelled")
        return joined

    def stream(self) -> Iterator[Any]:
        """Each batch's outputs as they are computed, none kept; between batches the caller's code runs
        with the net's modes as they were. Left early, the pass ends where it was."""
        estimator = self.state.estimator
        passing = pass_batches(self.state, self.run)
        try:
            while True:
                with estimator.strategy.evaluating(estimator.val_net, estimator.weight_average):
                    more = next(passing, _DONE) is not _DONE
                yield from self.predictions.take()
                if not more:
                    return
        finally:
            passing.close()


def plan_predict(
    estimator: EstimatorLike, data: Any, event_handlers: Any, batch_size: Any, stream: bool = False
) -> PredictPlan:
    """The checks of predict (the data, the placement of ``val_net``, the handlers) and its plan; the
    first batch's errors explained. ``stream``: outputs handed over batch by batch, not kept."""
    predictions = Predictions(
        bound_step(estimator.batch_processor, estimator, "predict_batch"), estimator.non_blocking, estimator.device
    )
    data = eval_loader(data, batch_size, "data", bare=True)
    num_batches = check_data(data, "data", passes=1)
    sharded = False
    if estimator.splits_data:
        data, sharded = shard_eval(data, padded=estimator.strategy.collective_forward)
        num_batches = len(data) if sharded else num_batches
    else:
        data = in_dataset_order(data)
    check_placement(estimator, "val_net")
    dispatcher = Dispatcher(on_this_rank(user_handlers(event_handlers)))
    check = first_batch_check(predictions.step, (), "data", "predict")  # predict changes nothing: errors explained
    if not stream:  # predict keeps every output: into tensors of the whole size where it is known
        predictions.expect_rows(rows_of(data))
    state = TrainState(estimator, "predict", num_batches=num_batches, run=RunControl(ranks=processes()))
    run = RunContext(dispatcher, predictions.step, OnePass(data), "data", check, allow_empty=sharded)
    return PredictPlan(predictions, state, run, len(data.dataset) if sharded else None)


def check_prefix(prefix: object) -> str:
    """Return ``prefix``, a non-empty identifier-like str without a trailing ``_`` (``"val"``,
    ``"holdout_2"``; the keys are ``<prefix>_loss``...); else FitforgeTypeError/FitforgeValueError."""
    if not isinstance(prefix, str):
        raise FitforgeTypeError(f"evaluate: prefix must be a str such as 'val' or 'test', got {describe(prefix)}")
    if not (prefix.isidentifier() and prefix.isascii() and prefix[0].isalpha() and not prefix.endswith("_")):
        stripped = prefix.rstrip("_")
        valid = stripped.isidentifier() and stripped.isascii() and stripped[:1].isalpha()
        hint = f"; the '_' is added: pass {stripped!r}" if prefix.endswith("_") and valid else ""
        raise FitforgeValueError(
            f"evaluate: prefix must be a non-empty name of letters, digits and '_' that starts with a letter "
            f"and does not end in '_' (the keys are '<prefix>_loss', '<prefix>_<metric>'), got {prefix!r}{hint}"
        )
    return prefix
