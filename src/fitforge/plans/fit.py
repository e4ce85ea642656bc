"""The plan of a fit: its checks in the order they run, once, before step 1, and the run they plan.

1. the data: arrays batched, ``epochs``/``batches``, ``train_data`` split between ranks and checked
   (re-iterable, not empty), ``val_data`` checked;
2. the model: still on the estimator's device; a precision the CPU runs fast;
3. the handlers: the user's checked, the defaults added, the stopping limits folded in; trainable
   parameters an optimizer holds; each validation set up and its first batch evaluated; monitored
   keys; the order (cycles, unordered writers, a monitor before its validation);
4. the first training batch, checked inside its step (:mod:`fitforge.checks.first_batch`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from fitforge.checkpoint.resume import resume_picked
from fitforge.checks.first_batch import first_batch_check
from fitforge.checks.handlers import warn_unplayed_roles
from fitforge.checks.model import check_placement, check_trainable, note_slow_precision
from fitforge.checks.monitors import check_monitor_order, check_monitors
from fitforge.checks.options import check_duration
from fitforge.checks.validation import check_first_val_batch
from fitforge.core.coordinator import PassWatch
from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import Event, EventHandler, handler_name
from fitforge.core.history import History
from fitforge.core.loop import run_fit
from fitforge.core.modules import set_training
from fitforge.core.processor import bound_step
from fitforge.core.roles import Stopping, Validating, WeightAveraging, players
from fitforge.core.run import RunContext, Step
from fitforge.core.services import Services
from fitforge.core.state import EstimatorLike, RunControl, TrainState
from fitforge.distributed.ranks import on_this_rank
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, describe
from fitforge.handlers.defaults import fit_handlers, fit_services, timed_causes
from fitforge.handlers.logging import console_output_for
from fitforge.handlers.stopping import tighter_limit
from fitforge.inputs.arrays import fit_loaders
from fitforge.inputs.order import DataOrder
from fitforge.inputs.sources import check_data
from fitforge.optim.schedule_free import schedule_free_weights, to_train_mode
from fitforge.plans.passes import evaluation_of
from fitforge.reporting.compiling import CompileWatch
from fitforge.signals.preemption import Preemption
from fitforge.tools.access_guard import guard
from fitforge.tools.profiler import profiled


class FitPlan(NamedTuple):  # immutable, and cheaper to build than a frozen dataclass
    """What a fit runs with, once every check passed; :meth:`run` runs it."""

    train_data: Iterable
    num_batches: int | None
    epochs: int | None
    batches: int | None
    dispatcher: Dispatcher
    step: Step
    check: Step
    profile: bool
    sample_seeds: bool | None  # each sample read with its own seeds (fitforge.inputs.seeds); None: if resumable
    services: Services
    weight_average: WeightAveraging | None  # the one averaging handler evaluation uses, if any

    def run(self, estimator: Any, preemption: Preemption) -> TrainState:
        """Train as planned: the fit's state and run (its data order, its ranks' agreement on stops),
        the net in training mode, ``train_end`` however it ends, its epochs added to ``estimator.history``."""
        estimator.weight_average = self.weight_average  # a later fit without one evaluates its own weights
        to_train_mode(estimator.optimizers)  # a schedule-free optimizer left evaluating (by evaluate, a best epoch)
        coordinator = estimator.strategy.coordinator(estimator)
        resumable, split = bool(self.services.checkpoints), estimator.splits_data
        data = DataOrder(self.train_data, self.sample_seeds, resumable=resumable, split=split)
        prepare = (resume_picked, estimator.strategy.join)
        run = RunContext(self.dispatcher, self.step, data, "train_data", self.check, coordinator, prepare)
        control = RunControl(self.epochs, self.batches, estimator.history.epochs, ranks=coordinator)
        control.clock.causes = timed_causes(self.dispatcher.handlers, estimator)
        state = TrainState(
            estimator, "train", num_batches=self.num_batches, services=self.services, run=control, _loop=run
        )
        set_training(estimator.net, True)  # after the checks: a fit that fails before training leaves the modes alone
        preemption.attach(state, coordinator)
        outer = estimator.pass_watch  # None, unless a handler runs a fit within a fit
        estimator.pass_watch = PassWatch(coordinator, state)  # its validations stop at a signal
        compiling = CompileWatch(estimator.net)
        try:
            with profiled(self.dispatcher, state.history, self.profile):
                run_fit(state, run)
        finally:
            estimator.pass_watch = outer
            _add_to_history(estimator, state)
            compiling.report()
        return state


def _add_to_history(estimator: Any, state: TrainState) -> None:
    """Append a fit's epochs to ``estimator.history``; a resumed fit's History holds its run's epochs
    already. A fit that failed before completing a batch (a bad batch, a misnamed output) adds nothing:
    fixed and run again, it starts at epoch 1, not after an epoch of nan."""
    if state.run.error is not None and state.global_step == 0 and not state.run.resumed:
        return
    if state.run.resumed:
        estimator.history = History()
    estimator.history.extend(state.history)


def plan_fit(
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
    sample_seeds: Any = None,
) -> FitPlan:
    """The checks of a fit, in the order of the module docstring (raising before any step), and its plan."""
    if isinstance(val_data, int):  # fit(data, 5): the 5 landed in val_data; say so before anything else
        check_data(val_data, "val_data", None)
    train_data, val_data = fit_loaders(train_data, val_data, batch_size, validation_split)
    check_duration(epochs, batches)
    passes = 1 if epochs == 1 else None
    train_data = estimator.strategy.train_data(train_data)
    num_batches = check_data(train_data, "train_data", passes)
    checked = {} if val_data is None else {id(val_data): check_data(val_data, "val_data", passes)}
    check_placement(estimator, "net", "val_net")
    note_slow_precision(estimator)
    handlers = fit_handlers(event_handlers, val_data, default_handlers) + estimator.strategy.fit_handlers()
    warn_unplayed_roles(event_handlers or ())
    here = on_this_rank(handlers)
    services = fit_services(here, estimator)
    console_output_for(services)  # before anything in fit logs (a resume, a monitor's mode)
    for stopper in players(handlers, Stopping):  # first: the validations' data is read once with epochs=1
        limits = stopper.run_limits()
        epochs, batches = tighter_limit(epochs, limits[0]), tighter_limit(batches, limits[1])
    check_trainable(estimator)  # before the validation check, whose forward may gather FSDP's parameters
    _set_up_validations(estimator, handlers, val_data, checked, epochs)
    left = check_monitors(handlers, estimator)
    guarded = check_flag("fit", "check_access", check_access)
    dispatcher = Dispatcher(here, guard if guarded else None)
    if left:
        check_monitor_order(dispatcher.owners[Event.EPOCH_END], left)
    step = bound_step(estimator.batch_processor, estimator, "fit_batch")
    check = first_batch_check(step, services.first_batch_checks, "train_data", "train")
    profile = check_flag("fit", "profile", profile)
    if sample_seeds is not None and not isinstance(sample_seeds, bool):
        raise FitforgeTypeError(
            "fit: sample_seeds must be True, False or None (the default: on where a handler saves checkpoints), "
            f"got {describe(sample_seeds)}"
        )
    averaging = services.averages
    if len(averaging) > 1:
        raise FitforgeValueError(
            f"fit: {len(averaging)} handlers average the weights ({', '.join(map(handler_name, averaging))}), "
            "and evaluation runs with one average: pass one"
        )
    average = averaging[0] if averaging else schedule_free_weights(estimator.net, estimator.optimizers)
    return FitPlan(
        train_data, num_batches, epochs, batches, dispatcher, step, check, profile, sample_seeds, services, average
    )


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
        first = setup.check_first and check_first_val_batch(
            estimator, unsplit, name, evaluation.services.first_batch_checks, evaluation.step
        )
        evaluation.check = None if first else evaluation.check
        validator.use_evaluation(evaluation, first)
