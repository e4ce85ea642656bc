"""fit(profile=True): time per handler and event, slowest first, with call counts (a fake clock)."""

import logging

import pytest

from fitforge.events import BatchEnd
from fitforge.exceptions import FitforgeTypeError
from fitforge.tools import profiler
from helpers import make_estimator, regression_batches


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_profile_reports_each_handler_and_event_slowest_first(monkeypatch, caplog):
    clock = FakeClock()
    monkeypatch.setattr(profiler.time, "perf_counter", clock)

    class Slow(BatchEnd):
        def batch_end(self, state):
            clock.now += 0.005  # 5 ms of "work" per batch, on the fake clock

    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = make_estimator().fit(regression_batches(n_batches=3), epochs=2, event_handlers=[Slow()], profile=True)
    lines = history.profile.splitlines()
    assert lines[0].split() == ["handler", "event", "calls", "total", "ms", "us/call", "of", "fit"]
    assert lines[1].split() == ["Slow", "batch_end", "6", "30.00", "5000.0", "100.0%"]
    assert any(line.split()[:3] == ["GradientUpdateHandler", "batch_end", "6"] for line in lines)
    assert lines[-1] == "handlers 30.0 ms of the fit's 30.0 ms (100.0%)"
    assert "time per handler and event:\n" + history.profile in caplog.text


def test_without_profile_there_is_no_table_and_profile_must_be_a_bool():
    assert make_estimator().fit(regression_batches(), epochs=1).profile is None
    with pytest.raises(FitforgeTypeError, match="fit: profile must be True or False"):
        make_estimator().fit(regression_batches(), epochs=1, profile="yes")


def test_two_handlers_of_one_class_are_told_apart():
    class Twice(BatchEnd):
        def batch_end(self, state):
            pass

    history = make_estimator().fit(regression_batches(), epochs=1, event_handlers=[Twice(), Twice()], profile=True)
    names = [line.split()[0] for line in history.profile.splitlines()]
    assert "Twice" in names and "Twice#2" in names
