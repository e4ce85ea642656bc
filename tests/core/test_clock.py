"""The run's clock (fitforge.core.clock.RunClock): a fit's seconds by cause in every History row and
across resumes, the closing line's goodput and its advice. Durations are bounded by sleeps (a sleep lasts
at least as long as asked), never by how fast anything runs."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from fitforge import Estimator
from fitforge.core.clock import CAUSES, RunClock, compiled, goodput, history_key
from fitforge.core.history import History
from fitforge.events import BatchBegin, BatchEnd, TrainEnd
from fitforge.exceptions import CancelEpoch, FitforgeValueError
from fitforge.handlers import CheckpointHandler, SpikeGuardHandler
from fitforge.handlers.defaults import timed_causes
from helpers import TIME_KEYS

SLEEP = 0.01


def slow(samples):
    time.sleep(SLEEP)
    return default_collate(samples)


def loader(batches=4, collate=slow):
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(batches * 2, 3, generator=generator), torch.randn(batches * 2, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=2, collate_fn=collate)


def estimator(**kwargs):
    torch.manual_seed(0)
    return Estimator(nn.Linear(3, 1), nn.MSELoss(), optimizer="sgd", device="cpu", **kwargs)


def test_every_row_holds_the_seconds_by_cause_and_a_slow_loader_shows_as_data():
    history = estimator().fit(loader(), epochs=2, default_handlers=False)
    assert [key for key in history if key.startswith("time_")] == list(TIME_KEYS)
    assert all(value >= 4 * SLEEP for value in history["time_data_s"])  # 4 batches a row, each slept
    assert all(value > 0 for key in TIME_KEYS for value in history[key])


def test_validation_and_checkpoints_are_causes_of_their_own(tmp_path):
    est = estimator()
    saver = CheckpointHandler(tmp_path, batch_period=2)
    history = est.fit(loader(), val_data=loader(2), epochs=2, event_handlers=[saver])
    assert {"time_validation_s", "time_checkpoint_s"} <= set(history)
    # An epoch's row is recorded before its end: epoch 1's validation (2 slow batches) shows in row 2.
    assert history["time_validation_s"][1] >= 2 * SLEEP
    totals = est.load_checkpoint(saver.last_saved)["clock"]  # the run's totals go in every checkpoint
    assert set(totals) == {*CAUSES, "wall"} and totals["checkpoint"] > 0 and totals["wall"] > totals["data"]


def test_the_causes_recorded_follow_the_fit_s_handlers(tmp_path):
    est = estimator()
    assert timed_causes([], est) == ("step", "data", "handlers")
    with_handlers = [CheckpointHandler(tmp_path), SpikeGuardHandler()]
    assert timed_causes(with_handlers, est) == ("step", "data", "handlers", "checkpoint", "rollback")
    assert not compiled(est.net) and compiled(estimator(compile=True).net)
    assert "compile" in timed_causes([], estimator(compile=True))


def test_hooks_lose_the_causes_reported_within_them():
    clock = RunClock()
    with clock.hooks():
        time.sleep(SLEEP)
        clock.add("checkpoint", 5.0)  # more than the block took: the hooks' own time is then 0
    assert clock.epoch["checkpoint"] == 5.0 and clock.epoch["handlers"] == 0.0
    with clock.hooks():
        time.sleep(SLEEP)
    assert clock.epoch["handlers"] >= SLEEP


def test_a_pass_s_seconds_count_before_it_ends_and_a_rollback_takes_the_steps_it_undid():
    clock = RunClock()
    clock.open_batches()
    clock.waited, clock.stepping, clock.hooked = 1.0, 3.0, 0.5
    totals = clock.totals()  # a checkpoint in the middle of the pass holds them
    assert (totals["data"], totals["step"], totals["handlers"]) == (1.0, 3.0, 0.5)
    clock.undo(2.0)
    clock.close_batches()
    assert (clock.epoch["step"], clock.epoch["rollback"], clock.epoch["data"]) == (1.0, 2.0, 1.0)
    history = History()
    history.open_epoch(0)
    clock.causes = ("step", "data", "handlers", "rollback")
    clock.record_epoch(history)
    assert history.current("time_rollback_s") == 2.0 and "time_checkpoint_s" not in history
    assert clock.epoch == dict.fromkeys(CAUSES, 0.0)  # the next row counts from here


def test_a_compiled_net_s_first_step_beyond_an_ordinary_one_is_compilation():
    clock = RunClock()
    clock.epoch["step"] = 10.0  # the first of 4 steps took 7 s, the others 1 s each
    clock.first_step(7.0, 4, compiled=True)
    assert clock.epoch["compile"] == 6.0 and clock.epoch["step"] == 4.0
    plain = RunClock()
    plain.epoch["step"] = 10.0
    plain.first_step(7.0, 4, compiled=False)
    assert plain.epoch["step"] == 10.0 and plain.epoch["compile"] == 0.0


def test_totals_go_on_from_a_resume_s_and_goodput_names_the_largest_loss():
    clock = RunClock()
    clock.load_state_dict({"step": 2.0, "data": 6.0, "wall": 10.0})
    totals = clock.totals()
    assert totals["data"] == 6.0 and totals["wall"] >= 10.0
    assert goodput({"step": 2.0, "data": 6.0, "handlers": 1.0, "wall": 10.0}) == (0.2, "data", 0.6)
    assert goodput({"step": 1.0, "wall": 1.0}) == (1.0, None, 0.0) and goodput({}) == (1.0, None, 0.0)
    # what no cause claims (the fit's checks and set-up, the loop's own work) is named when it lost the most
    assert goodput({"step": 1.0, "data": 2.0, "wall": 10.0}) == (0.1, "other", 0.7)
    assert history_key("data") == "time_data_s"


def test_the_closing_line_gives_the_goodput_and_a_dominant_loss_its_advice_once(caplog):
    def slower(samples):
        time.sleep(0.1)
        return default_collate(samples)

    with caplog.at_level(logging.INFO, logger="fitforge"):
        estimator().fit(loader(6, slower), epochs=2)  # 12 batches of 100 ms: over a second, most of the run
    messages = [record.getMessage() for record in caplog.records]
    assert "Goodput " in messages[-1] and "(most lost: waiting for data, " in messages[-1]
    advice = [m for m in messages if m.startswith("Waiting for data took ")]
    assert len(advice) == 1 and "num_workers" in advice[0] and messages[-2] == advice[0]


class Sleepy(BatchBegin, BatchEnd):
    """A slow hook at batch_begin, and a CancelEpoch from batch_end at the epoch's third batch."""

    def __init__(self, cancel: bool = False) -> None:
        self.cancel = cancel

    def batch_begin(self, state) -> None:
        time.sleep(SLEEP)

    def batch_end(self, state) -> None:
        if self.cancel and state.batch_idx == 2:
            raise CancelEpoch


def fast_loader():
    return loader(4, default_collate)


def test_hooks_before_the_step_are_the_handlers_time_not_the_step_s():
    history = estimator().fit(fast_loader(), epochs=1, event_handlers=[Sleepy()], default_handlers=False)
    assert history["time_handlers_s"][0] >= 4 * SLEEP > history["time_step_s"][0]


def test_a_batch_that_raises_a_cancel_is_timed_too():
    est = estimator()
    history = est.fit(fast_loader(), epochs=1, event_handlers=[Sleepy(cancel=True)], default_handlers=False)
    assert history["time_handlers_s"][0] >= 3 * SLEEP  # the three batches' hooks, the cancelling one's included


def test_a_cause_timed_within_a_hook_is_not_the_hooks_and_an_unknown_one_is_refused():
    clock = RunClock()
    with clock.hooks(), clock.timing("data"):
        time.sleep(SLEEP)
    assert clock.epoch["data"] >= SLEEP and clock.epoch["handlers"] < SLEEP
    with pytest.raises(FitforgeValueError, match="cause must be one of"), clock.timing("waiting"):
        pass


def test_a_spike_rollback_takes_the_steps_since_its_snapshot_and_nothing_counts_twice():
    class Spike(nn.Module):  # a loss 1000x at the fifth batch of each epoch
        def __init__(self):
            super().__init__()
            self.linear, self.calls = nn.Linear(3, 1), 0

        def forward(self, x):
            self.calls += 1
            return self.linear(x) * (1000.0 if self.calls % 8 == 5 else 1.0)

    class Totals(TrainEnd):
        def train_end(self, state):
            self.totals = state.run.clock.totals()

    torch.manual_seed(0)
    est, totals = Estimator(Spike(), nn.MSELoss(), optimizer="sgd", device="cpu"), Totals()
    guard = SpikeGuardHandler(window=3, snapshot_every=1)
    est.fit(loader(8), epochs=2, event_handlers=[guard, totals], default_handlers=False)  # 10 ms a batch's data
    assert guard.recoveries and totals.totals["rollback"] > 0 and totals.totals["step"] > 0
    assert sum(seconds for cause, seconds in totals.totals.items() if cause != "wall") <= totals.totals["wall"]


def test_a_quorum_formed_as_the_next_batch_is_read_is_no_wait_for_data():
    clock = RunClock()
    clock.open_batches()
    clock.waited = 0.5  # the loop's measure of the wait for a batch, a quorum of 0.2 s within it
    clock.within_data("quorum", 0.2)
    clock.close_batches()
    assert clock.epoch["data"] == pytest.approx(0.3) and clock.epoch["quorum"] == pytest.approx(0.2)
    assert clock.reported == 0.0  # no hook's time: the handlers' seconds keep theirs
