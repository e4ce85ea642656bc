"""LambdaHandler (functions on exactly the events given) and throttle() (a handler's hooks every n
batches, every n epochs, or at most once per T seconds on an injected clock)."""

import copy

import pytest

from fitforge.core.events import events_of, handler_name
from fitforge.events import Event, EventHandler, Monitoring, Stopping, role_of
from fitforge.exceptions import (
    FitforgeTypeError,
    FitforgeValueError,
    MonitorKeyError,
    StateAccessError,
)
from fitforge.handlers import (
    EarlyStoppingHandler,
    GradientUpdateHandler,
    LoggingHandler,
)
from fitforge.handlers.lambda_handler import LambdaHandler
from fitforge.handlers.throttle import Throttled, throttle
from fitforge.testing import RecordingHandler, linear_problem

EVENTS = [event.value for event in Event if event is not Event.BACKWARD_END]  # RecordingHandler's six


def fit(handlers, epochs=2, **kwargs):
    estimator, train, _ = linear_problem()  # 8 batches per epoch
    return estimator.fit(train, epochs=epochs, event_handlers=handlers, **kwargs)


# -- LambdaHandler ------------------------------------------------------------------------------------


def test_a_lambda_handler_handles_only_the_events_given():
    handler = LambdaHandler(epoch_end=print, batch_begin=print)
    assert events_of(handler) == [Event.BATCH_BEGIN, Event.EPOCH_END]
    assert isinstance(handler, LambdaHandler) and isinstance(handler, EventHandler)
    assert type(handler) is LambdaHandler  # no class made per combination of events
    estimator, _, _ = linear_problem()
    lines = estimator.describe_loop([handler]).splitlines()
    assert [("LambdaHandler(user)" in line) for line in lines[:7]] == [False, False, True, False, False, True, False]


def test_its_functions_run_on_their_events_with_the_state():
    seen = []
    functions = {
        name: (lambda state, name=name: seen.append((name, state.epoch, state.global_step))) for name in EVENTS
    }
    recorder = RecordingHandler()
    fit([LambdaHandler(**functions), recorder])
    assert seen == [(event, epoch, step) for event, _, epoch, _, step in recorder.calls]


def test_a_truthy_return_from_batch_end_or_epoch_end_stops_training():
    stopper = LambdaHandler(batch_end=lambda state: state.global_step == 3)
    history = fit([stopper], epochs=5)
    assert history.epochs == 1
    assert (
        history.stop_reason == "LambdaHandler(batch_end=test_a_truthy_return_from_batch_end_or_epoch_end_"
        "stops_training.<locals>.<lambda>).batch_end returned True"
    )
    history = fit([LambdaHandler(epoch_end=lambda state: state.epoch == 1)], epochs=5)
    assert history.epochs == 2 and history.stop_reason.endswith("epoch_end returned True")


def test_priority_run_after_and_copies():
    early = LambdaHandler(batch_end=lambda state: None, priority=-3000)
    estimator, _, _ = linear_problem()
    assert "LambdaHandler(guard) -> GradientUpdateHandler(step)" in estimator.describe_loop([early])
    late = LambdaHandler(batch_end=print, priority=-3000, run_after=(GradientUpdateHandler,))
    assert "GradientUpdateHandler(step) -> LambdaHandler(guard)" in estimator.describe_loop([late])
    twin = copy.deepcopy(late)
    assert type(twin) is type(late) and twin.batch_end is print and twin.priority == -3000


def test_declared_access_is_checked_and_undeclared_is_full_access():
    assert LambdaHandler(epoch_end=print).reads is None
    reader = LambdaHandler(epoch_end=lambda state: state.metrics["train_loss"], reads=("epoch",))
    with pytest.raises(StateAccessError, match="read state.metrics"):
        fit([reader], check_access=True)
    fine = LambdaHandler(epoch_end=lambda state: state.metrics["train_loss"], reads=("metrics",), writes=())
    fit([fine], check_access=True)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: LambdaHandler(), FitforgeValueError, r"needs at least one function, e\.g\. LambdaHandler\(epoch_end="),
        (lambda: LambdaHandler(batch_end=3), FitforgeTypeError, r"batch_end must be a function fn\(state\), got int 3"),
        (lambda: LambdaHandler(epoch_end=lambda: 0), FitforgeTypeError, r"epoch_end must take one argument"),
        (lambda: LambdaHandler(print), FitforgeTypeError, r"takes its functions by event name"),
        (lambda: LambdaHandler(on_epoch_end=print), FitforgeTypeError, r"unknown argument\(s\) on_epoch_end"),
        (lambda: LambdaHandler(epoch_end=print, priority="1"), FitforgeTypeError, r"priority must be an int"),
        (lambda: LambdaHandler(epoch_end=print, reads="epoch"), FitforgeTypeError, r"reads must be None or a tuple"),
    ],
)
def test_lambda_handler_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


# -- throttle -------------------------------------------------------------------------------------------


def steps(recorder, event):
    return [call[4] for call in recorder.calls if call[0] == event]


def epochs(recorder, event):
    return [call[2] for call in recorder.calls if call[0] == event]


def test_every_n_batches_counts_the_run_s_batches_and_leaves_other_hooks_alone():
    recorder = RecordingHandler()
    fit([throttle(recorder, every_n_batches=3)])  # 2 epochs of 8 batches
    assert steps(recorder, "batch_begin") == steps(recorder, "batch_end") == [2, 5, 8, 11, 14]
    assert epochs(recorder, "epoch_begin") == epochs(recorder, "epoch_end") == [0, 1]
    assert recorder.events[0] == "train_begin" and recorder.events[-1] == "train_end"


def test_every_n_epochs_throttles_the_epoch_hooks_only():
    recorder = RecordingHandler()
    fit([throttle(recorder, every_n_epochs=2)], epochs=5)
    assert epochs(recorder, "epoch_begin") == epochs(recorder, "epoch_end") == [1, 3]
    assert len(steps(recorder, "batch_end")) == 40


def test_seconds_on_a_fake_clock():
    now = [0.0]
    tick = LambdaHandler(
        epoch_begin=lambda state: now.__setitem__(0, float(state.global_step)),
        batch_begin=lambda state: now.__setitem__(0, float(state.global_step)),
        priority=-100,
    )
    recorder = RecordingHandler()
    fit([tick, throttle(recorder, seconds=10, clock=lambda: now[0])], epochs=3)  # one second per batch
    assert steps(recorder, "batch_begin") == steps(recorder, "batch_end") == [0, 10, 20]
    assert epochs(recorder, "epoch_begin") == epochs(recorder, "epoch_end") == [0, 2]  # at t = 0, 8 (no), 16


def test_every_n_and_seconds_must_both_hold():
    now = [0.0]
    tick = LambdaHandler(batch_begin=lambda state: now.__setitem__(0, float(state.global_step)), priority=-100)
    recorder = RecordingHandler()
    fit([tick, throttle(recorder, every_n_batches=4, seconds=5, clock=lambda: now[0])])
    assert steps(recorder, "batch_end") == [3, 11]  # 7 is only 4 s after 3; 15 is 4 s after 11


def test_a_throttled_batch_end_can_stop_training():
    wrapper = throttle(RecordingHandler(stop_on=("batch_end", 5)), every_n_batches=3)
    history = fit([wrapper], epochs=5)
    assert history.stop_reason == "throttle(RecordingHandler, every_n_batches=3).batch_end returned True"


def test_in_evaluate_batches_count_by_position_and_the_epoch_passes_through():
    estimator, _, val = linear_problem()  # 2 validation batches
    recorder = RecordingHandler()
    estimator.evaluate(val, event_handlers=[throttle(recorder, every_n_batches=2, every_n_epochs=3)])
    assert recorder.events == ["epoch_begin", "batch_begin", "batch_end", "epoch_end"]
    assert recorder.calls[2][3] == 1  # batch_idx 1: the second batch


def test_the_wrapper_mirrors_the_handler():
    stopper = EarlyStoppingHandler("train_loss", patience=2)
    stopper.priority, stopper.run_after = 7, (LoggingHandler,)
    wrapper = throttle(stopper, every_n_epochs=2)
    assert events_of(wrapper) == events_of(stopper)
    assert type(wrapper) is Throttled and handler_name(wrapper) == "ThrottledEarlyStoppingHandler"
    assert (wrapper.priority, wrapper.run_after) == (7, (LoggingHandler,))
    assert set(stopper.reads) | {"phase", "epoch"} <= set(wrapper.reads)  # plus what it reads to decide
    assert wrapper.writes == tuple(stopper.writes)
    assert throttle(RecordingHandler(), every_n_epochs=2).reads is None  # undeclared stays undeclared
    # The wrapper plays the wrapped handler's roles, with nothing forwarded by name.
    assert wrapper.handler is stopper and role_of(wrapper, Monitoring).monitor == "train_loss"
    assert not role_of(wrapper, Stopping).ended_run()
    stopper.wait, stopper.best, stopper.stopped_epoch = 1, 0.5, 3
    assert role_of(wrapper, Stopping).ended_run()  # so resume sees a run it stopped as finished
    assert wrapper.state_dict() == stopper.state_dict()
    wrapper.load_state_dict({**stopper.state_dict(), "wait": 0})
    assert stopper.wait == 0
    logging_wrapper = throttle(LoggingHandler(), every_n_batches=10)
    assert repr(logging_wrapper) == "throttle(LoggingHandler, every_n_batches=10)"
    assert set(LoggingHandler.reads) | {"phase", "epoch", "batch_idx", "global_step"} <= set(logging_wrapper.reads)


def test_fit_checks_a_throttled_handler_s_monitor():
    with pytest.raises(MonitorKeyError, match=r"monitors 'val_accuracy'"):
        fit([throttle(EarlyStoppingHandler("val_accuracy"), every_n_epochs=2)])


def test_a_throttled_declared_handler_passes_the_access_guard():
    history = fit(
        [throttle(LoggingHandler(log_interval=1), every_n_batches=4, every_n_epochs=2)],
        default_handlers=False,
        check_access=True,
    )
    assert history.epochs == 2


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: throttle(RecordingHandler()),
            FitforgeValueError,
            r"needs every_n_batches, every_n_epochs or seconds; got none",
        ),
        (
            lambda: throttle(RecordingHandler(), every_n_batches=0),
            FitforgeValueError,
            r"every_n_batches must be a positive int or None, got 0",
        ),
        (
            lambda: throttle(RecordingHandler(), every_n_epochs="2"),
            FitforgeTypeError,
            r"every_n_epochs must be a positive int or None, got str '2'",
        ),
        (
            lambda: throttle(RecordingHandler(), seconds=-1.5),
            FitforgeValueError,
            r"seconds must be a positive number or None, got -1.5",
        ),
        (lambda: throttle(RecordingHandler(), seconds=1, clock=0), FitforgeTypeError, r"clock must be a function"),
        (lambda: throttle(object(), every_n_batches=2), FitforgeTypeError, r"which handles no event"),
        (
            lambda: throttle(LoggingHandler, every_n_batches=2),
            FitforgeTypeError,
            r"write LoggingHandler\(\) to create one",
        ),
        (
            lambda: throttle(LambdaHandler(batch_end=print), every_n_epochs=2),
            FitforgeValueError,
            r"every_n_epochs=2 has nothing to throttle: LambdaHandler\(batch_end=print\) has no epoch hooks",
        ),
    ],
)
def test_throttle_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_throttled_default_handler_replaces_the_default_and_is_ordered_as_it():
    from fitforge.events import EpochEnd
    from fitforge.handlers import LoggingHandler
    from fitforge.handlers.throttle import throttle as wrap
    from helpers import make_estimator

    class AfterLogging(EpochEnd):
        priority = 0
        run_after = (LoggingHandler,)

        def epoch_end(self, state):
            pass

    text = make_estimator().describe_loop([AfterLogging(), wrap(LoggingHandler(), every_n_batches=2)])
    assert "ThrottledLoggingHandler(report)" in text and " LoggingHandler(" not in text  # the default is left out
    assert "ThrottledLoggingHandler(report) -> AfterLogging(user)" in text
