"""LRSchedulerHandler: per-epoch and per-step stepping (with accumulation), plateau on a monitor,
the lr history, one_cycle's length, exact resume with every kind of scheduler, and clear errors."""

import inspect
import itertools
import logging
import math
import os
import re
import signal

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S
from torch.utils.data import DataLoader, TensorDataset

from fitforge import BatchOutput, BatchProcessor, Estimator, TrainState
from fitforge.events import BatchBegin, BatchEnd, RunControl
from fitforge.exceptions import (
    CancelBatch,
    FitforgeTypeError,
    FitforgeValueError,
    LossInputError,
    MonitorKeyError,
)
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler
from fitforge.handlers.lr_scheduler import LRSchedulerHandler
from fitforge.testing import linear_problem
from helpers import Crash, Losses

# linear_problem: 256 samples in batches of 32 = 8 batches per epoch, SGD lr 0.1.


class LRs(BatchBegin):
    """The learning rate each batch trains with."""

    def __init__(self):
        self.seen = []

    def batch_begin(self, state):
        self.seen.append(state.estimator.optimizer.param_groups[0]["lr"])


def fit(make_handler, epochs=2, batches=None, extra=(), data=None, **fit_kwargs):
    estimator, train, _ = linear_problem()
    handler = make_handler(estimator.optimizer)
    recorder = LRs()
    history = estimator.fit(
        data or train,
        epochs=None if batches else epochs,
        batches=batches,
        event_handlers=[handler, recorder, *extra],
        **fit_kwargs,
    )
    return handler, recorder.seen, history


def test_an_epoch_scheduler_steps_at_each_epoch_end_and_history_holds_the_lr_after_it():
    handler, seen, history = fit(lambda opt: LRSchedulerHandler(S.StepLR(opt, step_size=1, gamma=0.5)), epochs=3)
    assert seen == [0.1] * 8 + [0.05] * 8 + [0.025] * 8
    assert history["lr"] == [0.05, 0.025, 0.0125]  # after each epoch's step: what the next epoch starts with
    assert handler.scheduler.last_epoch == 3


def test_a_batch_scheduler_steps_after_every_optimizer_step():
    _, seen, history = fit(lambda opt: LRSchedulerHandler(S.ExponentialLR(opt, 0.9), interval="batch"))
    expected = [0.1]
    for _ in range(16):
        expected.append(expected[-1] * 0.9)  # as ExponentialLR computes it: chained products
    assert seen == pytest.approx(expected[:16], rel=1e-12)
    assert history["lr"] == pytest.approx([expected[8], expected[16]], rel=1e-12)


def test_with_gradient_accumulation_it_steps_once_per_optimizer_step_trailing_group_included():
    # accumulate=3 over 8 batches: steps after batches 3, 6 and the trailing group's at epoch end.
    handler, seen, history = fit(
        lambda opt: LRSchedulerHandler(S.ExponentialLR(opt, 0.5), interval="batch"),
        extra=[GradientUpdateHandler(accumulate=3)],
    )
    assert handler.scheduler.last_epoch == 6
    assert seen[:8] == pytest.approx([0.1] * 3 + [0.05] * 3 + [0.025] * 2)
    assert history["lr"] == pytest.approx([0.1 * 0.5**3, 0.1 * 0.5**6])  # recorded after the trailing step


def feed(handler, values, estimator, key="val_loss", **epoch_state):
    """Epoch ends whose ``key`` takes ``values`` (None: not produced); the lr after each."""
    state = TrainState(estimator, num_batches=8)
    handler.train_begin(state)
    lrs = []
    for epoch, value in enumerate(values):
        state.epoch = epoch
        state.history.new_epoch()
        handler.epoch_begin(state)
        state.batch_idx, state.run.epoch_finished = 7, True
        for name, setting in epoch_state.items():
            setattr(state if name == "batch_idx" else state.run, name, setting)
        if value is not None:
            state.history.record(key, value)
        handler.epoch_end(state)
        lrs.append(estimator.optimizer.param_groups[0]["lr"])
    return lrs, state


def test_plateau_steps_with_the_monitored_value_and_skips_epochs_without_one():
    estimator, _, _ = linear_problem()
    plateau = S.ReduceLROnPlateau(estimator.optimizer, factor=0.5, patience=0)
    lrs, state = feed(LRSchedulerHandler(plateau, monitor="val_loss"), [1.0, 0.9, 0.95, None, 0.96], estimator)
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.025]  # 0.95 and 0.96 do not beat 0.9; the epoch without one waits
    assert state.history["lr"][2] == 0.05 and math.isnan(state.history["lr"][3])  # recorded where it stepped


@pytest.mark.parametrize("mode, diverged", [("min", -math.inf), ("max", math.inf)])
def test_plateau_counts_an_infinite_value_as_no_improvement(mode, diverged):
    estimator, _, _ = linear_problem()
    plateau = S.ReduceLROnPlateau(estimator.optimizer, mode=mode, factor=0.5, patience=0)
    key, values = ("val_loss", [1.0, diverged, 0.5]) if mode == "min" else ("val_accuracy", [0.5, diverged, 0.9])
    lrs, _ = feed(LRSchedulerHandler(plateau, monitor=key), values, estimator, key=key)
    assert lrs == [0.1, 0.05, 0.05]  # the diverged epoch cuts the rate; it never becomes a best to beat
    assert plateau.best == values[2]


@pytest.mark.parametrize(
    "epoch_state",
    [
        {"preempted": signal.SIGTERM, "epoch_finished": False, "batch_idx": 2},  # SIGTERM three batches in
        {"stop_requested": True, "epoch_finished": False, "batch_idx": 4},  # batches=N or a stop cut it short
    ],
)
def test_an_epoch_cut_short_does_not_step_an_epoch_scheduler(epoch_state):
    estimator, _, _ = linear_problem()
    handler = LRSchedulerHandler(S.StepLR(estimator.optimizer, step_size=1, gamma=0.5))
    lrs, _ = feed(handler, [None, None], estimator, **epoch_state)
    assert lrs == [0.1, 0.1] and handler.scheduler.last_epoch == 0
    lrs, _ = feed(handler, [None], estimator, epoch_finished=True, batch_idx=2)
    assert lrs == [0.05]  # a CancelEpoch: the run goes on with the next epoch, so this one is done


def test_plateau_in_a_real_fit_with_validation():
    estimator, train, val = linear_problem(lr=0.5)
    plateau = S.ReduceLROnPlateau(estimator.optimizer, factor=0.1, patience=0, threshold=10, threshold_mode="abs")
    history = estimator.fit(
        train, val_data=val, epochs=3, event_handlers=[LRSchedulerHandler(plateau, monitor="val_loss")]
    )
    assert history["lr"] == pytest.approx([0.5, 0.05, 0.005])  # nothing beats the first by 10: cut each epoch after


def test_it_runs_after_metrics_and_validation_and_before_the_checkpoint(tmp_path):
    estimator, _, val = linear_problem()
    handler = LRSchedulerHandler(S.StepLR(estimator.optimizer, 1))
    loop = estimator.describe_loop([handler, CheckpointHandler(tmp_path)], val_data=val)
    epoch_end = next(line for line in loop.splitlines() if line.startswith("epoch_end"))
    order = [name.split("(")[0] for name in epoch_end.split()[1:] if name != "->"]
    assert order.index("MetricHandler") < order.index("ValidationHandler") < order.index("LRSchedulerHandler")
    assert order.index("LRSchedulerHandler") < order.index("CheckpointHandler")


@pytest.mark.skipif(
    "check_access" not in inspect.signature(Estimator.fit).parameters, reason="fit has no check_access yet"
)
@pytest.mark.parametrize(
    "make",
    [
        lambda opt: LRSchedulerHandler(S.ReduceLROnPlateau(opt, patience=0), monitor="val_loss"),
        lambda opt: LRSchedulerHandler(S.ExponentialLR(opt, 0.9), interval="batch"),
        lambda opt: LRSchedulerHandler.one_cycle(0.5),
    ],
)
def test_its_reads_and_writes_declarations_hold(make, tmp_path):
    estimator, train, val = linear_problem()
    estimator.fit(
        train,
        val_data=val,
        epochs=2,
        check_access=True,
        event_handlers=[make(estimator.optimizer), GradientUpdateHandler(accumulate=3)],
    )


# -- one_cycle -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, accumulate, total",
    [
        ({"epochs": 2}, 1, 16),
        ({"batches": 10}, 1, 10),
        ({"epochs": 2}, 3, 6),
        ({"batches": 10}, 3, 3 + 1),
    ],
)
def test_one_cycle_spans_the_fit_and_ends_at_its_last_step(length, accumulate, total):
    estimator, train, _ = linear_problem()
    handler = LRSchedulerHandler.one_cycle(max_lr=1.0, anneal_strategy="linear")
    estimator.fit(train, event_handlers=[handler, GradientUpdateHandler(accumulate=accumulate)], **length)
    assert (handler.scheduler.total_steps, handler.scheduler.last_epoch) == (total, total - 1)
    assert handler.interval == "batch"
    group = estimator.optimizer.param_groups[0]  # the last step trained at the cycle's end, where it stays
    assert group["lr"] == pytest.approx(1.0 / 25 / 1e4) and group["momentum"] == pytest.approx(0.95)


def test_one_cycle_reaches_max_lr_and_sets_no_momentum_on_an_optimizer_without_one():
    net = nn.Linear(1, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adagrad(net.parameters()), device="cpu")
    _, train, _ = linear_problem()
    recorder = LRs()
    estimator.fit(train, epochs=2, event_handlers=[LRSchedulerHandler.one_cycle(0.2, pct_start=0.5), recorder])
    assert max(recorder.seen) == pytest.approx(0.2) and recorder.seen[0] == pytest.approx(0.2 / 25)


def test_one_cycle_never_steps_past_its_end_when_a_cancelled_batch_adds_a_step():
    class CancelAfterStep(BatchEnd):  # after GradientUpdateHandler's step: a step that is no batch
        def batch_end(self, state):
            if state.global_step == 3 and not getattr(self, "done", False):
                self.done = True
                raise CancelBatch

    handler, _, _ = fit(lambda opt: LRSchedulerHandler.one_cycle(0.5), batches=8, extra=[CancelAfterStep()])
    assert handler.scheduler.total_steps == 8 and handler.scheduler.last_epoch == 7  # 9 optimizer steps


def test_one_cycle_needs_the_fits_length():
    estimator, train, _ = linear_problem()

    class NoLen:
        def __iter__(self):
            return iter(train)

    with pytest.raises(
        FitforgeValueError,
        match=r"cannot tell the fit's length: train_data has no len\(\) and fit "
        r"was given epochs=2; pass batches=N to fit, or total_steps=N",
    ):
        estimator.fit(NoLen(), epochs=2, event_handlers=[LRSchedulerHandler.one_cycle(0.5)])
    handler = LRSchedulerHandler.one_cycle(0.5)
    estimator.fit(NoLen(), batches=5, event_handlers=[handler])
    assert handler.scheduler.total_steps == 5
    handler = LRSchedulerHandler.one_cycle(0.5, total_steps=100)  # a length given wins
    estimator.fit(NoLen(), epochs=1, event_handlers=[handler])
    assert handler.scheduler.total_steps == 100


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: LRSchedulerHandler.one_cycle("fast"),
            FitforgeTypeError,
            "one_cycle: max_lr must be a positive number .* got str 'fast'",
        ),
        (
            lambda: LRSchedulerHandler.one_cycle(-1.0),
            FitforgeValueError,
            "max_lr must be positive and finite, got -1.0",
        ),
        (lambda: LRSchedulerHandler.one_cycle(0.1, optimizer=-1), FitforgeTypeError, "optimizer must be an index"),
        (
            lambda: LRSchedulerHandler.one_cycle(0.1, pct=0.3),
            FitforgeTypeError,
            r"one_cycle got unknown argument\(s\) \['pct'\]; OneCycleLR takes .*pct_start",
        ),
    ],
)
def test_one_cycle_argument_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_one_cycle_errors_at_fit_start_name_the_problem():
    estimator, train, _ = linear_problem()
    with pytest.raises(FitforgeValueError, match=r"optimizer=1, but the estimator has 1 optimizer\(s\)"):
        estimator.fit(train, epochs=1, event_handlers=[LRSchedulerHandler.one_cycle(0.1, optimizer=1)])
    with pytest.raises(FitforgeValueError, match="OneCycleLR rejected max_lr=0.1 .*pct_start"):
        estimator.fit(train, epochs=1, event_handlers=[LRSchedulerHandler.one_cycle(0.1, pct_start=2.0)])


# -- warm-up + cosine ---------------------------------------------------------------------------------


class StepLRs(BatchBegin):
    """The learning rate of each optimizer step: read at the first batch of each accumulation group."""

    def __init__(self, accumulate):
        self.accumulate, self.seen = accumulate, []

    def batch_begin(self, state):
        if state.batch_idx % self.accumulate == 0:  # a group starts: its step uses this rate
            self.seen.append(state.estimator.optimizer.param_groups[0]["lr"])


def test_warmup_cosine_counts_optimizer_steps_around_accumulation_and_ends_at_min_lr():
    torch.manual_seed(0)
    x, y = torch.randn(40, 1), torch.randn(40, 1)
    net = nn.Linear(1, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.4), device="cpu")
    recorder, handler = StepLRs(4), LRSchedulerHandler.warmup_cosine(warmup=3, min_lr=0.01)
    data = DataLoader(TensorDataset(x, y), batch_size=4)  # 10 batches: groups of 4, 4, 2 per epoch
    estimator.fit(data, epochs=3, event_handlers=[handler, recorder, GradientUpdateHandler(accumulate=4)])
    assert handler.scheduler.total_steps == 9 and len(recorder.seen) == 9  # 3 epochs x ceil(10 / 4)
    assert recorder.seen[:4] == pytest.approx([0.0, 0.4 / 3, 0.8 / 3, 0.4])  # linear from 0: the peak at step 3
    assert recorder.seen[3] == max(recorder.seen)
    assert recorder.seen[-1] == pytest.approx(0.01)  # min_lr at the 9th and last optimizer step
    decay = recorder.seen[3:]
    assert all(a > b for a, b in itertools.pairwise(decay))
    middle = 0.01 + (0.4 - 0.01) * (1 + math.cos(math.pi * 2 / 5)) / 2  # step 5: 2 of the decay's 5 steps
    assert recorder.seen[5] == pytest.approx(middle)
    assert repr(handler) == "LRSchedulerHandler(WarmupCosineLR, interval='batch')"


def test_warmup_as_a_fraction_of_the_fit_and_one_min_lr_per_group():
    estimator, train, _ = linear_problem()  # 8 batches per epoch
    net = estimator.net
    estimator.optimizers = [torch.optim.SGD([{"params": [net.weight]}, {"params": [net.bias], "lr": 0.02}], lr=0.1)]
    handler = LRSchedulerHandler.warmup_cosine(warmup=0.25, min_lr=[0.001, 0.0])
    estimator.fit(train, epochs=2, event_handlers=[handler])
    scheduler = handler.scheduler
    assert (scheduler.total_steps, scheduler.warmup_steps) == (16, 4)  # int(0.25 * 16)
    assert [group["lr"] for group in estimator.optimizers[0].param_groups] == pytest.approx([0.001, 0.0])
    assert scheduler.rate(0.1, 0.001, 4) == pytest.approx(0.1) and scheduler.rate(0.1, 0.001, 2) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: LRSchedulerHandler.warmup_cosine(warmup=1.5), "(a float from 0 to 1, e.g. 0.1), got float 1.5"),
        (lambda: LRSchedulerHandler.warmup_cosine(warmup=-1), "warmup is optimizer steps (an int >= 0)"),
        (lambda: LRSchedulerHandler.warmup_cosine(warmup=True), "got bool True"),
        (lambda: LRSchedulerHandler.warmup_cosine(warmup=2, optimizer="0"), "optimizer must be an index"),
        (lambda: LRSchedulerHandler.warmup_cosine(warmup=2, min_lr=-0.1), "min_lr must be a rate >= 0"),
        (lambda: LRSchedulerHandler.warmup_cosine(warmup=2, total_steps=9.0), "total_steps must be an int >= 2"),
        (lambda: LRSchedulerHandler.warmup_cosine(warmup=2, total_steps=0), "total_steps must be an int >= 2"),
    ],
)
def test_warmup_cosine_argument_errors(call, message):
    with pytest.raises((FitforgeValueError, FitforgeTypeError), match=re.escape(message)):
        call()


def test_warmup_cosine_errors_at_fit_start_name_the_problem():
    estimator, train, _ = linear_problem()
    weights = [p.clone() for p in estimator.net.parameters()]
    with pytest.raises(FitforgeValueError, match=r"takes 8 optimizer step\(s\), which leaves no decay after a warm-up"):
        estimator.fit(train, epochs=1, event_handlers=[LRSchedulerHandler.warmup_cosine(warmup=7)])
    with pytest.raises(
        FitforgeValueError, match=r"min_lr=0.5 is above the rate it decays from, the optimizer's lr=0.1"
    ):
        estimator.fit(train, epochs=1, event_handlers=[LRSchedulerHandler.warmup_cosine(warmup=2, min_lr=0.5)])

    class NoLen:
        def __iter__(self):
            return iter(train)

    with pytest.raises(FitforgeValueError, match=r"train_data has no len\(\) and fit was given epochs=2; pass batches"):
        estimator.fit(NoLen(), epochs=2, event_handlers=[LRSchedulerHandler.warmup_cosine(warmup=2)])
    assert all(torch.equal(a, b) for a, b in zip(weights, estimator.net.parameters()))


def test_warmup_as_a_numpy_int_or_a_fraction_rounds_as_expected():
    import numpy as np

    estimator, train, _ = linear_problem()  # 8 batches per epoch: 100 steps in 12.5 epochs, so use batches=
    handler = LRSchedulerHandler.warmup_cosine(warmup=0.29)
    estimator.fit(train, batches=100, event_handlers=[handler])
    assert handler.scheduler.warmup_steps == 29  # 0.29 * 100 is 28.999... in floats
    handler = LRSchedulerHandler.warmup_cosine(warmup=np.int64(3))
    linear_problem()[0].fit(train, epochs=1, event_handlers=[handler])
    assert handler.scheduler.warmup_steps == 3
    assert LRSchedulerHandler.warmup_cosine(warmup=0.0)._recipe.warmup == 0.0  # no warm-up, as warmup=0


def test_a_schedule_that_cannot_be_built_fails_once_with_its_own_error(caplog):
    estimator, train, _ = linear_problem()
    with caplog.at_level(logging.ERROR, logger="fitforge"), pytest.raises(FitforgeValueError, match="no decay"):
        estimator.fit(train, epochs=1, event_handlers=[LRSchedulerHandler.warmup_cosine(warmup=7)])
    assert "train_end" not in caplog.text and estimator.optimizer.param_groups[0]["lr"] == 0.1


def test_a_fit_that_fails_before_its_first_step_leaves_the_rates_as_they_were():
    estimator, train, _ = linear_problem()
    bad = [(x, y.long().squeeze(1)) for x, y in train]  # integer labels for MSELoss: refused at the first batch
    with pytest.raises(LossInputError):
        estimator.fit(bad, epochs=2, event_handlers=[LRSchedulerHandler.warmup_cosine(warmup=2)])
    assert estimator.optimizer.param_groups[0]["lr"] == 0.1  # not the warm-up's first rate, 0
    with pytest.raises(LossInputError):
        estimator.fit(bad, epochs=2, event_handlers=[LRSchedulerHandler.one_cycle(max_lr=1.0)])
    assert estimator.optimizer.param_groups[0]["lr"] == 0.1


class TwoTurns(BatchProcessor):
    """Two optimizers taking turns on the batches of a linear problem."""

    def fit_batch(self, state, batch):
        output = super().fit_batch(state, batch)
        return BatchOutput(
            output.data,
            output.label,
            output.pred,
            output.loss,
            output.losses,
            output.batch_size,
            step=[state.global_step % 2],
        )


def test_optimizers_taking_turns_get_a_warning_and_total_steps_sizes_the_schedule(caplog):
    def fit(handler):
        estimator, train, _ = linear_problem()
        net = estimator.net
        estimator.optimizers = [torch.optim.SGD([net.weight], lr=0.1), torch.optim.SGD([net.bias], lr=0.1)]
        estimator.batch_processor = TwoTurns()
        estimator.fit(train, epochs=2, event_handlers=[handler])
        return estimator.optimizers[0].param_groups[0]["lr"]

    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(LRSchedulerHandler.warmup_cosine(warmup=2, min_lr=0.01))
    assert "optimizer 0 stepped 1 of the fit's first 2 optimizer steps (optimizers taking turns)" in caplog.text
    assert "give total_steps=N" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        last = fit(LRSchedulerHandler.warmup_cosine(warmup=2, min_lr=0.01, total_steps=8))  # 16 batches, 8 each
    assert "taking turns" not in caplog.text and last == pytest.approx(0.01)


def test_warmup_cosine_lr_on_its_own():
    from fitforge.optim.schedules import WarmupCosineLR

    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    scheduler = WarmupCosineLR(optimizer, warmup_steps=0, total_steps=3)
    rates = [scheduler.get_last_lr()[0]]
    for _ in range(4):  # past its end it stays at min_lr
        optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    assert rates == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])
    again = WarmupCosineLR(optimizer, warmup_steps=0, total_steps=3)
    again.load_state_dict(scheduler.state_dict())
    assert again.last_epoch == 4 and again.min_lrs == [0.0]
    with pytest.raises(FitforgeValueError, match="total_steps=3 leaves no decay after warmup_steps=2"):
        WarmupCosineLR(optimizer, warmup_steps=2, total_steps=3)
    with pytest.raises(FitforgeTypeError, match="total_steps must be an int >= 0, got float 3.0"):
        WarmupCosineLR(optimizer, warmup_steps=0, total_steps=3.0)


# -- errors ------------------------------------------------------------------------------------------


def test_argument_errors_name_the_argument_what_was_given_and_what_is_expected():
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(
        FitforgeTypeError,
        match=r"scheduler must be a torch.optim.lr_scheduler scheduler instance, "
        r"got SGD .*; wrap the optimizer in one, e.g. StepLR",
    ):
        LRSchedulerHandler(opt)
    with pytest.raises(FitforgeTypeError, match="got the class StepLR"):
        LRSchedulerHandler(S.StepLR)
    with pytest.raises(FitforgeValueError, match="interval must be 'epoch' or 'batch', got 'step'"):
        LRSchedulerHandler(S.StepLR(opt, 1), interval="step")
    with pytest.raises(FitforgeTypeError, match="interval must be 'epoch' or 'batch', got int 1"):
        LRSchedulerHandler(S.StepLR(opt, 1), interval=1)
    with pytest.raises(
        FitforgeValueError, match="ReduceLROnPlateau steps with a monitored value; pass monitor='val_loss'"
    ):
        LRSchedulerHandler(S.ReduceLROnPlateau(opt))
    with pytest.raises(FitforgeValueError, match="use interval='epoch', got interval='batch'"):
        LRSchedulerHandler(S.ReduceLROnPlateau(opt), interval="batch", monitor="val_loss")
    with pytest.raises(FitforgeValueError, match="monitor is only for ReduceLROnPlateau; StepLR steps without"):
        LRSchedulerHandler(S.StepLR(opt, 1), monitor="val_loss")
    with pytest.raises(FitforgeTypeError, match="monitor must be a history key"):
        LRSchedulerHandler(S.ReduceLROnPlateau(opt), monitor=3)


def test_a_scheduler_of_another_optimizer_fails_before_training():
    estimator, train, _ = linear_problem()
    before = [p.detach().clone() for p in estimator.net.parameters()]
    stranger = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(
        FitforgeValueError,
        match=r"the scheduler's optimizer \(SGD .*\) is not one of the "
        r"estimator's 1 optimizer\(s\); build the scheduler on",
    ):
        estimator.fit(train, epochs=1, event_handlers=[LRSchedulerHandler(S.StepLR(stranger, 1))])
    assert all(torch.equal(a, b) for a, b in zip(before, estimator.net.parameters()))


def test_a_monitor_the_run_does_not_produce_or_a_mode_that_disagrees_is_an_error_at_fit_start():
    estimator, train, val = linear_problem()
    with pytest.raises(MonitorKeyError, match="monitors 'val_los', which this run will not produce"):
        estimator.fit(
            train,
            val_data=val,
            epochs=1,
            event_handlers=[LRSchedulerHandler(S.ReduceLROnPlateau(estimator.optimizer), monitor="val_los")],
        )
    with pytest.raises(
        FitforgeValueError,
        match=r"ReduceLROnPlateau\(mode='max'\) would cut the learning rate while "
        r"'val_loss' improves: a lower value is better .*mode='min'",
    ):
        estimator.fit(
            train,
            val_data=val,
            epochs=1,
            event_handlers=[
                LRSchedulerHandler(S.ReduceLROnPlateau(estimator.optimizer, mode="max"), monitor="val_loss")
            ],
        )


def test_state_dict_round_trip_and_a_one_cycle_state_loaded_before_fit():
    handler, _, _ = fit(lambda opt: LRSchedulerHandler.one_cycle(0.5), epochs=1)
    saved = handler.state_dict()
    assert saved["optimizer_steps"] == 8 and saved["scheduler"]["last_epoch"] == 7
    fresh = LRSchedulerHandler.one_cycle(0.5)
    assert fresh.state_dict() == {"scheduler": None, "optimizer_steps": None}
    fresh.load_state_dict(saved)  # kept until train_begin builds the scheduler
    estimator, _, _ = linear_problem()
    fresh.train_begin(TrainState(estimator, num_batches=8, run=RunControl(max_epochs=1)))
    assert fresh.scheduler.last_epoch == 7 and fresh._steps_seen == 8
    assert repr(fresh) == "LRSchedulerHandler(OneCycleLR, interval='batch')"


# -- exact resume ------------------------------------------------------------------------------------

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)  # 6 batches of 8

SCHEDULERS = {
    # Schedules that depend on the scheduler's own counters (not only the optimizer's current lr), so
    # that a resume without the scheduler's state would go wrong.
    "epoch StepLR": lambda opt: LRSchedulerHandler(S.StepLR(opt, step_size=2, gamma=0.5)),
    "epoch plateau": lambda opt: LRSchedulerHandler(  # nothing beats the first by 10: cut after epoch 2
        S.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10, threshold_mode="abs"), monitor="train_loss"
    ),
    "batch LambdaLR": lambda opt: LRSchedulerHandler(
        S.LambdaLR(opt, lambda step: 1 / (1 + 0.1 * step)), interval="batch"
    ),
    "batch one_cycle": lambda opt: LRSchedulerHandler.one_cycle(0.05),
    "batch warmup_cosine": lambda opt: LRSchedulerHandler.warmup_cosine(warmup=0.25, min_lr=0.001),
}


class Sigterm(BatchBegin):
    priority = 950

    def __init__(self, at):
        self.at = at

    def batch_begin(self, state):
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


made = []  # the handlers train() made, newest last


def train(folder, scheduler, seed=0, resume=False, extra=(), accumulate=1, batch_period=1, epoch_period=None):
    """(weights, losses by step, history or None when it crashed)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device="cpu"
    )
    losses = Losses()
    made.append(SCHEDULERS[scheduler](estimator.optimizer))
    handlers = [
        made[-1],
        losses,
        GradientUpdateHandler(accumulate=accumulate),
        CheckpointHandler(
            folder,
            epoch_period=epoch_period,
            batch_period=batch_period,
            max_checkpoints=2,
            resume_from_checkpoint=resume,
        ),
        *extra,
    ]
    data = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    try:
        history = estimator.fit(data, epochs=2, event_handlers=handlers)
    except RuntimeError as error:
        assert str(error) == "crash"
        history = None
    return {k: v.clone() for k, v in net.state_dict().items()}, losses.seen, history


_whole = {}


def uninterrupted(tmp_path_factory, scheduler, accumulate=1):
    if (scheduler, accumulate) not in _whole:
        _whole[scheduler, accumulate] = train(tmp_path_factory.mktemp("whole"), scheduler, accumulate=accumulate)
    return _whole[scheduler, accumulate]


def assert_same_run(resumed, whole):
    weights, _, history = resumed
    assert all(torch.equal(weights[k], whole[0][k]) for k in whole[0])
    assert history["lr"] == whole[2]["lr"] and history["train_loss"] == whole[2]["train_loss"]


# 6: the last batch of epoch 1 (saved before its epoch end, where an epoch scheduler steps);
# 9: mid-epoch (and, with accumulate=4, mid-group).
@pytest.mark.parametrize("crash", [6, 9])
@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_a_crash_after_a_mid_epoch_checkpoint_resumes_exactly(tmp_path, tmp_path_factory, scheduler, crash):
    whole = uninterrupted(tmp_path_factory, scheduler)
    assert whole[2]["lr"][-1] < 0.01  # the schedule moved
    _, before, _ = train(tmp_path, scheduler, extra=[Crash(crash)])
    resumed = train(tmp_path, scheduler, seed=123, resume=True)
    assert {**before, **resumed[1]} == whole[1]  # every step's loss, so every step's lr
    assert_same_run(resumed, whole)


@pytest.mark.parametrize("scheduler", ["batch LambdaLR", "batch one_cycle", "batch warmup_cosine"])
def test_a_resume_inside_an_accumulation_group_is_exact(tmp_path, tmp_path_factory, scheduler):
    whole = uninterrupted(tmp_path_factory, scheduler, accumulate=4)
    train(tmp_path, scheduler, extra=[Crash(9)], accumulate=4)
    assert_same_run(train(tmp_path, scheduler, seed=123, resume=True, accumulate=4), whole)


def test_a_sigterm_mid_epoch_does_not_step_an_epoch_scheduler_and_resumes_exactly(tmp_path, tmp_path_factory):
    whole = uninterrupted(tmp_path_factory, "epoch StepLR")
    with pytest.raises(SystemExit):
        train(tmp_path, "epoch StepLR", extra=[Sigterm(8)], batch_period=None, epoch_period=9)  # saves at the signal
    assert made[-1].scheduler.last_epoch == 1  # the partial epoch 2 was not stepped at its epoch end
    saved = torch.load(tmp_path / "model-epoch1batch9.pt", weights_only=True)
    assert saved["handlers"]["LRSchedulerHandler"]["scheduler"]["last_epoch"] == 1
    assert_same_run(train(tmp_path, "epoch StepLR", seed=123, resume=True, batch_period=None, epoch_period=9), whole)


# -- a OneCycleLR the user sized is checked against the fit's length at fit start -----------------------------
def test_a_one_cycle_sized_for_fewer_steps_than_the_fit_fails_before_the_first_step():
    estimator, train, _ = linear_problem()  # 8 batches per epoch
    before = [p.detach().clone() for p in estimator.net.parameters()]
    short = S.OneCycleLR(estimator.optimizer, max_lr=0.5, total_steps=20)
    message = (
        r"the OneCycleLR has 20 of its total_steps=20 left, but this fit takes 24 optimizer steps: .*"
        r"Tried to step.* OneCycleLR\(\.\.\., total_steps=24\) \(a new one\), or use LRSchedulerHandler.one_cycle"
    )
    with pytest.raises(FitforgeValueError, match=message):
        estimator.fit(train, epochs=3, event_handlers=[LRSchedulerHandler(short, interval="batch")])
    assert all(p.detach().equal(b) for p, b in zip(estimator.net.parameters(), before))
    exact = S.OneCycleLR(estimator.optimizer, max_lr=0.5, total_steps=24)
    estimator.fit(train, epochs=3, event_handlers=[LRSchedulerHandler(exact, interval="batch")])
    assert exact.last_epoch == 24


def test_a_one_cycle_stepped_per_epoch_warns_when_it_cannot_reach_max_lr(caplog):
    estimator, train, _ = linear_problem()
    per_batch = S.OneCycleLR(estimator.optimizer, max_lr=0.5, total_steps=24)  # sized in batches
    with caplog.at_level("WARNING", logger="fitforge"):
        estimator.fit(train, epochs=3, event_handlers=[LRSchedulerHandler(per_batch)])
    assert "this fit's 3 epochs end it at step 3 of total_steps=24, before its peak (max_lr) at step 6" in caplog.text
    caplog.clear()
    estimator, train, _ = linear_problem()
    per_epoch = S.OneCycleLR(estimator.optimizer, max_lr=0.5, total_steps=3)
    with caplog.at_level("WARNING", logger="fitforge"):
        estimator.fit(train, epochs=3, event_handlers=[LRSchedulerHandler(per_epoch)])
    assert "OneCycleLR" not in caplog.text
    too_short = S.OneCycleLR(estimator.optimizer, max_lr=0.5, total_steps=3)  # 3 epochs more: 6 > 3
    with pytest.raises(FitforgeValueError, match="has 3 of its total_steps=3 left, but this fit takes 4 epochs"):
        estimator.fit(train, epochs=4, event_handlers=[LRSchedulerHandler(too_short)])
