"""The default handlers, each on its own."""

import logging
import re

import pytest
import torch
import torchmetrics
from torch import nn

from fitforge.events import EpochBegin
from fitforge.exceptions import CancelEpoch, FitforgeTypeError, FitforgeValueError
from fitforge.handlers import (
    GradientUpdateHandler,
    LoggingHandler,
    MetricHandler,
    ProgressBarHandler,
    StoppingHandler,
    ValidationHandler,
    progress_bar,
    stopping,
)
from fitforge.handlers import logging as logging_module
from fitforge.testing import RecordingHandler
from helpers import make_estimator, regression_batches


class FakeClock:
    def __init__(self, step):
        self.now, self.step = 0.0, step

    def monotonic(self):
        self.now += self.step
        return self.now


def test_stopping_max_time_with_a_fake_clock(monkeypatch):
    clock = FakeClock(step=1.0)  # every clock read advances one second
    monkeypatch.setattr(stopping.time, "monotonic", clock.monotonic)
    history = make_estimator().fit(regression_batches(10), epochs=100, event_handlers=[StoppingHandler(max_time=3.5)])
    assert history.stop_reason == "reached max_time=3.5s" and history.epochs == 1


def test_stopping_own_limits_override_fit_arguments():
    rec = RecordingHandler()
    history = make_estimator().fit(
        regression_batches(2), epochs=10, event_handlers=[StoppingHandler(max_epochs=2), rec]
    )
    assert history.epochs == 2 and history.stop_reason == "reached epochs=2"
    history = make_estimator().fit(regression_batches(2), epochs=10, event_handlers=[StoppingHandler(max_batches=3)])
    assert history.epochs == 2 and history.stop_reason == "reached batches=3"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(max_epochs=0), FitforgeValueError, "max_epochs must be a positive int or None, got 0"),
        (dict(max_epochs=1.5), FitforgeTypeError, "max_epochs must be a positive int or None, got float 1.5"),
        (dict(max_batches=-1), FitforgeValueError, "max_batches must be a positive int or None, got -1"),
        (dict(max_time="1"), FitforgeTypeError, "max_time must be a positive number or None, got str '1'"),
        (dict(max_epochs=True), FitforgeTypeError, "max_epochs must be a positive int or None, got bool True"),
        (dict(max_time=float("nan")), FitforgeValueError, "max_time must be a positive number or None, got nan"),
    ],
)
def test_stopping_rejects_bad_limits(kwargs, error, message):  # TypeError for a type, ValueError for a value
    with pytest.raises(error, match=re.escape("StoppingHandler: " + message)):
        StoppingHandler(**kwargs)


@pytest.mark.parametrize(
    "value, error", [("x", FitforgeTypeError), (-1, FitforgeValueError), (True, FitforgeTypeError)]
)
def test_progress_bar_rejects_bad_refresh(value, error):
    with pytest.raises(error, match="ProgressBarHandler: refresh_seconds must be a non-negative number"):
        ProgressBarHandler(refresh_seconds=value)


def test_gradient_update_steps_every_optimizer_and_clears_grads():
    net = nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 1))
    opts = [torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[1].parameters(), lr=0.1)]
    est = make_estimator(net=net, optimizer=opts)
    steps = []
    for opt in opts:
        opt.register_step_post_hook(lambda o, args, kwargs: steps.append(o))
    est.fit(regression_batches(3), epochs=1, event_handlers=[GradientUpdateHandler()])
    assert steps == [opts[0], opts[1]] * 3
    assert all(p.grad is None for p in net.parameters())


def test_metric_handler_with_its_own_metrics():
    history = make_estimator().fit(regression_batches(), epochs=1, event_handlers=[MetricHandler(["mse", "rmse"])])
    assert history["train_rmse"][0] == pytest.approx(history["train_mse"][0] ** 0.5, rel=1e-6)
    assert "train_mae" not in history


def test_metric_failure_names_metric_shapes_and_batch():
    net = nn.Linear(5, 3)
    est = make_estimator(net=net, loss=nn.CrossEntropyLoss(), train_metrics="top5_accuracy")
    batches = [(torch.randn(4, 5), torch.randint(0, 3, (4,)))]
    with pytest.raises(
        FitforgeValueError,
        match=re.escape(
            "metric 'top5_accuracy' (TopKAccuracy) failed on pred: tensor "
            "of shape (4, 3) and label: tensor of shape (4,) in batch 0"
        ),
    ):
        est.fit(batches, epochs=1)


@pytest.mark.parametrize(
    "metric, computes, hint",
    [
        (
            lambda: torchmetrics.Accuracy(task="multiclass", num_classes=3, average=None),
            "a tensor of shape (3,)",
            "average='macro'",
        ),
        (
            lambda: torchmetrics.MetricCollection([torchmetrics.Accuracy(task="multiclass", num_classes=3)]),
            "dict",
            "give a MetricCollection's metrics as a dict {name: metric}",
        ),
    ],
)
def test_a_metric_that_does_not_compute_one_number_fails_before_the_first_step(metric, computes, hint):
    net = nn.Linear(5, 3)
    before = net.weight.detach().clone()
    est = make_estimator(net=net, loss=nn.CrossEntropyLoss(), train_metrics=metric())
    batches = [(torch.randn(4, 5), torch.randint(0, 3, (4,)))] * 3
    with pytest.raises(FitforgeValueError, match=re.escape(f"computes {computes}, not one number")) as raised:
        est.fit(batches, epochs=1)
    assert hint in str(raised.value) and net.weight.equal(before)  # before any optimizer step
    with pytest.raises(FitforgeValueError, match=re.escape(f"computes {computes}, not one number")):
        make_estimator(net=net, loss=nn.CrossEntropyLoss(), val_metrics=metric()).evaluate(batches)


def test_a_metric_that_needs_more_than_the_first_batch_is_left_to_epoch_end():
    class NeedsTwoBatches(torchmetrics.MeanMetric):
        def update(self, pred, label):
            super().update(pred.mean())

        def compute(self):
            if self.weight < 2:  # as an AUC with one class so far: undefined on the first batch alone
                raise ValueError("needs more samples")
            return super().compute()

    est = make_estimator(train_metrics={"later": NeedsTwoBatches()})
    history = est.fit(regression_batches(3), epochs=1)
    assert "train_later" in history


def test_running_metrics_gives_epoch_so_far_values_and_leaves_state_metrics_alone():
    seen, metrics = [], []

    class Peek(RecordingHandler):
        def batch_end(self, state):
            seen.append(state.running_metrics())
            metrics.append(dict(state.metrics))

    history = make_estimator().fit(regression_batches(3), epochs=2, event_handlers=[Peek(priority=-500)])
    assert [set(s) for s in seen] == [{"train_loss", "train_mae"}] * 6
    assert seen[2]["train_loss"] == pytest.approx(history["train_loss"][0])
    assert seen[0] != seen[1]  # running values move during the epoch...
    assert metrics[:3] == [{}] * 3 and metrics[3] == metrics[5] == {  # ...state.metrics holds last epoch's
        "train_loss": history["train_loss"][0],
        "train_mae": history["train_mae"][0],
    }


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(epoch_period=0), FitforgeValueError, "epoch_period must be a positive int or None, got 0"),
        (dict(batch_period=1.5), FitforgeTypeError, "batch_period must be a positive int or None, got float 1.5"),
        (dict(epoch_period=None), FitforgeValueError, "epoch_period and batch_period are both None, so it would never"),
    ],
)
def test_validation_handler_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape("ValidationHandler: " + message)):
        ValidationHandler([], **kwargs)


def test_validation_handler_eval_fn_errors():
    with pytest.raises(FitforgeTypeError, match="eval_fn must be callable"):
        ValidationHandler([], eval_fn=3)
    handler = ValidationHandler(regression_batches(), eval_fn=lambda data, event_handlers: 0.5)
    with pytest.raises(FitforgeTypeError, match="eval_fn must return a dict of floats, got float 0.5"):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[handler])


def test_validation_runs_its_own_handlers_never_fits():
    fit_rec, val_rec = RecordingHandler(), RecordingHandler()
    make_estimator().fit(
        regression_batches(2),
        epochs=1,
        event_handlers=[fit_rec, ValidationHandler(regression_batches(1), event_handlers=[val_rec])],
    )
    assert {c[1] for c in fit_rec.calls} == {"train"} and {c[1] for c in val_rec.calls} == {"validate"}


def test_logging_handler_epoch_lines_and_summary(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().fit(regression_batches(2), val_data=regression_batches(1), epochs=2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "Model: Linear, 2 parameters (2 trainable), 8 B, on cpu, float32"
    assert lines[1] == "Training for 2 epochs, 2 batches per epoch"
    assert re.fullmatch(
        r"\[Epoch 1/2\] train_loss=\d+\.\d+ train_mae=\S+ train_samples_per_s=\d+ "
        r"val_loss=\S+ val_mae=\S+ \(\d+\.\ds\)",
        lines[2],
    )
    assert lines[-1].startswith("Finished: 2 epochs, 4 batches in ") and "(reached epochs=2)" in lines[-1]


def test_logging_handler_every_n_batches(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().fit(regression_batches(4), batches=4, event_handlers=[LoggingHandler(log_interval=2)])
    batch_lines = [r.getMessage() for r in caplog.records if "Batch" in r.getMessage()]
    assert [line.split("]")[0] for line in batch_lines] == ["[Epoch 1 Batch 2", "[Epoch 1 Batch 4"]
    assert caplog.records[1].getMessage() == "Training for 4 batches, 4 batches per epoch"
    assert caplog.records[-1].getMessage().startswith("Finished: 1 epoch, 4 batches in ")


@pytest.mark.parametrize("interval", [0, "batch", True])
def test_logging_handler_rejects_bad_interval(interval):
    with pytest.raises(FitforgeValueError, match="log_interval must be 'epoch' or a positive int"):
        LoggingHandler(log_interval=interval)


def test_console_output_is_added_only_when_logging_is_unconfigured(monkeypatch, capsys):
    logger = logging.getLogger("fitforge")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)  # nothing configured anywhere
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    logging_module.ensure_console_output()
    assert len(logger.handlers) == 1 and logger.level == logging.INFO
    logger.info("hello from fitforge")
    assert "hello from fitforge" in capsys.readouterr().err
    logging_module.ensure_console_output()
    assert len(logger.handlers) == 1


def test_progress_bar_shows_epochs_and_values(capsys, monkeypatch):
    monkeypatch.setattr(progress_bar.time, "monotonic", FakeClock(step=1.0).monotonic)  # every batch refreshes
    make_estimator().fit(
        regression_batches(3),
        val_data=regression_batches(1),
        epochs=2,
        event_handlers=[ProgressBarHandler(refresh_seconds=0.5)],
    )
    err = capsys.readouterr().err
    assert "Epoch 1/2" in err and "Epoch 2/2" in err and "3/3" in err
    assert re.search(r"train_loss=\d+\.\d+", err) and "val_loss=" in err


def test_progress_bar_is_default_only_when_interactive(monkeypatch):
    est = make_estimator()
    monkeypatch.setattr(progress_bar.sys.stderr, "isatty", lambda: False, raising=False)
    assert not progress_bar.interactive()
    assert "ProgressBarHandler" not in est.describe_loop()
    monkeypatch.setattr(progress_bar.sys.stderr, "isatty", lambda: True, raising=False)
    assert progress_bar.interactive()
    assert "ProgressBarHandler(report)" in est.describe_loop()


def test_progress_bar_detects_a_notebook(monkeypatch):
    class ZMQInteractiveShell:
        pass

    class FakeIPython:
        @staticmethod
        def get_ipython():
            return ZMQInteractiveShell()

    monkeypatch.setitem(progress_bar.sys.modules, "IPython", FakeIPython)
    assert progress_bar.interactive()


def test_user_validation_data_is_checked_before_training():
    est = make_estimator()
    before = est.net.weight.detach().clone()
    with pytest.raises(FitforgeValueError, match=r"ValidationHandler val_data is empty"):
        est.fit(regression_batches(), epochs=2, event_handlers=[ValidationHandler([])])
    with pytest.raises(FitforgeValueError, match=r"ValidationHandler val_data is a one-shot iterator"):
        est.fit(regression_batches(), epochs=2, event_handlers=[ValidationHandler(iter(regression_batches()))])
    assert est.net.weight.detach().equal(before)


def test_one_shot_validation_data_with_batch_period_is_refused_before_training():
    handler = ValidationHandler(iter(regression_batches()), batch_period=2)
    with pytest.raises(FitforgeValueError, match="ValidationHandler val_data is a one-shot iterator"):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[handler])


def test_stop_on_a_batch_period_step_does_not_validate_the_same_weights_twice():
    calls = []
    handler = ValidationHandler(
        regression_batches(1), batch_period=2, eval_fn=lambda data, event_handlers: calls.append(1) or {"val_x": 0.0}
    )
    make_estimator().fit(regression_batches(4), batches=4, event_handlers=[handler])
    assert len(calls) == 2


def test_metric_handler_epoch_end_without_its_epoch_begin_records_nothing_stale():
    class CancelSecondEpochEarly(EpochBegin):
        priority = -5000

        def epoch_begin(self, state):
            if state.epoch in (0, 1):
                raise CancelEpoch

    history = make_estimator().fit(regression_batches(), epochs=3, event_handlers=[CancelSecondEpochEarly()])
    loss = history["train_loss"]
    assert loss[0] != loss[0] and loss[1] != loss[1] and loss[2] == loss[2]  # nan, nan, a value


def test_stopping_handler_limits_and_fit_limits_whichever_comes_first(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = make_estimator().fit(regression_batches(), epochs=10, event_handlers=[StoppingHandler(max_epochs=2)])
    assert history.epochs == 2 and caplog.records[1].getMessage().startswith("Training for 2 epochs")
    assert "[Epoch 2/2]" in caplog.text
    history = make_estimator().fit(regression_batches(), epochs=2, event_handlers=[StoppingHandler(max_epochs=5)])
    assert history.epochs == 2


def test_logging_handler_inside_evaluate(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().evaluate(regression_batches(), event_handlers=[LoggingHandler()])
    assert re.fullmatch(r"\[Validate\] val_loss=\S+ val_mae=\S+", caplog.records[-1].getMessage())


def test_log_lines_do_not_print_twice_once_the_application_configures_logging(monkeypatch, capsys):
    logger = logging.getLogger("fitforge")
    root = logging.getLogger()
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(root, "handlers", [])
    logging_module.ensure_console_output()  # nothing configured: fitforge's stand-in prints
    logger.info("first")
    assert capsys.readouterr().err.count("first") == 1
    app = logging.StreamHandler()  # then the application configures logging
    monkeypatch.setattr(root, "handlers", [app])
    assert logging_module._configured_above()
    logger.handlers[0].emit(logging.LogRecord("fitforge", logging.INFO, "", 0, "second", None, None))
    assert "second" not in capsys.readouterr().err  # the stand-in stays quiet; the app's handler prints
