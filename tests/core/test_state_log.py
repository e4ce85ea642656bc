"""state.log(name, value): named values from a step or a handler, averaged per epoch as
train_<name>/val_<name>; checked arguments; dropped with one warning when no MetricHandler runs;
no host read per batch."""

import logging
import math

import pytest
import torch

from fitforge import BatchProcessor, TrainState
from fitforge.events import BatchEnd, EpochEnd, TrainEnd
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.testing import HostReadCounter, linear_data, linear_problem
from helpers import make_estimator

g = torch.Generator().manual_seed(0)
TRAIN = [(torch.rand(n, 1, generator=g), torch.rand(n, 1, generator=g)) for n in (4, 4, 2)]  # uneven batches
VAL = [(torch.rand(n, 1, generator=g), torch.rand(n, 1, generator=g)) for n in (3, 5)]


class Logging(BatchProcessor):
    """Logs values the training does not change, so their means can be computed by hand."""

    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        state.log("x_sum", batch[0].sum())  # a tensor
        state.log("index", state.batch_idx)  # a Python int
        return out

    def evaluate_batch(self, state, batch):
        out = super().evaluate_batch(state, batch)
        state.log("x_sum", 2 * batch[0].sum())
        state.log("index", float(state.batch_idx))
        return out


def mean(values):
    return sum(values) / len(values)


def test_train_and_val_means_are_the_means_over_the_calls():
    history = make_estimator(batch_processor=Logging()).fit(TRAIN, val_data=VAL, epochs=2)
    x_sum = mean([float(x.sum()) for x, _ in TRAIN])  # per call: not weighted by batch size
    assert history["train_x_sum"] == pytest.approx([x_sum, x_sum], rel=1e-12)
    assert history["train_index"] == [1.0, 1.0]  # batches 0, 1, 2
    val_x_sum = mean([2 * float(x.sum()) for x, _ in VAL])
    assert history["val_x_sum"] == pytest.approx([val_x_sum, val_x_sum], rel=1e-12)
    assert history["val_index"] == [0.5, 0.5]


def test_evaluate_returns_the_val_values_and_fit_puts_them_in_state_metrics():
    est = make_estimator(batch_processor=Logging())
    result = est.evaluate(VAL)
    assert result["val_x_sum"] == pytest.approx(mean([2 * float(x.sum()) for x, _ in VAL]), rel=1e-12)
    assert result["val_index"] == 0.5
    seen = {}

    class Last(TrainEnd):
        def train_end(self, state):
            seen.update(state.metrics)

    est.fit(TRAIN, val_data=VAL, epochs=1, event_handlers=[Last()])
    assert {"train_x_sum", "train_index", "val_x_sum", "val_index"} <= set(seen)


class LogsGap(BatchEnd):
    """A user handler (priority 0, after MetricHandler) logging from batch_end; keeps what it logged."""

    def __init__(self, priority=0):
        self.priority = priority
        self.logged = []

    def batch_end(self, state):
        gap = (state.output.pred.detach() - state.output.label).abs().mean()
        self.logged.append(float(gap))  # a host read, fine in a test
        state.log("gap", gap)


@pytest.mark.parametrize("priority", [0, -1500], ids=["after MetricHandler", "before MetricHandler"])
def test_a_handler_logs_from_batch_end(priority):
    handler = LogsGap(priority)
    history = make_estimator().fit(TRAIN, epochs=2, event_handlers=[handler])
    per_epoch = [mean(handler.logged[:3]), mean(handler.logged[3:])]
    assert history["train_gap"] == pytest.approx(per_epoch, rel=1e-6)


def test_running_metrics_include_the_named_values():
    running = []

    class Reader(BatchEnd):
        priority = 10  # after the step's and LogsGap's values

        def batch_end(self, state):
            running.append(state.running_metrics())

    make_estimator(batch_processor=Logging()).fit(TRAIN, epochs=1, event_handlers=[Reader()])
    assert [r["train_index"] for r in running] == [0.0, 0.5, 1.0]


def test_tensor_values_are_detached_and_may_mix_with_numbers():
    seen = []

    class Mixed(BatchProcessor):
        def fit_batch(self, state, batch):
            out = super().fit_batch(state, batch)
            state.log("mixed", out.loss * 0 + 1 if state.batch_idx % 2 else 3)  # tensor 1.0, then int 3
            return out

    class Peek(BatchEnd):
        priority = -1500  # before MetricHandler takes the value

        def batch_end(self, state):
            seen.extend(value for _, value in state.services.logged)

    history = make_estimator(batch_processor=Mixed()).fit(TRAIN, epochs=1, event_handlers=[Peek()])
    assert history["train_mixed"] == pytest.approx([(3 + 1 + 3) / 3])
    tensors = [v for v in seen if isinstance(v, torch.Tensor)]
    assert tensors and all(not t.requires_grad and t.dim() == 0 for t in tensors)


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("", 1.0, FitforgeTypeError, "name must be a non-empty str such as 'g_loss'"),
        (3, 1.0, FitforgeTypeError, "name must be a non-empty str"),
        ("x", True, FitforgeTypeError, r"got bool True; log float\(value\) to average it as 0/1"),
        ("x", "1.0", FitforgeTypeError, "value must be a real number or a tensor with one element, got str"),
        ("x", 1 + 2j, FitforgeTypeError, "value must be a real number or a tensor with one element, got complex"),
        ("x", None, FitforgeTypeError, "got NoneType None"),
        ("x", torch.ones(2), FitforgeValueError, r"one element, got one of shape \(2,\); reduce it first"),
        ("x", torch.tensor(True), FitforgeTypeError, r"a bool tensor, which has no mean to log; log value.float\(\)"),
        ("x", torch.tensor(1 + 2j), FitforgeTypeError, "a complex tensor"),
    ],
)
def test_bad_names_and_values_are_refused(name, value, error, message):
    state = TrainState(make_estimator())
    with pytest.raises(error, match=message):
        state.log(name, value)


def test_one_element_tensors_of_any_shape_and_integer_dtype_are_taken():
    est = make_estimator()
    state = TrainState(est)
    state.services.logged.collected = True
    state.log("a", torch.tensor([[2]]))
    state.log("b", torch.tensor([1.5], requires_grad=True))
    (_, a), (_, b) = state.services.logged
    assert a.shape == () and a.dtype == torch.get_default_dtype() and b.shape == () and not b.requires_grad


class LogCount(TrainEnd):
    def train_end(self, state):
        self.left = len(state.services.logged)


def test_without_a_metric_handler_the_values_are_dropped_with_one_warning(caplog):
    counter = LogCount()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        history = make_estimator(batch_processor=Logging()).fit(
            TRAIN, epochs=2, default_handlers=False, event_handlers=[counter]
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # 12 calls, one warning
    assert "no MetricHandler runs in this fit, so logged values are dropped; add " in warnings[0]
    assert "fitforge.handlers.MetricHandler() to event_handlers" in warnings[0]
    assert counter.left == 0 and "train_x_sum" not in history  # nothing kept


def test_predict_and_lr_find_drop_the_values_silently(caplog):
    est = make_estimator(batch_processor=Logging())

    class PredictLogs(Logging):
        def predict_batch(self, state, batch):
            state.log("p", 1.0)
            return super().predict_batch(state, batch)

    with caplog.at_level(logging.WARNING, logger="fitforge"):
        est.lr_find(TRAIN, num_steps=4)
        make_estimator(batch_processor=PredictLogs()).predict(TRAIN)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def reads_in_one_epoch(batches, processor):
    estimator, _, val = linear_problem(batch_processor=processor)
    train = linear_data(n=4 * batches, batch_size=4)
    with HostReadCounter() as reads:
        estimator.fit(train, val_data=val, epochs=1)
    return reads.count


def test_logging_a_tensor_reads_nothing_to_the_host_per_batch():
    class LogsLoss(BatchProcessor):
        def fit_batch(self, state, batch):
            out = super().fit_batch(state, batch)
            state.log("double", out.loss * 2)
            state.log("step", 1.0)
            return out

    few, many = reads_in_one_epoch(8, LogsLoss()), reads_in_one_epoch(64, LogsLoss())
    assert few == many
    assert few == reads_in_one_epoch(8, BatchProcessor()) + 2  # the two means, read once at epoch end


def test_a_value_logged_at_epoch_end_after_the_metric_handler_counts_in_the_next_epoch():
    class Late(EpochEnd):
        priority = 500  # after MetricHandler published the epoch's values

        def epoch_end(self, state):
            state.log("late", 10.0 * (state.epoch + 1))

    history = make_estimator().fit(TRAIN, epochs=3, event_handlers=[Late()])
    assert math.isnan(history["train_late"][0]) and history["train_late"][1:] == [10.0, 20.0]


def test_a_stop_keeps_its_reason_in_the_states_history_even_one_put_in_later():
    from fitforge import History

    state = TrainState(make_estimator())
    state.history = History()
    state.run.stop("why")
    state.run.stop("later")  # the first reason is kept
    assert state.history.stop_reason == state.run.stop_reason == "why"
