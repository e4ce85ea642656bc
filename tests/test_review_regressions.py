"""Regression tests for defects found in review: each reproduces a confirmed bug that is now fixed."""

import logging
import re

import pytest
import torch
from torch import nn

from fitforge import BatchProcessor, Estimator
from fitforge.events import BatchBegin, BatchEnd, EpochEnd
from fitforge.exceptions import (CancelBatch, CancelEpoch, CancelFit, FitforgeTypeError, FitforgeValueError,
                                 LossInputError, MonitorKeyError)
from fitforge.handlers import LoggingHandler, MetricHandler, ValidationHandler
from fitforge.metrics import Accuracy
from fitforge.testing import RecordingHandler

from helpers import make_estimator, regression_batches


def test_cancel_epoch_before_the_step_leaves_no_gradient_for_the_next_epoch():
    class CancelFirstEpoch(BatchEnd):
        priority = -3000  # after backward, before the optimizer step

        def batch_end(self, state):
            if state.epoch == 0:
                raise CancelEpoch

    class GradAtStep(BatchEnd):
        priority = -2500
        grads = []

        def batch_end(self, state):
            GradAtStep.grads.append(state.estimator.net.weight.grad.clone())

    est = make_estimator()
    x, y = regression_batches(1)[0]
    nn.MSELoss()(est.net(x), y).backward()  # the gradient of one batch at the initial weights
    expected = est.net.weight.grad.clone()
    est.net.zero_grad(set_to_none=True)
    est.fit(regression_batches(1), epochs=2, event_handlers=[CancelFirstEpoch(), GradAtStep()])
    # Epoch 0 was cancelled before its step, so epoch 1 starts from the initial weights and must see
    # exactly one batch's gradient, not two accumulated.
    assert len(GradAtStep.grads) == 1 and torch.allclose(GradAtStep.grads[0], expected)


@pytest.mark.parametrize("entry", ["evaluate", "predict"])
def test_cancel_fit_does_not_escape_evaluate_or_predict(entry):
    class Stop(BatchBegin):
        def batch_begin(self, state):
            if state.batch_idx == 1:
                raise CancelFit("enough")

    est = make_estimator()
    result = getattr(est, entry)(regression_batches(3), event_handlers=[Stop()])
    if entry == "evaluate":  # the pass ended like CancelEpoch: values over the batches seen
        assert set(result) == {"val_loss", "val_mae"}
    else:
        assert result.shape == (4, 1)


def test_stop_requested_then_batch_cancelled_still_stops():
    class StopThenCancel(BatchEnd):
        def batch_end(self, state):
            if state.global_step == 1:
                state.request_stop("stop")
                raise CancelBatch

    rec = RecordingHandler(priority=-5000)
    history = make_estimator().fit(regression_batches(5), epochs=1, event_handlers=[StopThenCancel(), rec])
    assert rec.events.count("batch_begin") == 2 and history.stop_reason == "stop"


@pytest.mark.parametrize("label, expected", [
    (torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]), 0.75),  # one-hot
    (torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]]), 0.75),  # probabilities
    (torch.tensor([0, 1, 0, 1]), 0.75),
])
def test_accuracy_with_index_one_hot_and_probability_labels(label, expected):
    pred = torch.tensor([[2.0, 1.0], [0.0, 3.0], [0.0, 1.0], [0.0, 1.0]])
    metric = Accuracy()
    metric.update(pred, label)
    assert metric.compute().item() == pytest.approx(expected)


def test_accuracy_on_a_single_score_points_to_binary_accuracy():
    with pytest.raises(FitforgeValueError, match="one score per sample.*use the 'binary_accuracy' metric"):
        Accuracy().update(torch.randn(4, 1), torch.tensor([0, 1, 1, 0]))


class ListHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1)

    def forward(self, x):
        return [self.a(x), self.b(x)]  # a list, not a tuple


def two_label_batches():
    return [(x, (y, y)) for x, y in regression_batches()]


def test_multi_output_net_returning_a_list():
    net = ListHeads()
    est = Estimator(net, [nn.MSELoss(), nn.MSELoss()], train_metrics={1: "mae"}, optimizer="sgd", device="cpu")
    history = est.fit(two_label_batches(), epochs=1)
    assert "train_mae_1" in history
    assert isinstance(est.predict(two_label_batches()), tuple)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(loss=[nn.MSELoss(), nn.MSELoss()], train_metrics={2: "mse"}), "train_metrics"),
    (dict(loss=nn.MSELoss(), train_metrics={1: "accuracy"}), "train_metrics"),
    (dict(loss=nn.MSELoss(), val_metrics={1: "mae"}), "val_metrics"),
])
def test_metric_reading_an_output_the_model_lacks_is_refused_at_construction(kwargs, argument):
    with pytest.raises(FitforgeValueError, match=re.escape(f"{argument}: metric") + ".*but the model has"):
        Estimator(ListHeads(), optimizer="sgd", device="cpu", **kwargs)


class Monitor(EpochEnd):
    def __init__(self, monitor):
        self.monitor = monitor


def test_monitor_keys_come_from_the_metric_handlers_actually_present():
    est = make_estimator()
    est.fit(regression_batches(), epochs=1, event_handlers=[MetricHandler("mse"), Monitor("train_mse")])
    inner = ValidationHandler(regression_batches(), event_handlers=[MetricHandler("rmse")])
    est.fit(regression_batches(), epochs=1, event_handlers=[inner, Monitor("val_rmse")])
    with pytest.raises(MonitorKeyError, match="available keys: lr, epoch_time"):
        est.fit(regression_batches(), epochs=1, event_handlers=[Monitor("train_loss")], default_handlers=False)
    est.fit(regression_batches(), epochs=1, event_handlers=[Monitor(3)])  # not a key: ignored


def test_user_validation_data_is_checked_before_training():
    est = make_estimator()
    before = est.net.weight.detach().clone()
    with pytest.raises(FitforgeValueError, match=r"ValidationHandler val_data is empty"):
        est.fit(regression_batches(), epochs=2, event_handlers=[ValidationHandler([])])
    with pytest.raises(FitforgeValueError, match=r"ValidationHandler val_data is a one-shot iterator"):
        est.fit(regression_batches(), epochs=2, event_handlers=[ValidationHandler(iter(regression_batches()))])
    assert est.net.weight.detach().equal(before)


def test_logging_handler_inside_evaluate(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().evaluate(regression_batches(), event_handlers=[LoggingHandler()])
    assert re.fullmatch(r"\[Validate\] val_loss=\S+ val_mae=\S+", caplog.records[-1].getMessage())


def test_predict_errors_are_clear():
    class CancelAll(BatchBegin):
        def batch_begin(self, state):
            raise CancelBatch

    est = make_estimator()
    with pytest.raises(FitforgeValueError, match="predict produced no output: every batch was cancelled"):
        est.predict(regression_batches(), event_handlers=[CancelAll()])

    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 1)

        def forward(self, x):
            return {"y": self.lin(x)}

    with pytest.raises(FitforgeTypeError, match=r"the net returned dict .* for batch 0; predict needs a tensor"):
        make_estimator(net=DictOut()).predict(regression_batches())


def test_stop_on_a_batch_period_step_does_not_validate_the_same_weights_twice():
    calls = []
    handler = ValidationHandler(regression_batches(1), batch_period=2,
                                eval_fn=lambda data, event_handlers: calls.append(1) or {"val_x": 0.0})
    make_estimator().fit(regression_batches(4), batches=4, event_handlers=[handler])
    assert len(calls) == 2


def test_optimizer_for_another_net_is_refused():
    other = nn.Linear(1, 1)
    with pytest.raises(FitforgeValueError, match="optimizer holds none of net's parameters"):
        Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1), device="cpu")
    net = nn.Linear(1, 1)  # a second optimizer for another module (a GAN's discriminator) is fine
    Estimator(net, nn.MSELoss(), optimizer=[torch.optim.SGD(net.parameters(), lr=0.1),
                                           torch.optim.SGD(other.parameters(), lr=0.1)], device="cpu")


def test_cross_entropy_label_with_a_class_axis_gets_the_squeeze_hint():
    est = Estimator(nn.Linear(5, 3), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    batches = [(torch.randn(4, 5), torch.randint(0, 3, (4, 1)))]
    with pytest.raises(LossInputError, match=re.escape("without the class axis: use label.squeeze(1)")):
        est.fit(batches, epochs=1)


def test_custom_processor_raising_cancel_epoch_after_backward_clears_gradients():
    class Once(BatchProcessor):
        def fit_batch(self, state, batch):
            out = super().fit_batch(state, batch)
            if state.epoch == 0:
                raise CancelEpoch
            return out

    est = make_estimator(batch_processor=Once())
    est.fit(regression_batches(1), epochs=1)
    assert est.net.weight.grad is None
