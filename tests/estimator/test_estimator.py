"""Estimator: training results, evaluate/predict, multi-output, custom processors, errors before training."""

import math
import re
import warnings

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import BatchProcessor, Estimator
from fitforge.events import BatchBegin, EpochEnd, Monitoring
from fitforge.exceptions import (
    BatchFormatError,
    CancelBatch,
    FitforgeTypeError,
    FitforgeValueError,
    LossInputError,
    MonitorKeyError,
)
from fitforge.handlers import MetricHandler, ValidationHandler
from fitforge.testing import linear_problem
from helpers import TIME_KEYS, make_estimator, regression_batches


def classification_batches(n_batches=4, batch_size=8, classes=3, features=5, seed=0):
    centers = torch.randn(classes, features, generator=torch.Generator().manual_seed(42)) * 3
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        y = torch.randint(0, classes, (batch_size,), generator=g)
        batches.append((centers[y] + torch.randn(batch_size, features, generator=g), y))
    return batches


def test_linear_problem_converges_to_2x_plus_3():
    est, train, val = linear_problem()
    history = est.fit(train, val_data=val, epochs=25)
    assert est.net.weight.item() == pytest.approx(2.0, abs=0.02)
    assert est.net.bias.item() == pytest.approx(3.0, abs=0.02)
    assert history["val_loss"][-1] < 1e-3 < history["val_loss"][0]


def test_classifier_learns_and_history_has_default_accuracy():
    net = nn.Linear(5, 3)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.05), device="cpu")
    history = est.fit(classification_batches(), val_data=classification_batches(seed=1), epochs=15)
    assert set(history) == {
        "train_loss",
        "train_accuracy",
        "train_samples_per_s",
        "val_loss",
        "val_accuracy",
        "lr",
        "epoch_time",
        *TIME_KEYS,
        "time_validation_s",
    }
    assert history["val_accuracy"][-1] > 0.9 and history["train_loss"][-1] < history["train_loss"][0]


def test_means_are_sample_weighted_over_uneven_batches():
    x = torch.linspace(0, 1, 5).unsqueeze(1)
    batches = [(x[:4], 2 * x[:4]), (x[4:], 2 * x[4:] + 1)]  # batch sizes 4 and 1
    est = make_estimator()
    result = est.evaluate(batches)
    with torch.no_grad():
        pred = est.net(x)
    label = torch.cat([2 * x[:4], 2 * x[4:] + 1])
    assert result["val_loss"] == pytest.approx(((pred - label) ** 2).mean().item(), rel=1e-6)
    assert result["val_mae"] == pytest.approx((pred - label).abs().mean().item(), rel=1e-6)


def test_train_loss_is_the_sample_mean_when_weights_do_not_move():
    net = nn.Linear(1, 1)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.0), device="cpu")
    x = torch.linspace(0, 1, 7).unsqueeze(1)
    history = est.fit([(x[:5], 3 * x[:5]), (x[5:], 3 * x[5:])], epochs=1)
    with torch.no_grad():
        expected = ((net(x) - 3 * x) ** 2).mean().item()
    assert history["train_loss"][0] == pytest.approx(expected, rel=1e-6)


def test_validation_every_second_epoch_aligns_with_nan():
    est = make_estimator()
    history = est.fit(
        regression_batches(), epochs=4, event_handlers=[ValidationHandler(regression_batches(1), epoch_period=2)]
    )
    val = history["val_loss"]
    assert math.isnan(val[0]) and math.isnan(val[2]) and not math.isnan(val[1]) and not math.isnan(val[3])


def test_validation_every_n_batches():
    calls = []
    handler = ValidationHandler(
        regression_batches(1),
        epoch_period=None,
        batch_period=2,
        eval_fn=lambda data, event_handlers: calls.append(1) or {"val_score": 1.0},
    )
    history = make_estimator().fit(regression_batches(3), epochs=2, event_handlers=[handler])
    assert len(calls) == 3 and history["val_score"] == [1.0, 1.0]


def test_evaluate_and_predict_restore_train_mode_and_need_no_grad():
    est = make_estimator(net=nn.Sequential(nn.Linear(1, 4), nn.Dropout(0.5), nn.Linear(4, 1)))
    est.net.train()
    pred = est.predict([x for x, _ in regression_batches(2)])
    assert est.net.training and not pred.requires_grad and pred.device.type == "cpu"
    again = est.predict(regression_batches(2))  # (data, label) pairs: the label is ignored; eval mode: deterministic
    assert torch.equal(pred, again)
    assert est.predict([(x,) for x, _ in regression_batches(2)]).shape == (8, 1)
    est.evaluate(regression_batches(1))
    assert est.net.training


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 8)
        self.cls, self.reg = nn.Linear(8, 3), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.cls(h), self.reg(h)


def two_head_batches():
    return [(x, (y, x[:, :1].clone())) for x, y in classification_batches()]


def test_two_output_two_loss_model_with_weights_and_per_output_metrics():
    net = TwoHeads()
    est = Estimator(
        net,
        [nn.CrossEntropyLoss(), nn.MSELoss()],
        loss_weights=[1.0, 0.5],
        train_metrics={0: "accuracy", 1: ["mae"]},
        optimizer=torch.optim.Adam(net.parameters(), 0.02),
        device="cpu",
    )
    history = est.fit(two_head_batches(), val_data=two_head_batches(), epochs=3)
    assert {
        "train_loss",
        "train_loss_0",
        "train_loss_1",
        "train_accuracy_0",
        "train_mae_1",
        "val_loss",
        "val_loss_0",
        "val_loss_1",
        "val_accuracy_0",
        "val_mae_1",
    } <= set(history)
    # the total is the weighted sum of the parts (sample means are linear)
    assert history["val_loss"][-1] == pytest.approx(
        history["val_loss_0"][-1] + 0.5 * history["val_loss_1"][-1], rel=1e-5
    )
    pred = est.predict(two_head_batches())
    assert isinstance(pred, tuple) and pred[0].shape == (32, 3) and pred[1].shape == (32, 1)


def test_flat_metric_list_applies_to_output_zero():
    net = TwoHeads()
    est = Estimator(
        net, [nn.CrossEntropyLoss(), nn.MSELoss()], train_metrics=["accuracy"], optimizer="sgd", device="cpu"
    )
    assert "train_accuracy" in est.fit(two_head_batches(), epochs=1)


def test_output_loss_label_count_mismatch_names_the_three_counts():
    est = Estimator(TwoHeads(), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    with pytest.raises(
        LossInputError,
        match=re.escape("the net returned 2 output(s), 1 loss(es) are configured and the batch has 1 label(s)"),
    ):
        est.fit(classification_batches(), epochs=1)


def test_torchmetrics_metric_is_accepted_unchanged():
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    net = nn.Linear(5, 3)
    est = Estimator(net, nn.CrossEntropyLoss(), train_metrics=[metric, "accuracy"], optimizer="adam", device="cpu")
    history = est.fit(classification_batches(), val_data=classification_batches(seed=1), epochs=2)
    assert history["train_multiclass_accuracy"] == pytest.approx(history["train_accuracy"], rel=1e-6)
    assert history["val_multiclass_accuracy"] == pytest.approx(history["val_accuracy"], rel=1e-6)
    assert not hasattr(metric, "name")  # never renamed
    assert est.val_metrics[0].metric is not metric  # validation uses an independent copy


def test_custom_batch_processor_for_dict_batches_and_label_aware_forward():
    seen = []

    class DictBatches(BatchProcessor):
        def unpack(self, batch):
            return (batch["x"],), batch["y"]

        def forward(self, net, inputs, label):
            seen.append(label is not None)
            return net(*inputs)

    batches = [{"x": x, "y": y} for x, y in regression_batches()]
    with pytest.raises(
        BatchFormatError, match="got a dict batch with keys \\['x', 'y'\\].*override BatchProcessor.unpack"
    ):
        make_estimator().fit(batches, epochs=1)
    est = make_estimator(batch_processor=DictBatches())
    est.fit(batches, val_data=batches, epochs=2)
    assert seen and all(seen[:6])


def test_fit_batch_called_once_per_batch_including_the_sanity_checked_first():
    calls = []

    class Counting(BatchProcessor):
        def fit_batch(self, state, batch):
            calls.append(state.global_step)
            return super().fit_batch(state, batch)

    net = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    est = make_estimator(net=net, batch_processor=Counting())
    est.fit(regression_batches(3), epochs=1)
    assert calls == [0, 1, 2] and net[1].num_batches_tracked.item() == 3


def test_several_optimizers_all_step():
    net = nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 1))
    opt_a, opt_b = torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[1].parameters(), lr=0.01)
    est = make_estimator(net=net, optimizer=[opt_a, opt_b])
    before = [p.detach().clone() for p in net.parameters()]
    history = est.fit(regression_batches(), epochs=1)
    assert all(not p.detach().equal(b) for p, b in zip(net.parameters(), before))
    assert history["lr"] == [0.1] and history["lr_1"] == [0.01] and est.optimizer is opt_a


def test_default_optimizer_is_adam_with_one_warning_at_the_first_fit():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # building the estimator, evaluating and predicting: no warning
        est = Estimator(nn.Linear(1, 1), nn.MSELoss(), device="cpu")
        est.evaluate(regression_batches())
        est.predict(regression_batches())
    assert isinstance(est.optimizer, torch.optim.Adam)
    with pytest.warns(UserWarning, match=r"fit: no optimizer given: using Adam\(lr=1e-3\); pass Estimator\(optimizer="):
        est.fit(regression_batches(), epochs=1, default_handlers=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per estimator
        est.fit(regression_batches(), epochs=1, default_handlers=False)


def test_an_inference_only_estimator_of_a_frozen_net_needs_no_optimizer():
    net = nn.Linear(1, 1).requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = Estimator(net, nn.MSELoss(), device="cpu")
        assert est.evaluate(regression_batches())["val_loss"] >= 0
        assert est.predict(regression_batches()).shape[1] == 1
    with pytest.raises(FitforgeValueError, match="net has no trainable parameters"):
        est.fit(regression_batches(), epochs=1)
    net.requires_grad_(True)  # unfrozen later: fit trains it with the default Adam
    before = net.weight.detach().clone()
    with pytest.warns(UserWarning, match="fit: no optimizer given: using Adam"):
        est.fit(regression_batches(), epochs=2)
    assert isinstance(est.optimizer, torch.optim.Adam) and est.optimizer.param_groups[0]["params"][0] is net.weight
    assert not net.weight.equal(before) and est.history.epochs == 2


def unchanged_after(est, call):
    before = [p.detach().clone() for p in est.net.parameters()]
    call()
    return all(p.detach().equal(b) for p, b in zip(est.net.parameters(), before))


DATA_ALONE = r"the loss MSELoss compares the net's output with a label, but the batches are data alone"


@pytest.mark.parametrize(
    "batch, error, message",
    [
        ((torch.zeros(4, 1),), LossInputError, DATA_ALONE),  # data alone: for a net that computes its own loss
        (torch.zeros(4, 1), LossInputError, DATA_ALONE),
        ((torch.zeros(4, 1), torch.zeros(4, 1), 3), BatchFormatError, r"a batch must be a \(data, label\) pair"),
        (
            (torch.zeros(4, 1), [1, 2]),
            BatchFormatError,
            r"pair of tensors or tuples of tensors \(the label may be a dict of tensors\), got data: tensor of "
            r"shape \(4, 1\), label: list",
        ),
    ],
)
def test_bad_batch_is_a_clear_error_before_any_step(batch, error, message):
    est = make_estimator()
    with pytest.raises(error, match=message):
        assert unchanged_after(est, lambda: est.fit([batch], epochs=1))


def test_label_shape_an_elementwise_loss_would_broadcast_fails_before_the_first_step():
    est = make_estimator()
    batches = [(x, y.squeeze(1)) for x, y in regression_batches()]
    before = est.net.weight.detach().clone()
    with pytest.raises(LossInputError, match=re.escape("pred has shape (4, 1) and label (4,), which would broadcast")):
        est.fit(batches, epochs=1)
    assert est.net.weight.detach().equal(before) and est.net.weight.grad is None
    with pytest.raises(LossInputError, match="would broadcast"):  # checked again by the next fit and by evaluate
        est.fit(batches, epochs=1)
    with pytest.raises(LossInputError, match="would broadcast"):
        est.evaluate(batches)


def test_label_dtype_the_loss_cannot_take_names_shapes_and_fix():
    net = nn.Linear(5, 3)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    batches = [(x, y.float()) for x, y in classification_batches()]
    with pytest.raises(
        LossInputError,
        match=re.escape(
            "loss 0 (CrossEntropyLoss) failed on pred shape (8, 3) float32 "
            "and label shape (8,) float32; class-index labels must be int64 "
            "of shape (8,): use label.long()"
        ),
    ):
        est.fit(batches, epochs=1)


def test_loss_that_needs_no_grad_is_a_clear_error():
    est = make_estimator(loss=lambda pred, label: (pred.detach() - label).abs().mean())
    with pytest.raises(LossInputError, match="the loss does not require grad"):
        est.fit(regression_batches(), epochs=1)


def test_non_scalar_loss_is_a_clear_error():
    est = make_estimator(loss=nn.MSELoss(reduction="none"))
    with pytest.raises(LossInputError, match=re.escape("the loss must be a scalar tensor, got shape (4, 1)")):
        est.fit(regression_batches(), epochs=1)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(epochs=1, batches=2),
            FitforgeValueError,
            "give exactly one of epochs or batches, got epochs=1 and batches=2",
        ),
        (dict(), FitforgeValueError, "give exactly one of epochs or batches, got epochs=None and batches=None"),
        (dict(epochs=0), FitforgeValueError, "epochs must be a positive int, got 0"),
        (dict(batches=1.5), FitforgeTypeError, "batches must be a positive int, got float 1.5"),
    ],
)
def test_fit_duration_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make_estimator().fit(regression_batches(), **kwargs)


def test_data_errors_before_training():
    est = make_estimator()
    with pytest.raises(FitforgeValueError, match=r"train_data is a one-shot iterator \(generator\)"):
        est.fit((b for b in regression_batches()), epochs=2)
    with pytest.raises(FitforgeValueError, match=r"train_data is empty \(len 0\)"):
        est.fit(DataLoader(TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1))), epochs=1)
    with pytest.raises(FitforgeTypeError, match="train_data must be an iterable of \\(data, label\\) batches"):
        est.fit(torch.zeros(()), epochs=1)  # a 0-d tensor: no rows (X alone, with rows, is data alone)
    with pytest.raises(FitforgeValueError, match=r"val_data is a one-shot iterator"):
        est.fit(regression_batches(), val_data=iter(regression_batches()), epochs=2)
    with pytest.raises(FitforgeValueError, match=r"val_data is empty"):
        est.evaluate([])
    with pytest.raises(FitforgeValueError, match=r"data is empty"):
        est.predict([])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(loss="mse"),
            FitforgeTypeError,
            "loss must be a loss module or a callable (pred, label) -> scalar tensor",
        ),
        (dict(loss=nn.MSELoss), FitforgeTypeError, "pass an instance: MSELoss()"),
        (dict(train_metrics="f1"), FitforgeValueError, "unknown metric name 'f1'; known names: acc, accuracy"),
        (dict(val_metrics=[object()]), FitforgeTypeError, "val_metrics got object"),
        (dict(optimizer="adamx"), FitforgeValueError, "optimizer 'adamx' is not a known name; known: adam, adamw, sgd"),
        (dict(optimizer=torch.optim.SGD), FitforgeTypeError, "pass an instance: SGD(net.parameters(), lr=...)"),
        (dict(device="gpu"), FitforgeValueError, "device 'gpu' is not a device name"),
        (dict(device=1.5), FitforgeTypeError, "device must be None, a string such as 'cpu'"),
        (dict(batch_processor=BatchProcessor), FitforgeTypeError, "pass an instance: BatchProcessor()"),
        (
            dict(batch_processor=object()),
            FitforgeTypeError,
            "batch_processor must be a BatchProcessor instance, got object",
        ),
        (dict(net=nn.Linear), FitforgeTypeError, "net got the class Linear; pass an instance: Linear()"),
        (dict(net="resnet"), FitforgeTypeError, "net must be a torch.nn.Module, got str 'resnet'"),
        (dict(val_net=3), FitforgeTypeError, "val_net must be a torch.nn.Module, got int 3"),
    ],
)
def test_estimator_argument_errors(kwargs, error, message):
    args = dict(net=nn.Linear(1, 1), loss=nn.MSELoss(), optimizer="sgd", device="cpu")
    args.update(kwargs)
    with pytest.raises(error, match=re.escape(message)):
        Estimator(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_absent_device_is_a_clear_error():
    with pytest.raises(FitforgeValueError, match=re.escape("device 'cuda' was requested but CUDA is not available")):
        Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd", device="cuda")


class Monitors(EpochEnd, Monitoring):  # a user's handler watching a key declares the role
    def __init__(self, monitor):
        self.monitor = monitor


def test_monitor_naming_an_unknown_key_lists_the_available_keys():
    est = make_estimator()
    with pytest.raises(
        MonitorKeyError,
        match=re.escape(
            "Monitors monitors 'val_acc', which this run will not "
            "produce; available keys: train_loss, train_mae, train_samples_per_s, val_loss, "
            "val_mae, lr, epoch_time"
        ),
    ):
        est.fit(regression_batches(), val_data=regression_batches(), epochs=1, event_handlers=[Monitors("val_acc")])
    with pytest.raises(
        MonitorKeyError, match="available keys: train_loss, train_mae, train_samples_per_s, lr, epoch_time"
    ):
        est.fit(regression_batches(), epochs=1, event_handlers=[Monitors("val_loss")])
    est.fit(regression_batches(), val_data=regression_batches(), epochs=1, event_handlers=[Monitors("val_mae")])


def test_monitor_of_a_key_only_a_custom_eval_fn_produces_is_checked_at_first_use():
    from fitforge.metrics.monitor import monitored_value

    class Reads(Monitors):
        def epoch_end(self, state):
            monitored_value(state, self.monitor, self)

    custom = ValidationHandler(regression_batches(), eval_fn=lambda data, event_handlers: {"val_custom": 1.0})
    make_estimator().fit(regression_batches(), epochs=1, event_handlers=[custom, Reads("val_custom")])
    with pytest.raises(
        MonitorKeyError,
        match=re.escape(
            "Reads monitors 'val_other', which is not among the values produced: train_loss, train_mae, val_custom"
        ),
    ):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[custom, Reads("val_other")])


def test_history_keys_reflect_losses_metrics_and_optimizers():
    est = Estimator(TwoHeads(), [nn.CrossEntropyLoss(), nn.MSELoss()], optimizer="sgd", device="cpu")
    assert est.history_keys(validation=True) == [
        "train_loss",
        "train_loss_0",
        "train_loss_1",
        "train_accuracy",
        "train_samples_per_s",
        "val_loss",
        "val_loss_0",
        "val_loss_1",
        "val_accuracy",
        "lr",
        "epoch_time",
        *TIME_KEYS,
        "time_validation_s",
    ]


def test_default_handlers_false_adds_only_stopping_and_gradient_update():
    est = make_estimator()
    text = est.describe_loop(default_handlers=False)
    assert "MetricHandler" not in text and "LoggingHandler" not in text and "ValidationHandler" not in text
    assert "batch_end    GradientUpdateHandler(step) -> StoppingHandler(report)" in text
    history = est.fit(regression_batches(), epochs=2, default_handlers=False)
    assert set(history) == {"epoch_time", "lr", *TIME_KEYS} and est.net.weight.grad is None
    # val_data is an explicit request: validation still runs (with evaluate's own metrics)
    text = est.describe_loop(val_data=regression_batches(), default_handlers=False)
    assert "GradientUpdateHandler(step) -> ValidationHandler(metrics) -> StoppingHandler(report)" in text
    history = est.fit(regression_batches(), val_data=regression_batches(), epochs=2, default_handlers=False)
    assert set(history) == {"epoch_time", "lr", "val_loss", "val_mae", *TIME_KEYS, "time_validation_s"}
    with pytest.raises(FitforgeTypeError, match="default_handlers must be True or False, got str 'no'"):
        est.fit(regression_batches(), epochs=1, default_handlers="no")


def test_predict_uses_a_custom_unpack_for_pairs():
    class DictBatches(BatchProcessor):
        def unpack(self, batch):
            return (batch["x"],), batch["y"]

    est = make_estimator(batch_processor=DictBatches())
    batches = [{"x": x, "y": y} for x, y in regression_batches(2)]
    assert est.predict(batches).shape == (8, 1)


def test_predict_on_a_shuffled_loader_returns_dataset_order_with_a_warning():
    est = Estimator(nn.Identity(), nn.MSELoss(), device="cpu")  # inference only: no optimizer
    x = torch.arange(10.0).unsqueeze(1)
    shuffled = DataLoader(TensorDataset(x, x), batch_size=3, shuffle=True)
    with pytest.warns(UserWarning, match=r"predict: the DataLoader shuffles .* output i belongs to dataset\[i\]"):
        assert est.predict(shuffled).equal(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an ordered loader: no warning
        assert est.predict(DataLoader(TensorDataset(x), batch_size=3)).equal(x)
    assert len(list(shuffled)) == 4  # the user's loader is left as it was


def test_stop_reason_records_cancel_fit_and_failures():
    from fitforge.events import BatchEnd
    from fitforge.exceptions import CancelFit

    class Cancel(BatchEnd):
        def batch_end(self, state):
            raise CancelFit("diverged")

    assert (
        make_estimator().fit(regression_batches(), epochs=2, event_handlers=[Cancel()]).stop_reason
        == "CancelFit raised: diverged"
    )
    recorder = []

    class Fail(BatchEnd, __import__("fitforge.events", fromlist=["TrainEnd"]).TrainEnd):
        def batch_end(self, state):
            raise KeyError("x")

        def train_end(self, state):
            recorder.append(state.run.stop_reason)

    with pytest.raises(KeyError):
        make_estimator().fit(regression_batches(), epochs=2, event_handlers=[Fail()])
    assert recorder == ["failed: KeyError"]


def test_a_custom_predict_batch_gets_its_inputs_from_any_batch_form():
    class Doubled(BatchProcessor):
        def predict_batch(self, state, batch):
            (x,) = self.inputs_to_device(state, batch)  # bare tensor, (x,) or (x, y) alike
            return state.estimator.val_net(x) * 2

    estimator = make_estimator(batch_processor=Doubled())
    x = torch.arange(4.0).view(4, 1)
    expected = estimator.net(x).detach() * 2
    for data in ([x], [(x,)], [(x, x)]):
        assert torch.allclose(estimator.predict(data), expected)


def test_host_inputs_stay_where_they_are():
    seen = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x, lengths):
            seen.append(lengths)
            return self.linear(x)

    lengths = torch.tensor([1, 2, 3, 4])
    x = torch.rand(4, 1)
    estimator = make_estimator(net=Net(), batch_processor=BatchProcessor(host_inputs=(1,)))
    estimator.fit([((x, lengths), 2 * x)], epochs=1)
    estimator.predict([((x, lengths),)])  # a one-element batch holds the inputs only
    assert all(t is lengths for t in seen)  # the very same tensor: never copied
    with pytest.raises(
        FitforgeTypeError,
        match=r"BatchProcessor: host_inputs must be a tuple of input positions "
        r"\(ints >= 0\), got int 1",
    ):
        BatchProcessor(host_inputs=1)
    with pytest.raises(FitforgeValueError, match=r"host_inputs positions must be >= 0, got \(-1,\)"):
        BatchProcessor(host_inputs=(-1,))


def test_evaluate_and_predict_run_under_inference_mode_and_return_ordinary_tensors():
    modes = []

    class Net(nn.Linear):
        def forward(self, x):
            modes.append((torch.is_inference_mode_enabled(), self.training))
            return super().forward(x)

    estimator = make_estimator(net=Net(1, 1))
    x = torch.rand(4, 1)
    estimator.evaluate([(x, 2 * x)])
    pred = estimator.predict([x])
    assert modes == [(True, False), (True, False)] and estimator.net.training
    pred += 1  # an ordinary tensor: in-place updates and autograd work on it outside inference mode
    assert not pred.is_inference()


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


def test_monitor_keys_come_from_the_metric_handlers_actually_present():
    est = make_estimator()
    est.fit(regression_batches(), epochs=1, event_handlers=[MetricHandler("mse"), Monitors("train_mse")])
    inner = ValidationHandler(regression_batches(), event_handlers=[MetricHandler("rmse")])
    est.fit(regression_batches(), epochs=1, event_handlers=[inner, Monitors("val_rmse")])
    with pytest.raises(MonitorKeyError, match="available keys: lr, epoch_time"):
        est.fit(regression_batches(), epochs=1, event_handlers=[Monitors("train_loss")], default_handlers=False)
    est.fit(regression_batches(), epochs=1, event_handlers=[Monitors(3)])  # not a key: ignored


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
            return {"y": self.lin(x), "steps": 3}

    predicted = make_estimator(net=DictOut()).predict(regression_batches())  # extras are left out
    assert set(predicted) == {"y"} and predicted["y"].shape == (12, 1)

    class NoTensor(DictOut):
        def forward(self, x):
            return {"steps": 3}

    with pytest.raises(FitforgeTypeError, match=r"returned a dict of 'steps': int for batch 0; predict needs a tensor"):
        make_estimator(net=NoTensor()).predict(regression_batches())


class KeywordNet(nn.Module):
    """A net whose forward takes keyword arguments only, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, *, input_ids, attention_mask):
        hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return self.out(hidden.sum(1) / attention_mask.sum(1, keepdim=True))


def dict_samples(n=64):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (n, 6), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(6), "labels": ids[i, 0] % 3} for i in range(n)]


def test_a_keyword_only_net_trains_evaluates_and_predicts_from_dict_batches():
    torch.manual_seed(0)
    net = KeywordNet()
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.05), device="cpu"
    )
    train = DataLoader(dict_samples(), batch_size=16, shuffle=True)  # the default collate makes dict batches
    val = DataLoader(dict_samples(), batch_size=16)
    history = estimator.fit(train, val_data=val, epochs=15)
    assert history["val_accuracy"][-1] > 0.7 > history["val_accuracy"][0]  # it learned the first token's class
    assert estimator.evaluate(val)["val_accuracy"] == history["val_accuracy"][-1]
    assert estimator.predict(val).shape == (64, 3)  # predict drops the labels and passes the rest by name


def test_dict_keys_that_are_not_the_nets_arguments_are_named_before_any_step():
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer="adam", device="cpu")
    batch = {"image": torch.rand(8, 4), "label": torch.randint(0, 2, (8,))}
    expected = r"forward takes \(input\) and the batch's keys other than the label are \['image'\]"
    with pytest.raises(BatchFormatError, match=expected):
        assert unchanged_after(estimator, lambda: estimator.fit([batch], epochs=1))


def test_estimator_history_holds_every_epoch_of_every_fit():
    est = make_estimator()
    first = est.fit(regression_batches(), epochs=2)
    second = est.fit(regression_batches(), val_data=regression_batches(1), epochs=3)
    assert first.epochs == 2 and second.epochs == 3  # each fit still returns its own History
    assert est.history.epochs == 5
    assert est.history["train_loss"] == first["train_loss"] + second["train_loss"]
    assert all(math.isnan(v) for v in est.history["val_loss"][:2]) and est.history["val_loss"][2:] == second["val_loss"]


def test_logs_number_epochs_across_fits(caplog):
    est = make_estimator()
    seen = []

    class Epochs(EpochEnd):
        def epoch_end(self, state):
            seen.append((state.run.epochs_before, state.epoch))

    est.fit(regression_batches(), epochs=2, event_handlers=[Epochs()])
    est.fit(regression_batches(), epochs=1, event_handlers=[Epochs()])
    assert seen == [(0, 0), (0, 1), (2, 0)]


def test_a_failed_fit_keeps_its_epochs_in_the_estimator_history():
    class Fail(EpochEnd):
        def epoch_end(self, state):
            if state.epoch == 1:
                raise RuntimeError("boom")

    est = make_estimator()
    with pytest.raises(RuntimeError, match="boom"):
        est.fit(regression_batches(), epochs=3, event_handlers=[Fail()])
    assert est.history.epochs == 2  # the epoch that failed at its end has its row


def test_a_fit_failing_before_any_batch_completes_adds_no_epoch_to_the_estimator_history():
    estimator = make_estimator()
    bad = [(torch.rand(4, 1), torch.rand(4, 3))]  # the label's shape does not match the output
    with pytest.raises(LossInputError):
        estimator.fit(bad, epochs=2)
    assert estimator.history.epochs == 0
    history = estimator.fit(regression_batches(), epochs=1)
    assert estimator.history.epochs == history.epochs == 1 and not math.isnan(estimator.history["train_loss"][0])


def test_the_default_optimizer_warning_gives_the_rate_set_lr_chose():
    estimator = Estimator(nn.Linear(1, 1), nn.MSELoss(), device="cpu")
    estimator.set_lr(1e-4)
    with pytest.warns(UserWarning, match=r"using Adam\(lr=1e-4\)"):
        estimator.fit(regression_batches(), epochs=1)


def test_fit_trains_every_module_in_train_mode_and_checks_validation_in_eval_mode():
    modes = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(1, 1)

        def forward(self, x):
            modes.append((torch.is_grad_enabled(), self.training, self.inner.training))
            return self.inner(x)

    net = Net()
    net.eval()  # left in eval mode by the user: fit trains in train mode all the same
    estimator = make_estimator(net=net)
    estimator.fit(regression_batches(1), val_data=regression_batches(1), epochs=1)
    check, train, validation = modes
    assert check == validation == (False, False, False) and train == (True, True, True)
    assert net.training and net.inner.training


def test_a_val_net_in_eval_mode_around_the_net_hands_it_back_in_train_mode():
    seen = []

    class Spy(BatchBegin):
        def batch_begin(self, state):
            seen.append((state.epoch, net.training, net[1].training))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    val_net = nn.Sequential(net, nn.LogSoftmax(1)).eval()  # the user's evaluation wrapper, in eval mode
    est = Estimator(net, nn.CrossEntropyLoss(), val_net=val_net, val_loss=nn.NLLLoss(), optimizer="sgd", device="cpu")
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    est.fit([(x[:8], y[:8]), (x[8:], y[8:])], val_data=[(x, y)], epochs=2, event_handlers=[Spy()])
    assert seen == [(epoch, True, True) for epoch in (0, 0, 1, 1)]  # the check and each validation gave it back
    assert not val_net.training and not val_net[1].training


def test_evaluate_leaves_each_module_in_the_mode_it_found():
    net = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    net[1].eval()  # frozen statistics, set by hand (no train override)
    estimator = make_estimator(net=net)
    estimator.evaluate(regression_batches())
    assert net.training and not net[1].training and net[2].training


def test_a_fit_failing_before_training_leaves_the_net_s_mode_alone():
    estimator = make_estimator()
    estimator.net.eval()
    with pytest.raises(BatchFormatError):  # the validation batch, checked before training
        estimator.fit(regression_batches(), val_data=[(torch.rand(4, 1), "labels")], epochs=1)
    assert not estimator.net.training
