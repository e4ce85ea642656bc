"""EarlyStoppingHandler and the shared Monitor: scripted values fed to the hooks, then real fits."""

import math
import re

import pytest
import torch

from fitforge import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, MonitorKeyError
from fitforge.handlers import EarlyStoppingHandler, ValidationHandler, throttle
from fitforge.metrics import MeanSquaredError
from fitforge.metrics.monitor import Monitor, infer_mode
from fitforge.testing import linear_problem
from helpers import make_estimator, regression_batches


def feed(handler, values, key="val_loss", estimator=None):
    """Run ``handler`` over epochs whose ``key`` takes ``values`` (None: not produced that epoch);
    return the epoch index at which it requested a stop, or None."""
    state = TrainState(estimator or make_estimator())
    handler.train_begin(state)
    for epoch, value in enumerate(values):
        state.epoch = epoch
        state.history.new_epoch()
        state.history.record("train_loss", 1.0)
        if value is not None:
            state.history.record(key, value)
        handler.epoch_end(state)
        if state.run.stop_requested:
            return epoch
    return None


@pytest.mark.parametrize(
    "patience, values, stopped",
    [
        (0, [1.0, 0.9, 0.95, 0.8], 2),  # patience 0: the first epoch without improvement stops
        (1, [1.0, 0.9, 0.95, 0.8], 2),
        (2, [1.0, 0.9, 0.95, 0.8, 0.85, 0.86], 5),  # the improvement at epoch 3 reset the count
        (3, [1.0, 0.9, 0.8, 0.7], None),
    ],
)
def test_patience_counts_epochs_without_improvement(patience, values, stopped):
    assert feed(EarlyStoppingHandler("val_loss", patience=patience), values) == stopped


def test_min_delta_baseline_and_max_mode():
    assert feed(EarlyStoppingHandler("val_loss", min_delta=0.05), [1.0, 0.97]) == 1  # 0.03 is not enough
    assert feed(EarlyStoppingHandler("val_loss", patience=2, baseline=0.5), [0.9, 0.8, 0.4]) == 1
    handler = EarlyStoppingHandler("val_accuracy", patience=1)
    assert feed(handler, [0.5, 0.6, 0.55], key="val_accuracy") == 2
    assert (handler.best, handler.best_epoch, handler.stopped_epoch) == (0.6, 1, 2)


def test_epochs_without_a_value_are_skipped_and_nan_never_improves():
    handler = EarlyStoppingHandler("val_loss", patience=1)
    assert feed(handler, [1.0, None, None, 0.9, None]) is None and handler.best == 0.9
    handler = EarlyStoppingHandler("val_loss", patience=2)
    assert feed(handler, [float("nan"), 1.0, float("nan"), float("nan")]) == 3
    assert handler.best == 1.0


@pytest.mark.parametrize(
    "key, diverged",
    [("val_loss", -math.inf), ("val_loss", math.inf), ("val_accuracy", math.inf), ("val_accuracy", -math.inf)],
)
def test_an_infinite_value_is_never_best(key, diverged):
    # -inf as a val_loss (or +inf as an accuracy) would be a best no epoch beats, and restore_best
    # would bring back the diverged epoch's weights.
    first, better = (1.0, 0.5) if key == "val_loss" else (0.5, 0.9)
    handler = EarlyStoppingHandler(key, patience=2)
    assert feed(handler, [first, diverged, better, better, better], key=key) == 4
    assert (handler.best, handler.best_epoch) == (better, 2)
    monitor = Monitor(key, mode="min" if key == "val_loss" else "max")
    assert monitor.improved(better, diverged) and monitor.improved(better, math.inf)  # an old checkpoint's best


def test_stop_reason_and_state_dict_round_trip():
    handler = EarlyStoppingHandler("val_loss", patience=1)
    state = TrainState(make_estimator())
    handler.train_begin(state)
    for epoch, value in enumerate([1.0, 2.0]):
        state.epoch = epoch
        state.history.new_epoch()
        state.history.record("val_loss", value)
        handler.epoch_end(state)
    assert state.run.stop_reason == "early stopping: val_loss did not improve for 1 epoch(s) (best 1 at epoch 1)"
    copy = EarlyStoppingHandler("val_loss", patience=1)
    copy.load_state_dict(handler.state_dict())
    assert copy.state_dict() == {"best": 1.0, "best_epoch": 0, "wait": 1, "stopped_epoch": 1, "best_weights": None}


def test_restore_best_loads_the_best_epochs_weights():
    estimator = make_estimator()
    net = estimator.net
    handler = EarlyStoppingHandler("val_loss", patience=5, restore_best=True)
    state = TrainState(estimator)
    handler.train_begin(state)
    for epoch, value in enumerate([1.0, 0.5, 0.7]):
        with torch.no_grad():
            net.weight.fill_(epoch)
        state.epoch = epoch
        state.history.new_epoch()
        state.history.record("val_loss", value)
        handler.epoch_end(state)
    handler.train_end(state)
    assert net.weight.item() == 1.0  # epoch 1 was best


def test_fit_stops_early_and_records_why():
    estimator, train, val = linear_problem()
    torch.nn.init.constant_(estimator.net.weight, 0.0)
    for group in estimator.optimizer.param_groups:
        group["lr"] = 5.0  # diverges, so validation loss grows from the second epoch
    handler = EarlyStoppingHandler("val_loss", patience=1)
    history = estimator.fit(train, val_data=val, epochs=20, event_handlers=[handler])
    assert history.epochs < 20 and history.stop_reason.startswith("early stopping: val_loss did not improve")


def test_unknown_monitor_is_an_error_before_training():
    estimator, train, val = linear_problem()
    with pytest.raises(
        MonitorKeyError,
        match="monitors 'val_acc', which this run will not produce; "
        "available keys: train_loss, train_mae, train_samples_per_s, val_loss, val_mae",
    ):
        estimator.fit(train, val_data=val, epochs=1, event_handlers=[EarlyStoppingHandler("val_acc")])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"patience": -1}, FitforgeValueError, "patience must be a non-negative int, got -1"),
        ({"restore_best": 1}, FitforgeTypeError, "restore_best must be True or False, got int 1"),
        ({"patience": 1.5}, FitforgeTypeError, "patience must be a non-negative int, got float 1.5"),
        ({"mode": "up"}, FitforgeValueError, "mode must be 'auto', 'min' or 'max', got 'up'"),
        ({"min_delta": -0.1}, FitforgeValueError, "min_delta must be >= 0"),
        ({"min_delta": "0"}, FitforgeTypeError, "min_delta must be a number, got str"),
        ({"baseline": "low"}, FitforgeTypeError, "baseline must be a number or None, got str"),
        ({"monitor": 3}, FitforgeTypeError, "monitor must be a history key such as 'val_loss', got int"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        EarlyStoppingHandler(**kwargs)


def test_auto_mode_inference():
    estimator = make_estimator(train_metrics={"closeness": MeanSquaredError()})
    assert infer_mode("val_loss", estimator)[0] == "min"
    assert infer_mode("val_loss_1", estimator)[0] == "min"
    assert infer_mode("train_top5_accuracy", estimator)[0] == "max"
    assert infer_mode("val_mean_iou", estimator)[0] == "max"
    assert infer_mode("val_exact_match", estimator)[0] == "max"
    assert infer_mode("val_box_l1", estimator)[0] == "min"
    # The metric's own higher_is_better wins over a name that would suggest the opposite.
    assert infer_mode("val_closeness", estimator) == ("min", "MeanSquaredError.higher_is_better=False")
    with pytest.raises(
        FitforgeValueError,
        match="cannot tell whether a higher or a lower 'val_foo' is better; pass mode='min' or mode='max'",
    ):
        infer_mode("val_foo", estimator)


def test_explicit_mode_skips_inference_and_nan_best_is_replaced():
    monitor = Monitor("val_foo", mode="max")
    assert monitor.resolve(make_estimator()) == "max"
    assert monitor.improved(1.0, None) and monitor.improved(1.0, math.nan) and not monitor.improved(math.nan, 1.0)


def test_validation_every_second_epoch_is_waited_for():
    import tempfile

    from fitforge.handlers import CheckpointHandler, ValidationHandler

    estimator, train, val = linear_problem()
    stopper = EarlyStoppingHandler("val_loss", patience=1)
    with tempfile.TemporaryDirectory() as folder:
        saver = CheckpointHandler(folder, monitor="val_loss", save_best=True, epoch_period=None)
        history = estimator.fit(
            train, epochs=4, event_handlers=[ValidationHandler(val, epoch_period=2), stopper, saver]
        )
    assert history.epochs == 4 and math.isnan(history["val_loss"][0]) and stopper.best == history["val_loss"][3]


def test_a_key_only_eval_fn_could_produce_is_an_error_once_validation_ran_without_it():
    from fitforge.handlers import ValidationHandler

    estimator, train, val = linear_problem()
    validator = ValidationHandler(val, eval_fn=lambda data, event_handlers: {"val_loss": 1.0})
    with pytest.raises(MonitorKeyError, match="monitors 'val_f1', which is not among the values produced"):
        estimator.fit(train, epochs=2, event_handlers=[validator, EarlyStoppingHandler("val_f1", mode="max")])


def test_a_failed_start_does_not_restore_the_previous_runs_weights():
    from fitforge.events import TrainBegin

    estimator, train, val = linear_problem()
    stopper = EarlyStoppingHandler("val_loss", patience=5, restore_best=True)
    estimator.fit(train, val_data=val, epochs=2, event_handlers=[stopper])

    class Broken(TrainBegin):
        priority = -1

        def train_begin(self, state):
            raise RuntimeError("broken")

    with torch.no_grad():
        estimator.net.weight.fill_(42.0)
    with pytest.raises(RuntimeError, match="broken"):
        estimator.fit(train, val_data=val, epochs=2, event_handlers=[Broken(), stopper])
    assert estimator.net.weight.item() == 42.0


def test_the_stop_message_without_any_value_or_with_an_unbeaten_baseline():
    handler = EarlyStoppingHandler("val_loss", patience=1)
    state = TrainState(make_estimator())
    handler.train_begin(state)
    state.history.new_epoch()
    state.history.record("val_loss", math.nan)
    handler.epoch_end(state)
    assert state.run.stop_reason.endswith("(best no value)")
    handler = EarlyStoppingHandler("val_loss", patience=1, baseline=0.1)
    assert feed(handler, [0.5]) == 0


def test_a_best_checkpoint_and_restored_weights_judged_by_different_keys_warn(tmp_path):
    from fitforge.handlers import CheckpointHandler

    estimator, train, val = linear_problem()
    handlers = [
        CheckpointHandler(tmp_path, monitor="val_mae", save_best=True),
        EarlyStoppingHandler("val_loss", restore_best=True),
    ]
    with pytest.warns(
        UserWarning,
        match="CheckpointHandler keeps the best weights by 'val_mae' but "
        "EarlyStoppingHandler restores the best by 'val_loss'",
    ):
        estimator.fit(train, val_data=val, epochs=1, event_handlers=handlers)


def test_restore_best_weights_is_kerass_name_for_restore_best():
    assert EarlyStoppingHandler("val_loss", restore_best_weights=True).restore_best
    assert not EarlyStoppingHandler("val_loss", restore_best=False, restore_best_weights=False).restore_best
    with pytest.raises(FitforgeValueError, match="restore_best=True and restore_best_weights=False disagree"):
        EarlyStoppingHandler("val_loss", restore_best=True, restore_best_weights=False)


def test_a_fit_without_a_monitor_does_not_list_the_run_keys(monkeypatch):
    import fitforge.checks.monitors as monitors

    def refuse(*args):
        raise AssertionError("run_keys computed with nothing to check")

    monkeypatch.setattr(monitors, "run_keys", refuse)
    make_estimator().fit(regression_batches(), epochs=1)  # StoppingHandler etc.: no monitor
    with pytest.raises(AssertionError, match="run_keys computed"):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[EarlyStoppingHandler("train_loss")])


def test_early_stopping_runs_beside_a_declared_writer_of_the_history():
    from fitforge.events import EpochEnd

    class Recorder(EpochEnd):  # at the same priority, sharing epoch_end: no order needed to restore weights
        reads, writes = ("epoch",), ("history",)

        def epoch_end(self, state):
            state.history.record("my_value", 1.0)

    stopper = EarlyStoppingHandler("train_loss", patience=0, restore_best=True)
    handlers = [Recorder(), stopper]
    history = make_estimator().fit(regression_batches(), epochs=3, event_handlers=handlers, check_access=True)
    assert history["my_value"] == [1.0] * history.epochs


def test_a_second_fit_names_the_best_epoch_as_its_epoch_lines_do(caplog):
    import logging

    estimator = make_estimator()
    estimator.fit(regression_batches(), epochs=2)
    estimator.set_lr(1.0)  # diverges: the second fit's first epoch stays its best
    stopper = EarlyStoppingHandler("train_loss", patience=0, restore_best=True)
    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = estimator.fit(regression_batches(), epochs=4, event_handlers=[stopper])
    assert history.restored_epoch == 1 and "restored the weights of epoch 3 " in caplog.text
    assert "at epoch 3)" in history.stop_reason and "[Epoch 3/6]" in caplog.text


def test_a_misspelt_monitor_is_answered_with_the_nearest_key():
    estimator, train, val = linear_problem()
    with pytest.raises(MonitorKeyError) as info:
        estimator.fit(train, val_data=val, epochs=1, event_handlers=[EarlyStoppingHandler("val_mea")])
    assert "available keys: train_loss, train_mae, train_samples_per_s, val_loss, val_mae, " in str(info.value)
    assert ". Did you mean 'val_mae'? A value a step logs with state.log('mea', ...)" in str(info.value)


def test_a_val_monitor_without_validation_says_to_pass_val_data():
    estimator, train, _ = linear_problem()
    message = "No validation runs in this fit: pass val_data=... (or a ValidationHandler) to produce val_ keys"
    with pytest.raises(MonitorKeyError, match=re.escape(message)):
        estimator.fit(train, epochs=1, event_handlers=[EarlyStoppingHandler("val_loss")])


def test_a_throttled_validation_counts_as_validation_for_the_monitor_hint():
    estimator, train, val = linear_problem()
    validation = throttle(ValidationHandler(val), every_n_epochs=1)
    with pytest.raises(MonitorKeyError) as info:
        estimator.fit(train, epochs=1, event_handlers=[validation, EarlyStoppingHandler("val_los")])
    assert "Did you mean 'val_loss'?" in str(info.value) and "No validation runs" not in str(info.value)
