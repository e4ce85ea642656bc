"""What the trackers share: the BackgroundWriter (records written in order on a thread of their own,
gathered for an interval, all of them at close, a failing write a warning), the flush_secs check, and
how a fit ended. The trackers themselves are tested in tests/handlers."""

import contextlib
import math
import threading
import time

import pytest

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, LambdaHandler
from fitforge.reporting.tracking import BackgroundWriter, RunTracker, check_flush_secs, check_names, outcome
from fitforge.testing import linear_problem

WAIT = 60  # seconds to wait for the writer's thread before the test fails (it takes milliseconds)


class Sink:
    """Records what the writer writes, and on which thread."""

    def __init__(self, fail_on=None):
        self.writes, self.threads, self.fail_on = [], set(), fail_on
        self.called, self.wrote = threading.Event(), threading.Event()

    def __call__(self, records):
        self.threads.add(threading.get_ident())
        self.called.set()
        if self.fail_on in records:
            raise ConnectionError("store out of reach")
        self.writes.append(list(records))
        self.wrote.set()


def test_records_are_gathered_and_all_written_in_order_at_close():
    sink = Sink()
    writer = BackgroundWriter("Tracker", sink, flush_secs=1000)  # an interval no test waits for
    for record in range(5):
        writer.put(record)
    writer.close()
    assert sink.writes == [[0, 1, 2, 3, 4]]  # one write: close ends the interval early
    assert sink.threads and threading.get_ident() not in sink.threads
    writer.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="Tracker: a record was put after its writer closed"):
        writer.put(5)


def test_records_are_written_each_interval_without_close():
    sink = Sink()
    writer = BackgroundWriter("Tracker", sink, flush_secs=0.01)
    writer.put("epoch 1")
    assert sink.wrote.wait(WAIT), "the writer did not write within its interval"
    assert sink.writes == [["epoch 1"]]
    sink.wrote.clear()
    writer.put("epoch 2")
    assert sink.wrote.wait(WAIT)
    writer.close()
    assert sink.writes == [["epoch 1"], ["epoch 2"]]


def test_a_failing_write_is_a_warning_and_the_next_records_are_written(caplog):
    sink = Sink(fail_on="bad")
    writer = BackgroundWriter("Tracker", sink, flush_secs=0.01)
    with caplog.at_level("WARNING", logger="fitforge"):
        writer.put("bad")
        writer.put("bad")
        assert sink.called.wait(WAIT)
        writer.put("good")  # written at the next interval, or at close
        writer.close()
    assert "Tracker: 2 record(s) not written (store out of reach); training goes on" in caplog.text
    assert sink.writes == [["good"]]


def test_close_writes_what_came_while_the_thread_was_writing():
    started, release = threading.Event(), threading.Event()
    writes = []

    def slow(records):
        writes.append(list(records))
        started.set()
        assert release.wait(WAIT)

    writer = BackgroundWriter("Tracker", slow, flush_secs=0.01)
    writer.put(1)
    assert started.wait(WAIT)  # the thread is inside its first write
    writer.put(2)
    writer.put(3)
    release.set()
    writer.close()
    assert writes == [[1], [2, 3]]


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("5", FitforgeTypeError, r"Tracker: flush_secs must be a positive number of seconds, got str '5'"),
        (True, FitforgeTypeError, r"flush_secs must be a positive number of seconds, got bool True"),
        (0, FitforgeValueError, r"flush_secs must be a positive number of seconds, got 0"),
        (math.nan, FitforgeValueError, r"flush_secs must be a positive number of seconds, got nan"),
    ],
)
def test_flush_secs_errors(value, error, message):
    with pytest.raises(error, match=message):
        check_flush_secs("Tracker", value)


def test_names_are_non_empty_str_or_none():
    check_names("Tracker", project=None, run="a")
    with pytest.raises(FitforgeTypeError, match=r"Tracker: project must be a str or None, got int 3"):
        check_names("Tracker", run=None, project=3)
    with pytest.raises(FitforgeValueError, match=r"Tracker: run must not be empty; pass None"):
        check_names("Tracker", run="")


def test_flush_secs_as_a_float():
    assert check_flush_secs("Tracker", 2) == 2.0 and isinstance(check_flush_secs("Tracker", 2), float)


class SlowTracker(RunTracker):
    """A RunTracker whose run takes ``opening`` seconds to open; it notes what it is asked, in order."""

    def __init__(self, opening=0.0, failing_end=False):
        super().__init__(flush_secs=0.01)
        self.opening, self.failing_end, self.calls, self.rows = opening, failing_end, [], []

    def _open(self):
        time.sleep(self.opening)
        self.calls.append(("open", self._resumed_run))
        self.run_id, self._owned = self._resumed_run or f"run{len(self.calls)}", True
        self._writer = BackgroundWriter("SlowTracker", lambda records: self.rows.extend(records), flush_secs=0.01)

    def _before_end(self, state):
        self.calls.append(("before_end", len(self.rows)))
        if self.failing_end:
            raise RuntimeError("upload failed")

    def _end(self, ended):
        self.calls.append(("end", ended))


def test_a_run_opens_at_the_start_or_at_a_resume_s_first_epoch_and_ends_after_its_rows(tmp_path):
    tracker = SlowTracker()
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=2, event_handlers=[tracker, CheckpointHandler(tmp_path)])
    assert tracker.calls == [("open", None), ("before_end", 2), ("end", "finished")]
    assert [epoch for epoch, _, _ in tracker.rows] == [1, 2] and "train_loss" in tracker.rows[0][2]
    resumed = SlowTracker(opening=0.5)  # its run opens in the first epoch's hooks, not while restoring
    estimator, train, _ = linear_problem()
    saver = CheckpointHandler(tmp_path, resume_from_checkpoint=True)
    totals = []
    clock = LambdaHandler(train_end=lambda state: totals.append(state.run.clock.totals()))
    estimator.fit(train, epochs=3, event_handlers=[resumed, saver, clock])
    assert resumed.calls[0] == ("open", "run1") and resumed.run_id == "run1"
    assert totals[0]["replay"] < 0.5 <= totals[0]["handlers"]
    failing = SlowTracker(failing_end=True)
    estimator, train, _ = linear_problem()
    with pytest.raises(RuntimeError, match="upload failed"):
        estimator.fit(train, epochs=1, event_handlers=[failing])
    assert failing.calls[-1] == ("end", "finished")  # the run is ended even when what comes before fails


def ended(hook=None):
    """How a fit of one epoch ended, as a tracker sees it at train_end; ``hook`` runs at each batch end."""
    seen = []
    estimator, train, _ = linear_problem()
    handlers = [LambdaHandler(train_end=lambda state: seen.append(outcome(state)))]
    if hook is not None:
        handlers.append(LambdaHandler(batch_end=hook))
    with pytest.raises(BaseException) if hook else contextlib.nullcontext():
        estimator.fit(train, epochs=1, event_handlers=handlers)
    return seen[0]


def raising(error):
    def hook(state):
        raise error

    return hook


def test_how_a_fit_ended():  # a SIGTERM's "killed": tests/handlers/test_mlflow.py
    assert ended() == "finished"
    assert ended(raising(RuntimeError("boom"))) == "failed"
    assert ended(raising(KeyboardInterrupt())) == "killed"


def test_a_tracker_out_of_reach_holds_the_end_of_training_only_so_long(caplog):
    import threading

    release = threading.Event()
    writer = BackgroundWriter("Tracker", lambda records: release.wait(10), flush_secs=0.01)
    writer.put("value")
    with caplog.at_level("WARNING", logger="fitforge"):
        writer.close(timeout=0.05)  # its write hangs (a server retrying): close gives up on it
    release.set()
    assert "last records were not written within 0 s" in caplog.text
