"""The checks before step 1, in the order they run: fit, evaluate and predict each call one function
here once and get back what the run needs, every input judged once.

fit (:func:`before_fit`):
    1. the data: arrays batched, ``epochs``/``batches``, ``train_data`` split between ranks and
       checked (re-iterable, not empty), ``val_data`` checked;
    2. the model: still on the estimator's device; a precision the CPU runs fast;
    3. the handlers: the user's checked, the defaults added, the stopping limits folded in;
       trainable parameters an optimizer holds; each validation set up and its first batch
       evaluated; monitored keys; the order (cycles, unordered writers, a monitor before its validation);
    4. the first training batch, checked inside its step (:mod:`fitforge.checks.first_batch`).
evaluate (:func:`evaluation_of`): the prefix, the data, the placement of ``val_net``, the handlers;
the first batch of the first pass explained.
predict (:func:`before_predict`): the data, the placement, the handlers; the first batch explained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fitforge.checkpoint.resume import resume_picked
from fitforge.checks.first_batch import first_batch_check
from fitforge.checks.model import check_placement, check_trainable, note_slow_precision
from fitforge.checks.monitors import check_monitor_order, check_monitors
from fitforge.checks.options import check_duration
from fitforge.checks.validation import check_first_val_batch
from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import Event, EventHandler, handler_name
from fitforge.core.processor import bound_step
from fitforge.core.roles import Stopping, Validating, WeightAveraging, players
from fitforge.core.run import RunContext, Step
from fitforge.core.services import Services
from fitforge.core.state import EstimatorLike, RunControl, TrainState
from fitforge.distributed.data_split import in_dataset_order, shard_eval, shard_train
from fitforge.distributed.ranks import on_this_rank
from fitforge.evaluation import Evaluation
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, describe
from fitforge.handlers.defaults import evaluate_handlers, fit_handlers, fit_services, user_handlers
from fitforge.handlers.logging import console_output_for
from fitforge.handlers.stopping import tighter_limit
from fitforge.inputs.arrays import eval_loader, fit_loaders
from fitforge.inputs.order import DataOrder
from fitforge.inputs.sources import check_data
from fitforge.tools.access_guard import guard


@dataclass(frozen=True)
class FitPlan:
    """What a fit runs with, once every check passed; :meth:`start` makes its state and run."""

    train_data: Iterable
    num_batches: int | None
    epochs: int | None
    batches: int | None
    dispatcher: Dispatcher
    step: Step
    check: Step
    profile: bool
    services: Services
    weight_average: WeightAveraging | None  # the one averaging handler evaluation uses, if any

    def start(self, estimator: EstimatorLike) -> tuple[TrainState, RunContext]:
        """The fit's state and run: its data order, and the agreement of its ranks on stops."""
        coordinator = estimator.strategy.coordinator(estimator)
        run = RunContext(
            self.dispatcher,
            self.step,
            DataOrder(self.train_data),
            "train_data",
            coordinator,
            (resume_picked,),
            check=self.check,
        )
        control = RunControl(self.epochs, self.batches, estimator.history.epochs, ranks=coordinator)
        state = TrainState(
            estimator, "train", num_batches=self.num_batches, services=self.services, run=control, _loop=run
        )
        return state, run


def before_fit(
    estimator: EstimatorLike,
    train_data: Any,
    val_data: Any,
    epochs: int | None,
    batches: int | None,
    event_handlers: Any,
    default_handlers: Any,
    check_access: Any,
    profile: Any,
    batch_size: Any,
    validation_split: Any,
) -> FitPlan:
    """The checks of a fit, in the order of the module docstring; raise before any step."""
    if isinstance(val_data, int):  # fit(data, 5): the 5 landed in val_data; say so before anything else
        check_data(val_data, "val_data", None)
    train_data, val_data = fit_loaders(train_data, val_data, batch_size, validation_split)
    check_duration(epochs, batches)
    passes = 1 if epochs == 1 else None
    if estimator.splits_data:
        train_data = shard_train(train_data)
    num_batches = check_data(train_data, "train_data", passes)
    checked = {} if val_data is None else {id(val_data): check_data(val_data, "val_data", passes)}
    check_placement(estimator, "net", "val_net")
    note_slow_precision(estimator)
    handlers = fit_handlers(event_handlers, val_data, default_handlers) + estimator.strategy.fit_handlers()
    services = fit_services(on_this_rank(handlers), estimator)
    console_output_for(services)  # before anything in fit logs (a resume, a monitor's mode)
    for stopper in players(handlers, Stopping):  # first: the validations' data is read once with epochs=1
        limits = stopper.run_limits()
        epochs, batches = tighter_limit(epochs, limits[0]), tighter_limit(batches, limits[1])
    check_trainable(estimator)  # before the validation check, whose forward may gather FSDP's parameters
    _set_up_validations(estimator, handlers, val_data, checked, epochs)
    left = check_monitors(handlers, estimator)
    guarded = check_flag("fit", "check_access", check_access)
    dispatcher = Dispatcher(on_this_rank(handlers), guard if guarded else None)
    if left:
        check_monitor_order(dispatcher.owners[Event.EPOCH_END], left)
    estimator.losses.train.arm_checks()
    step = bound_step(estimator.batch_processor, estimator, "fit_batch")
    check = first_batch_check(step, services.first_batch_checks, "train_data", "train")
    profile = check_flag("fit", "profile", profile)
    averaging = services.averages
    if len(averaging) > 1:
        raise FitforgeValueError(
            f"fit: {len(averaging)} handlers average the weights ({', '.join(map(handler_name, averaging))}), "
            "and evaluation runs with one average: pass one"
        )
    average = averaging[0] if averaging else None
    return FitPlan(train_data, num_batches, epochs, batches, dispatcher, step, check, profile, services, average)


def _set_up_validations(
    estimator: EstimatorLike,
    handlers: Sequence[EventHandler],
    val_data: Any,
    checked: dict[int, int | None],
    epochs: int | None,
) -> None:
    """Set up, once per fit before training, the evaluation each validating handler asks for, and check
    its first batch through its handlers and step; a handler validating by its own means: its data."""
    for validator in players(handlers, Validating):
        setup = validator.validation_setup()
        if setup is None:
            continue
        own = setup.val_data is val_data and id(val_data) in checked and not setup.mid_epoch
        name = "val_data" if setup.val_data is val_data else f"{type(validator).__name__} val_data"
        passes = 1 if epochs == 1 and not setup.mid_epoch else None  # a mid-epoch validation reads it more
        if not setup.by_estimator:  # its eval_fn takes the data as it is
            if not own:
                check_data(setup.val_data, name, passes)
            continue
        evaluation, unsplit = evaluation_of(
            estimator,
            setup.val_data,
            setup.event_handlers,
            name=name,
            passes=passes,
            judged=(checked[id(val_data)],) if own else None,
            placed=True,  # just checked for the net and val_net
        )
        first = setup.check_first and _checked_before(estimator, evaluation, unsplit, name)
        evaluation.check = None if first else evaluation.check
        validator.use_evaluation(evaluation, first)


def _checked_before(estimator: EstimatorLike, evaluation: Evaluation, data: Iterable, name: str) -> bool:
    return check_first_val_batch(estimator, data, name, evaluation.services.first_batch_checks, evaluation.step)


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


@dataclass
class PredictPlan:
    """What a predict pass runs with, once every check passed."""

    data: Iterable
    num_batches: int | None
    sharded: bool
    dispatcher: Dispatcher
    check: Step


def before_predict(
    estimator: EstimatorLike, data: Any, event_handlers: Any, batch_size: Any, step: Step
) -> PredictPlan:
    """The checks of predict: the data (arrays batched, split between ranks or read in dataset
    order), the placement of ``val_net``, the handlers; ``step``'s first batch explained."""
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
    check = first_batch_check(step, (), "data", "predict")  # predict changes nothing: the step's errors explained
    return PredictPlan(data, num_batches, sharded, dispatcher, check)


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
