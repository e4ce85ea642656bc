"""Regression tests for defects found in review: each reproduces a confirmed bug that is now fixed."""

import logging
import re
from typing import ClassVar

import pytest
import torch
from torch import nn

from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.events import BatchBegin, BatchEnd, EpochBegin, EpochEnd
from fitforge.exceptions import (
    CancelBatch,
    CancelEpoch,
    CancelFit,
    FitforgeTypeError,
    FitforgeValueError,
    LossInputError,
    MonitorKeyError,
)
from fitforge.handlers import LoggingHandler, MetricHandler, ValidationHandler
from fitforge.metrics import Accuracy
from fitforge.testing import RecordingHandler, linear_problem
from helpers import make_estimator, regression_batches


def test_cancel_epoch_before_the_step_leaves_no_gradient_for_the_next_epoch():
    class CancelFirstEpoch(BatchEnd):
        priority = -3000  # after backward, before the optimizer step

        def batch_end(self, state):
            if state.epoch == 0:
                raise CancelEpoch

    class GradAtStep(BatchEnd):
        priority = -2500
        grads: ClassVar[list] = []

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


@pytest.mark.parametrize(
    "label, expected",
    [
        (torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]), 0.75),  # one-hot
        (torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]]), 0.75),  # probabilities
        (torch.tensor([0, 1, 0, 1]), 0.75),
    ],
)
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


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(loss=[nn.MSELoss(), nn.MSELoss()], train_metrics={2: "mse"}), "train_metrics"),
        (dict(loss=nn.MSELoss(), train_metrics={1: "accuracy"}), "train_metrics"),
        (dict(loss=nn.MSELoss(), val_metrics={1: "mae"}), "val_metrics"),
    ],
)
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
    handler = ValidationHandler(
        regression_batches(1), batch_period=2, eval_fn=lambda data, event_handlers: calls.append(1) or {"val_x": 0.0}
    )
    make_estimator().fit(regression_batches(4), batches=4, event_handlers=[handler])
    assert len(calls) == 2


def test_optimizer_for_another_net_is_refused():
    other = nn.Linear(1, 1)
    with pytest.raises(FitforgeValueError, match="optimizer holds none of net's parameters"):
        Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1), device="cpu")
    net = nn.Linear(1, 1)  # a second optimizer for another module (a GAN's discriminator) is fine
    Estimator(
        net,
        nn.MSELoss(),
        optimizer=[torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)],
        device="cpu",
    )


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


# -- second review -----------------------------------------------------------------------------------


def test_accuracy_with_integer_one_hot_labels_and_one_dimensional_scores():
    import torch.nn.functional as F

    metric = Accuracy()
    metric.update(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]), F.one_hot(torch.tensor([0, 1]), 3))
    assert metric.compute().item() == 1.0
    with pytest.raises(FitforgeValueError, match="no class axis.*'binary_accuracy'"):
        Accuracy().update(torch.tensor([2.3, -1.0, 0.7]), torch.tensor([1, 0, 1]))
    exact = Accuracy()  # integer class predictions are compared as they are
    exact.update(torch.tensor([1, 0, 2]), torch.tensor([1, 1, 2]))
    assert exact.compute().item() == pytest.approx(2 / 3)


def test_a_validation_mistake_fails_before_the_first_training_step():
    net = nn.Linear(5, 3)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    train = [(torch.randn(4, 5), torch.randint(0, 3, (4,))) for _ in range(3)]
    val = [(x, y.float()) for x, y in train]
    before = net.weight.detach().clone()
    with pytest.raises(
        LossInputError,
        match=r"^the first batch of val_data cannot be evaluated: loss 0 "
        r"\(CrossEntropyLoss\) failed on .* use label\.long\(\)",
    ):
        est.fit(train, val_data=val, epochs=2)
    assert net.weight.detach().equal(before)


def test_the_first_validation_batch_check_leaves_the_rng_untouched():
    from torch.utils.data import DataLoader, TensorDataset

    est = make_estimator()
    loader = DataLoader(TensorDataset(torch.rand(8, 1), torch.rand(8, 1)), batch_size=4, shuffle=True)
    state = torch.get_rng_state()
    est.check_first_val_batch(loader, "val_data")
    assert torch.equal(state, torch.get_rng_state())


def test_metric_handler_epoch_end_without_its_epoch_begin_records_nothing_stale():
    class CancelSecondEpochEarly(EpochBegin):
        priority = -5000

        def epoch_begin(self, state):
            if state.epoch in (0, 1):
                raise CancelEpoch

    history = make_estimator().fit(regression_batches(), epochs=3, event_handlers=[CancelSecondEpochEarly()])
    loss = history["train_loss"]
    assert loss[0] != loss[0] and loss[1] != loss[1] and loss[2] == loss[2]  # nan, nan, a value


def test_one_metric_object_cannot_count_training_and_validation():
    shared = Accuracy()
    with pytest.raises(
        FitforgeValueError,
        match=r"val_metrics and train_metrics share the metric object\(s\) "
        r"\['accuracy'\]",
    ):
        Estimator(
            nn.Linear(5, 3),
            nn.CrossEntropyLoss(),
            train_metrics=shared,
            val_metrics=[shared],
            optimizer="sgd",
            device="cpu",
        )


def test_stopping_handler_limits_and_fit_limits_whichever_comes_first(caplog):
    from fitforge.handlers import StoppingHandler

    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = make_estimator().fit(regression_batches(), epochs=10, event_handlers=[StoppingHandler(max_epochs=2)])
    assert history.epochs == 2 and caplog.records[0].getMessage().startswith("Training for 2 epochs")
    assert "[Epoch 2/2]" in caplog.text
    history = make_estimator().fit(regression_batches(), epochs=2, event_handlers=[StoppingHandler(max_epochs=5)])
    assert history.epochs == 2


def test_one_shot_validation_data_with_batch_period_is_refused_before_training():
    handler = ValidationHandler(iter(regression_batches()), batch_period=2)
    with pytest.raises(FitforgeValueError, match="ValidationHandler val_data is a one-shot iterator"):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[handler])


def test_log_lines_do_not_print_twice_once_the_application_configures_logging(monkeypatch, capsys):
    from fitforge.handlers import logging as logging_module

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


def test_predict_handlers_see_the_batch_size():
    sizes = []

    class Sizes(BatchEnd):
        def batch_end(self, state):
            sizes.append(state.output.batch_size)

    make_estimator().predict([torch.zeros(3, 1), torch.zeros(2, 1)], event_handlers=[Sizes()])
    assert sizes == [3, 2]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda est: est.fit(regression_batches(), 5),
            "val_data must be an iterable .* got int 5; did you mean epochs=5?",
        ),
        (
            lambda est: est.fit(torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.zeros(4, 1)), epochs=1),
            r"wrap the dataset: DataLoader\(dataset, batch_size=...\)",
        ),
        (lambda est: est.predict(torch.zeros(4, 1)), r"wrap it: \[x\] for one batch"),
    ],
)
def test_beginner_data_mistakes_get_a_hint(call, message):
    with pytest.raises(FitforgeTypeError, match=message):
        call(make_estimator())


def test_cross_entropy_label_hints_for_int32_and_out_of_range_classes():
    est = Estimator(nn.Linear(5, 2), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    with pytest.raises(
        LossInputError, match=re.escape("class-index labels must be int64, got int32: use label.long()")
    ):
        est.fit([(torch.randn(4, 5), torch.tensor([0, 1, 1, 0], dtype=torch.int32))], epochs=1)
    with pytest.raises(
        LossInputError,
        match=re.escape(
            "labels go up to 2 but the net outputs 2 class scores, so labels "
            "must lie in 0..1: give the last layer 3 outputs"
        ),
    ):
        est.fit([(torch.randn(4, 5), torch.tensor([0, 1, 2, 0]))], epochs=1)


def test_a_list_of_single_samples_is_recognised():
    samples = [(torch.rand(1), torch.tensor(2.0)) for _ in range(4)]  # (x, y) pairs, not batches
    with pytest.raises(FitforgeValueError, match="looks like a single sample, not a batch"):
        make_estimator(loss=lambda p, y: ((p.squeeze() - y) ** 2).mean(), train_metrics=[]).fit(samples, epochs=1)


def test_first_validation_batch_check_skips_one_shot_and_empty_data():
    est = make_estimator()
    batches = regression_batches(2)
    one_shot = iter(batches)
    est.check_first_val_batch(one_shot, "val_data")
    assert len(list(one_shot)) == 2  # nothing consumed
    est.check_first_val_batch([], "val_data")


def test_dispatcher_fire_requests_a_stop_for_a_truthy_batch_end():
    from fitforge.core.dispatch import Dispatcher
    from fitforge.core.state import TrainState
    from fitforge.events import Event

    state = TrainState(make_estimator())
    Dispatcher([RecordingHandler(stop_on=("batch_end", 0))]).fire(Event.BATCH_END, state)
    assert state.stop_reason == "RecordingHandler.batch_end returned True"


def test_a_list_of_one_loss_behaves_like_the_loss():
    from fitforge.core.loss import LossSet

    total, parts = LossSet([nn.MSELoss()])(torch.ones(2), torch.zeros(2))
    assert total.item() == 1.0 and parts[0] is total


class _NoBatchSize(BatchProcessor):
    """A custom step that forgets BatchOutput.batch_size (reported by the docs review)."""

    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        return BatchOutput(out.data, out.label, out.pred, out.loss, out.losses)

    def evaluate_batch(self, state, batch):
        return "not an output"


def test_a_batch_output_without_batch_size_is_an_error_at_the_first_batch():
    estimator, train, val = linear_problem()
    estimator.batch_processor = _NoBatchSize()
    with pytest.raises(
        FitforgeValueError,
        match=r"fit_batch returned BatchOutput\(batch_size=0\); set it to the "
        "number of samples in the batch",
    ):
        estimator.fit(train, epochs=1)
    with pytest.raises(
        FitforgeTypeError,
        match="first batch of val_data cannot be evaluated: BatchProcessor."
        "evaluate_batch must return a fitforge.BatchOutput, got str",
    ):
        estimator.fit(train, val_data=val, epochs=1)
