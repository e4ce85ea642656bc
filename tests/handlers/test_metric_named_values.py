"""Named values (state.log) through the handlers: declared names as history keys and monitors, name
clashes, the log line, the progress bar, CSV and TensorBoard, and exact mid-epoch resume."""

import logging
import math
import re

import pytest
import torch
from torch import nn

import fitforge.handlers.progress_bar as progress_bar
from fitforge import BatchProcessor
from fitforge.events import BatchEnd
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, MonitorKeyError
from fitforge.handlers import (
    CheckpointHandler,
    EarlyStoppingHandler,
    LoggingHandler,
    MetricHandler,
    ProgressBarHandler,
)
from fitforge.handlers.csv_logger import CSVLoggerHandler
from helpers import Crash, make_estimator, regression_batches

TRAIN, VAL = regression_batches(3), regression_batches(2, seed=1)


class GanLike(BatchProcessor):
    """Declares g_loss; also logs d_loss (undeclared) from the second epoch on."""

    logs = ("g_loss",)

    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        state.log("g_loss", out.loss.detach() * 2)
        if state.epoch >= 1:
            state.log("d_loss", 0.5)
        return out

    def evaluate_batch(self, state, batch):
        out = super().evaluate_batch(state, batch)
        state.log("g_loss", out.loss * 3)
        return out


def test_declared_names_are_history_keys_before_training():
    est = make_estimator(batch_processor=GanLike())
    keys = est.history_keys(validation=True)
    assert "train_g_loss" in keys and "val_g_loss" in keys and "train_d_loss" not in keys
    assert MetricHandler().history_keys(est, "validate") == ["val_loss", "val_mae", "val_g_loss"]


def test_a_declared_name_can_be_monitored_an_undeclared_one_cannot():
    est = make_estimator(batch_processor=GanLike())
    history = est.fit(TRAIN, val_data=VAL, epochs=2, event_handlers=[EarlyStoppingHandler("val_g_loss", patience=5)])
    assert history["val_g_loss"] == pytest.approx([3 * v for v in history["val_loss"]])
    with pytest.raises(
        MonitorKeyError,
        match=re.escape(
            "A value a step logs with state.log('d_loss', ...) is known before training only when its name is "
            "declared in BatchProcessor.logs, e.g. logs = ('d_loss',)"
        ),
    ):
        est.fit(TRAIN, epochs=2, event_handlers=[EarlyStoppingHandler("train_d_loss")])


def test_an_undeclared_name_appears_from_its_first_epoch():
    history = make_estimator(batch_processor=GanLike()).fit(TRAIN, epochs=3)
    assert math.isnan(history["train_d_loss"][0]) and history["train_d_loss"][1:] == [0.5, 0.5]
    assert history["train_g_loss"] == pytest.approx([2 * v for v in history["train_loss"]])


@pytest.mark.parametrize("logs", ["g_loss", ("g_loss", ""), ("g_loss", 3)])
def test_a_bad_declaration_is_refused_at_fit_start(logs):
    class Bad(BatchProcessor):
        pass

    Bad.logs = logs
    with pytest.raises(FitforgeTypeError, match=r"Bad\.logs must "):
        make_estimator(batch_processor=Bad()).fit(TRAIN, epochs=1)


def logging_processor(name, phase="fit_batch", declared=()):
    class Logs(BatchProcessor):
        logs = declared

        def fit_batch(self, state, batch):
            out = super().fit_batch(state, batch)
            if phase == "fit_batch":
                state.log(name, 1.0)
            return out

        def evaluate_batch(self, state, batch):
            out = super().evaluate_batch(state, batch)
            if phase == "evaluate_batch":
                state.log(name, 1.0)
            return out

    return Logs()


def untouched(net, before):
    return all(torch.equal(p, q) for p, q in zip(net.state_dict().values(), before))


@pytest.mark.parametrize(
    ("name", "phase", "declared", "message"),
    [
        (
            "loss",
            "fit_batch",
            (),
            "the name 'loss' given to state.log('loss', ...) would record train_loss, which the "
            "loss mean records already; log the value under another name, e.g. 'loss_extra'",
        ),
        ("mae", "fit_batch", (), "would record train_mae, which the metric 'mae' records already"),
        ("mae", "evaluate_batch", (), "would record val_mae, which the metric 'mae' records already"),
        ("loss", "fit_batch", ("loss",), "the name 'loss' declared in BatchProcessor.logs would record val_loss"),
    ],
    ids=["loss", "metric", "val metric", "declared"],
)
def test_a_name_the_loss_or_a_metric_records_is_refused_before_the_first_step(name, phase, declared, message):
    est = make_estimator(batch_processor=logging_processor(name, phase, declared))
    before = [t.clone() for t in est.net.state_dict().values()]
    with pytest.raises(FitforgeValueError, match=re.escape(message)):
        est.fit(TRAIN, val_data=VAL, epochs=1)
    assert untouched(est.net, before)


def test_the_log_line_and_the_running_values_show_named_values(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator(batch_processor=GanLike()).fit(
            TRAIN, val_data=VAL, epochs=2, event_handlers=[LoggingHandler(log_interval=3)]
        )
    lines = [r.getMessage() for r in caplog.records]
    epoch_lines = [line for line in lines if line.startswith("[Epoch 2/2]")]
    assert re.search(
        r"train_g_loss=\S+ train_samples_per_s=\S+ val_loss=\S+ val_mae=\S+ val_g_loss=\S+ train_d_loss=0\.5000",
        epoch_lines[0],
    )
    assert "train_g_loss=" in next(line for line in lines if line.startswith("[Epoch 1/2 Batch 3]"))  # running values
    assert "train_d_loss=0.5000" in lines[-1]  # the final summary
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator(batch_processor=GanLike()).evaluate(VAL, event_handlers=[LoggingHandler()])
    assert re.fullmatch(r"\[Validate\] val_loss=\S+ val_mae=\S+ val_g_loss=\S+", caplog.records[-1].getMessage())


def test_the_progress_bar_shows_named_values(capsys, monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(progress_bar.time, "monotonic", lambda: float(next(clock)))  # every batch refreshes
    make_estimator(batch_processor=GanLike()).fit(
        TRAIN, val_data=VAL, epochs=2, event_handlers=[ProgressBarHandler(refresh_seconds=0.5)]
    )
    err = capsys.readouterr().err
    assert re.search(r"train_g_loss=\d+\.\d+", err) and "train_d_loss=0.5000" in err and "val_g_loss=" in err


def read_csv(path):
    import csv

    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_csv_has_declared_columns_from_the_start_and_adds_late_ones(tmp_path):
    path = tmp_path / "log.csv"
    history = make_estimator(batch_processor=GanLike()).fit(
        TRAIN, val_data=VAL, epochs=3, event_handlers=[CSVLoggerHandler(path)]
    )
    lines = read_csv(path)
    header = lines[0]
    assert {"train_g_loss", "val_g_loss", "train_d_loss"} <= set(header)
    assert header.index("train_d_loss") == len(header) - 1  # added when first logged, in epoch 2
    rows = [dict(zip(header, line)) for line in lines[1:]]
    assert [r["train_d_loss"] for r in rows] == ["nan", "0.5", "0.5"]
    assert [float(r["val_g_loss"]) for r in rows] == pytest.approx(history["val_g_loss"])


def test_tensorboard_writes_named_values(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoardHandler needs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fitforge.handlers.tensorboard import TensorBoardHandler

    history = make_estimator(batch_processor=GanLike()).fit(
        TRAIN, val_data=VAL, epochs=2, event_handlers=[TensorBoardHandler(tmp_path)]
    )
    scalars = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    scalars.Reload()
    for key in ("train_g_loss", "val_g_loss"):
        assert [e.value for e in scalars.Scalars(key)] == pytest.approx(history[key], rel=1e-6)
    assert [(e.step, e.value) for e in scalars.Scalars("train_d_loss")] == [(2, 0.5)]


# -- exact resume ------------------------------------------------------------------------------------


class StepLogs(BatchProcessor):
    logs = ("g",)

    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        state.log("g", out.loss.detach() * 2)  # depends on the weights: a resume must restore them too
        state.log("step", float(state.global_step))
        return out


class HandlerLogs(BatchEnd):
    """Logs after MetricHandler's batch_end and before the checkpoint: pending when it is written."""

    def batch_end(self, state):
        state.log("late", state.output.pred.detach().mean())


def train(folder, crash=None, resume=False):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    est = make_estimator(net=net, batch_processor=StepLogs())
    handlers = [
        HandlerLogs(),
        CheckpointHandler(folder, epoch_period=None, batch_period=1, resume_from_checkpoint=resume),
    ]
    try:
        return est.fit(regression_batches(4), epochs=3, event_handlers=handlers + ([Crash(crash)] if crash else []))
    except RuntimeError as error:
        assert str(error) == "crash"
        return None


@pytest.mark.parametrize("crash", [2, 6])  # mid epoch 1, mid epoch 2
def test_a_mid_epoch_resume_gives_the_uninterrupted_values_exactly(tmp_path, crash):
    whole = train(tmp_path / "whole")
    assert train(tmp_path / "run", crash=crash) is None
    resumed = train(tmp_path / "run", resume=True)
    for key in ("train_g", "train_step", "train_late", "train_loss"):
        assert resumed[key] == whole[key], key  # bitwise: the same sums in the same order


def test_a_checkpoint_without_named_sums_still_loads():
    est = make_estimator(batch_processor=StepLogs())
    saved = {}

    class Snapshot(BatchEnd):
        priority = 10

        def __init__(self, handler):
            self.handler = handler

        def batch_end(self, state):
            if state.batch_idx == 1:
                saved.update(self.handler.state_dict())

    handler = MetricHandler()
    est.fit(regression_batches(4), epochs=1, event_handlers=[handler, Snapshot(handler)])
    assert {"loss", "parts", "metrics", "named"} <= set(saved)
    old = {key: saved[key] for key in ("loss", "parts", "metrics")}  # as written before named values
    fresh = MetricHandler()
    fresh.load_state_dict(old)
    from fitforge import TrainState

    state = TrainState(est, batch_idx=1)
    fresh.epoch_begin(state)
    values = fresh.compute()
    assert values["train_loss"] == pytest.approx(float(saved["loss"]["sum"] / saved["loss"]["count"]))
    assert "train_g" not in values  # restarts: the old checkpoint has no sums for it, and no value came yet


class NamedOnly(BatchProcessor):
    """Reports its loss by name only: the loss it returns stays out of train_loss and val_loss."""

    logs = ("part",)
    record_loss = False

    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        state.log("part", out.loss.detach())
        return out

    def evaluate_batch(self, state, batch):
        out = super().evaluate_batch(state, batch)
        state.log("part", out.loss)
        return out


def test_a_step_can_leave_its_loss_out_and_report_named_losses_only():
    est = make_estimator(batch_processor=NamedOnly())
    keys = est.history_keys(validation=True)
    assert "train_loss" not in keys and "val_loss" not in keys and {"train_part", "val_part"} <= set(keys)
    history = est.fit(TRAIN, val_data=VAL, epochs=2)
    assert "train_loss" not in history and "val_loss" not in history
    assert history["train_part"][0] > history["train_part"][1] > 0  # the loss still trains
    assert "val_loss" not in est.evaluate(VAL) and "val_part" in est.evaluate(VAL)
    with_loss = make_estimator().fit(TRAIN, epochs=1)
    assert "train_loss" in with_loss  # the default records it


def test_monitoring_a_loss_a_step_leaves_out_says_why():
    est = make_estimator(batch_processor=NamedOnly())
    with pytest.raises(MonitorKeyError, match="sets record_loss = False, which leaves its loss out of val_loss"):
        est.fit(TRAIN, val_data=VAL, epochs=1, event_handlers=[EarlyStoppingHandler("val_loss")])
