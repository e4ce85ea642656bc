"""Dispatch: handlers called iff they inherit the mixin, priority/run_after order, cycles, describe_loop."""

import re

import pytest
import torch

from fitforge.core import dispatch as dispatch_module
from fitforge.core.dispatch import Dispatcher, check_handler
from fitforge.core.events import events_of
from fitforge.events import BatchBegin, BatchEnd, EpochBegin, EpochEnd, Event, EventHandler, TrainBegin, TrainEnd
from fitforge.exceptions import FitforgeTypeError, HandlerOrderError
from fitforge.handlers import GradientUpdateHandler, LoggingHandler, MetricHandler, StoppingHandler, ValidationHandler
from fitforge.testing import RecordingHandler
from helpers import make_estimator, regression_batches


class Named(BatchEnd):
    def __init__(self, name, priority=0, run_after=()):
        self.name, self.priority, self.run_after = name, priority, run_after

    def __repr__(self):
        return self.name


class A(Named):
    pass


class B(Named):
    pass


class C(Named):
    pass


def order_handlers(handlers):
    return Dispatcher(handlers).handlers


def test_events_of_follows_mixins():
    class TwoEvents(TrainBegin, EpochEnd):
        pass

    assert events_of(TwoEvents()) == [Event.TRAIN_BEGIN, Event.EPOCH_END]
    assert len(events_of(RecordingHandler())) == 6


def test_handler_is_called_only_for_its_mixins():
    class OnlyEpochEnd(EpochEnd):
        calls = 0

        def epoch_end(self, state):
            OnlyEpochEnd.calls += 1

        # Defined but not inherited through a mixin: must never be called.
        def batch_end(self, state):  # pragma: no cover - the assertion is that it is not called
            raise AssertionError("batch_end called without the BatchEnd mixin")

    handler = OnlyEpochEnd()
    dispatcher = Dispatcher([handler])
    assert [len(dispatcher.hooks[e]) for e in Event] == [0, 0, 0, 0, 0, 1, 0]
    make_estimator().fit(regression_batches(), epochs=2, event_handlers=[handler])
    assert OnlyEpochEnd.calls == 2


def test_priority_orders_lower_first_and_ties_keep_given_order():
    handlers = [Named("late", 5), Named("first", -5), Named("tie1"), Named("tie2")]
    assert [h.name for h in order_handlers(handlers)] == ["first", "tie1", "tie2", "late"]


def test_run_after_overrides_priority():
    a, b = A("a", priority=-10, run_after=(B,)), B("b", priority=10)
    assert order_handlers([a, b]) == [b, a]


def test_run_after_with_absent_class_is_ignored():
    a = A("a", run_after=(C,))
    assert order_handlers([a]) == [a]


def test_cycle_is_an_error_naming_only_the_handlers_in_it():
    a, b = A("a", run_after=(B,)), B("b", run_after=(A,))
    blocked = C("blocked", run_after=(A,))  # waits on the cycle but is not part of it
    with pytest.raises(HandlerOrderError, match=r"cycle through run_after: a runs after b runs after a; remove"):
        order_handlers([blocked, C("free"), a, b])


def test_a_later_fit_with_handlers_described_alike_reuses_their_order(monkeypatch):
    computed = []
    real = dispatch_module._order
    monkeypatch.setattr(dispatch_module, "_order", lambda handlers: computed.append(1) or real(handlers))
    monkeypatch.setattr(dispatch_module, "_ORDERS", {})
    first = [A("a", priority=-10, run_after=(B,)), B("b", priority=10)]
    assert order_handlers(first) == [first[1], first[0]] and len(computed) == 1
    again = [A("a2", priority=-10, run_after=(B,)), B("b2", priority=10)]  # other instances, same description
    assert order_handlers(again) == [again[1], again[0]] and len(computed) == 1
    assert [h.name for h in order_handlers([A("a", priority=-10), B("b", priority=10)])] == ["a", "b"]
    assert len(computed) == 2  # without run_after: another description, ordered afresh
    listed = [A("a", priority=1, run_after=[B]), B("b")]  # a list cannot be a key: ordered every time
    assert order_handlers(listed) == [listed[1], listed[0]] and order_handlers(listed) == [listed[1], listed[0]]
    assert len(computed) == 4
    cycle = [A("a", run_after=(B,)), B("b", run_after=(A,))]
    for _ in range(2):  # an error is never remembered as an order
        with pytest.raises(HandlerOrderError):
            order_handlers(cycle)


def test_a_later_dispatcher_reuses_the_events_of_handlers_described_alike(monkeypatch):
    looked_up = []
    real = dispatch_module.events_of
    monkeypatch.setattr(dispatch_module, "events_of", lambda h: looked_up.append(h) or real(h))
    monkeypatch.setattr(dispatch_module, "_ORDERS", {})
    first = Dispatcher([A("a", priority=-10, run_after=(B,)), B("b", priority=10)])
    again = [A("a2", priority=-10, run_after=(B,)), B("b2", priority=10)]
    second = Dispatcher(again)
    assert len(looked_up) == 2  # the first dispatcher's two handlers only
    assert second.handlers == [again[1], again[0]]
    for event in Event:
        assert [type(h) for h in second.owners[event]] == [type(h) for h in first.owners[event]]
        assert [hook.__self__ for hook in second.hooks[event]] == second.owners[event]


@pytest.mark.parametrize(
    "attr, value, message",
    [
        ("priority", "high", "priority must be an int, got str 'high'"),
        ("priority", None, "priority must be an int, got NoneType None"),
        (
            "run_after",
            "LoggingHandler",
            "run_after must be a tuple of handler classes, e.g. (LoggingHandler,), got str",
        ),
        ("run_after", (LoggingHandler(),), "run_after must be a tuple of handler classes"),
    ],
)
def test_bad_priority_or_run_after_is_a_clear_error(attr, value, message):
    handler = RecordingHandler()
    setattr(handler, attr, value)
    with pytest.raises(FitforgeTypeError, match=re.escape(message)):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[handler])


def test_truthy_returns_stop_only_from_batch_end_and_epoch_end():
    class Chatty(TrainBegin, EpochBegin, BatchBegin):
        def train_begin(self, state):
            return 1

        def epoch_begin(self, state):
            return True

        def batch_begin(self, state):
            return True

    history = make_estimator().fit(regression_batches(), epochs=3, event_handlers=[Chatty()])
    assert history.epochs == 3 and history.stop_reason == "reached epochs=3"


def test_hooks_that_are_not_bound_methods_work():
    handler = RecordingHandler()
    handler.batch_end = lambda state: state.global_step == 1  # an instance attribute, not a method
    history = make_estimator().fit(regression_batches(4), epochs=2, event_handlers=[handler])
    assert history.stop_reason == "RecordingHandler.batch_end returned True" and history.epochs == 1


def test_cycle_is_raised_by_fit_before_training():
    a, b = A("a", run_after=(B,)), B("b", run_after=(A,))
    est = make_estimator()
    weight = est.net.weight.detach().clone()
    with pytest.raises(HandlerOrderError, match="cycle"):
        est.fit(regression_batches(), epochs=1, event_handlers=[a, b])
    assert est.net.weight.detach().equal(weight)


def test_check_handler_errors():
    with pytest.raises(FitforgeTypeError, match=r"write RecordingHandler\(\) to create one"):
        check_handler(RecordingHandler)
    with pytest.raises(FitforgeTypeError, match="handles no event; a handler must inherit at least one of TrainBegin"):
        check_handler(EventHandler())
    with pytest.raises(FitforgeTypeError, match="handles no event"):
        check_handler(object())


def test_event_handlers_must_be_a_list():
    with pytest.raises(FitforgeTypeError, match="event_handlers must be a list of handlers, got RecordingHandler"):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=RecordingHandler())


def test_describe_loop_lists_each_event_in_call_order():
    est = make_estimator()
    user = RecordingHandler(priority=10)
    text, access = est.describe_loop([user]).split("\nstate access:\n")
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert list(lines) == [e.value for e in Event]
    assert "  RecordingHandler: full access (undeclared)" in access.splitlines()
    assert lines["batch_end"] == (
        "GradientUpdateHandler(step) -> MetricHandler(metrics) -> ThroughputHandler(metrics) -> "
        "RecordingHandler(10) -> LoggingHandler(report) -> StoppingHandler(report)"
    )
    assert lines["batch_begin"] == "RecordingHandler(10)"
    assert "ValidationHandler" in est.describe_loop([ValidationHandler(regression_batches())])


def test_default_is_replaced_by_user_handler_of_same_class_or_subclass():
    class MyLogging(LoggingHandler):
        pass

    est = make_estimator()
    text = est.describe_loop([MyLogging(log_interval=2), StoppingHandler(max_time=5)])
    assert "MyLogging(report)" in text and "LoggingHandler" not in text
    assert text.splitlines()[4].count("StoppingHandler") == 1


def test_callers_handler_list_is_not_mutated():
    given = [RecordingHandler()]
    make_estimator().fit(regression_batches(), epochs=1, event_handlers=given)
    assert len(given) == 1


def test_all_six_mixins_have_noop_hooks():
    for mixin, hook in [
        (TrainBegin, "train_begin"),
        (TrainEnd, "train_end"),
        (EpochBegin, "epoch_begin"),
        (EpochEnd, "epoch_end"),
        (BatchBegin, "batch_begin"),
        (BatchEnd, "batch_end"),
    ]:
        assert getattr(mixin(), hook)(None) is None
    handler = EventHandler()
    assert handler.state_dict() == {} and handler.load_state_dict({}) is None
    assert repr(GradientUpdateHandler()) == "GradientUpdateHandler" and MetricHandler().priority == -1000


def test_dispatcher_fire_requests_a_stop_for_a_truthy_batch_end():
    from fitforge.core.state import TrainState

    state = TrainState(make_estimator())
    Dispatcher([RecordingHandler(stop_on=("batch_end", 0))]).fire(Event.BATCH_END, state)
    assert state.run.stop_reason == "RecordingHandler.batch_end returned True"


def test_declared_events_must_be_events():
    class Declares(EpochEnd):
        handled_events = ("epoch_end",)  # a string, not Event.EPOCH_END

    with pytest.raises(FitforgeTypeError, match=r"handled_events must be None or a tuple of fitforge.events.Event"):
        make_estimator().fit(regression_batches(1), epochs=1, event_handlers=[Declares()])


def test_a_scheduler_passed_as_a_handler_points_to_the_scheduler_handler():
    estimator = make_estimator()
    scheduler = torch.optim.lr_scheduler.StepLR(estimator.optimizer, step_size=1)
    with pytest.raises(
        FitforgeTypeError, match=r"a learning-rate scheduler \(StepLR\).*LRSchedulerHandler\(scheduler\)"
    ):
        estimator.fit(regression_batches(1), epochs=1, event_handlers=[scheduler])


def test_the_events_of_instances_of_one_class_follow_each_ones_handled_events():
    every, narrowed = GradientUpdateHandler(accumulate=2), GradientUpdateHandler()  # accumulate=1 skips batch_begin
    for _ in range(2):  # the second time from the cache of (class, handled_events)
        assert Event.BATCH_BEGIN in events_of(every) and Event.BATCH_BEGIN not in events_of(narrowed)
    dispatcher = Dispatcher([every, narrowed])
    assert dispatcher.owners[Event.BATCH_BEGIN] == [every]
    assert dispatcher.owners[Event.BATCH_END] == [every, narrowed]
    assert dispatcher.hooks[Event.BATCH_END] == [every.batch_end, narrowed.batch_end]


def test_events_are_dict_keys_by_identity_also_after_a_copy():
    import copy
    import pickle

    table = {event: event.value for event in Event}
    assert len(Event) == 7 and len(table) == 7
    assert table[pickle.loads(pickle.dumps(Event.EPOCH_END))] == table[copy.deepcopy(Event.EPOCH_END)] == "epoch_end"
