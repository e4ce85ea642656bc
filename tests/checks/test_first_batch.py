"""Every bad input is rejected before the first optimizer step (issue 14, points 4 and 5): a metric
that cannot take the output, a net off the estimator's device, nan/inf in the data, integer targets
for an elementwise loss, a feature-size mismatch. Each test checks the error and that no step
happened: weights and buffers bitwise unchanged, the optimizer's state empty."""

import math
import re

import pytest
import torch
import torchmetrics
from torch import nn

from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.events import BatchEnd
from fitforge.exceptions import (
    DeviceMismatchError,
    FitforgeTypeError,
    FitforgeValueError,
    ForwardError,
    LossInputError,
    NonFiniteInputError,
)
from fitforge.handlers import MetricHandler, ValidationHandler
from fitforge.metrics import SumCountMetric
from fitforge.testing import linear_problem
from helpers import make_estimator, regression_batches


def snapshot(module, buffers=False):
    """The parameters (and the buffers, BatchNorm's running statistics, with ``buffers``) off the meta device."""
    tensors = module.state_dict() if buffers else dict(module.named_parameters())
    return {k: v.detach().clone() for k, v in tensors.items() if v.device.type != "meta"}


def assert_untouched(est, before):
    """No optimizer step happened: what ``before`` holds is bitwise unchanged and the optimizer has no state."""
    now = est.net.state_dict()
    assert all(now[k].equal(v) for k, v in before.items())
    assert all(not opt.state for opt in est.optimizers)  # Adam fills its state at the first step


def classifier(outputs=3, features=5, **kwargs):
    net = nn.Sequential(nn.Linear(features, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, outputs))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()), device="cpu", **kwargs)


def class_batches(n=3, size=8, features=5, classes=3):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, features, generator=g), torch.randint(0, classes, (size,), generator=g)) for _ in range(n)
    ]


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x).relu()
        return self.a(h), self.b(h)


# -- 4. a metric that fails on the first batch ------------------------------------------------------------------


def _estimator_metric():
    return classifier(train_metrics="top5_accuracy"), {}, "top5_accuracy", "TopKAccuracy"


def _handler_metric():
    return (
        classifier(),
        {"event_handlers": [MetricHandler(metrics=["accuracy", "top5_accuracy"])]},
        "top5_accuracy",
        "TopKAccuracy",
    )


def _per_output_metric():
    net = TwoHeads()
    est = Estimator(
        net,
        [nn.CrossEntropyLoss(), nn.CrossEntropyLoss()],
        train_metrics={0: "accuracy", 1: "top5_acc"},
        optimizer=torch.optim.Adam(net.parameters()),
        device="cpu",
    )
    return est, {}, "top5_accuracy_1", "TopKAccuracy"


def _torchmetrics_metric():
    return classifier(train_metrics={"mse": torchmetrics.MeanSquaredError()}), {}, "mse", "MeanSquaredError"


@pytest.mark.parametrize(
    "make",
    [_estimator_metric, _handler_metric, _per_output_metric, _torchmetrics_metric],
    ids=["estimator", "MetricHandler(metrics=...)", "per output", "torchmetrics"],
)
def test_a_metric_failing_on_the_first_batch_fails_before_the_step(make):
    est, kwargs, name, kind = make()
    batches = class_batches()
    if isinstance(est.net, TwoHeads):
        batches = [(x, (y, y)) for x, y in batches]
    before = snapshot(est.net)
    with pytest.raises(
        FitforgeValueError,
        match=re.escape(
            f"metric {name!r} ({kind}) failed on pred: tensor of shape "
            "(8, 3) and label: tensor of shape (8,) in batch 0"
        ),
    ):
        est.fit(batches, epochs=1, **kwargs)
    assert_untouched(est, before)


class CountingMetric(SumCountMetric):
    name = "counted"

    def __init__(self):
        super().__init__()
        self.updates = 0

    def batch_stats(self, pred, label):
        self.updates += 1
        return (pred - label).abs().sum(), label.numel()


def test_the_real_metric_update_still_happens_once_per_batch():
    metric = CountingMetric()
    est = make_estimator(train_metrics=metric)
    history = est.fit(regression_batches(3), epochs=1)
    assert metric.updates == 3 and math.isfinite(history["train_counted"][0])


def _validation_handler(data):
    return ValidationHandler(data, event_handlers=[MetricHandler("top5_accuracy")])


@pytest.mark.parametrize(
    "val_metrics, handler, name",
    [
        ("top5_accuracy", None, "val_data"),
        (None, _validation_handler, "ValidationHandler val_data"),
    ],
    ids=["val_metrics", "ValidationHandler(event_handlers=[MetricHandler])"],
)
def test_a_failing_validation_metric_fails_before_training(val_metrics, handler, name):
    est = classifier(val_metrics=val_metrics)
    calls, fit_batch = [], est.batch_processor.fit_batch
    est.batch_processor.fit_batch = lambda state, batch: calls.append(1) or fit_batch(state, batch)
    batches = class_batches()
    before = snapshot(est.net, buffers=True)  # the check ran in eval mode: not even BatchNorm's statistics moved
    fit_kwargs = {"event_handlers": [handler(batches)]} if handler else {"val_data": batches}
    with pytest.raises(
        FitforgeValueError, match=re.escape(f"the first batch of {name} cannot be evaluated: metric 'top5_accuracy'")
    ):
        est.fit(batches, epochs=1, **fit_kwargs)
    assert not calls
    assert_untouched(est, before)


# -- 5. a net off the estimator's device ----------------------------------------------------------------------


def _moved_parameter(net):
    net[3].to("meta")  # after the Estimator placed the net: a later net.to(...) of part of it


def _moved_buffer(net):
    net[1].running_mean = torch.zeros(8, device="meta")


@pytest.mark.parametrize(
    "move, what",
    [(_moved_parameter, "parameter '3.weight'"), (_moved_buffer, "buffer '1.running_mean'")],
    ids=["parameter", "buffer"],
)
def test_a_net_moved_off_the_estimator_device_is_an_error_at_fit_start(move, what):
    est = classifier()
    move(est.net)
    before = snapshot(est.net, buffers=True)
    message = f"{what} of net is on the meta device, which holds no values: load the net's weights first"
    with pytest.raises(DeviceMismatchError, match=re.escape(message)):
        est.fit(class_batches(), epochs=1)
    assert_untouched(est, before)
    for call in (lambda: est.evaluate(class_batches()), lambda: est.predict(class_batches())):
        with pytest.raises(DeviceMismatchError, match=re.escape(f"{what} of val_net is on the meta device")):
            call()


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.ones(8)  # a plain attribute, not a buffer: net.to(...) leaves it where it is

    def forward(self, x):
        return x * self.scale


def test_a_plain_tensor_attribute_left_on_another_device_names_the_layer_and_the_fix():
    net = nn.Sequential(nn.Linear(5, 8), Scale(), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()), device="cpu")
    net[1].scale = torch.ones(8, device="meta")  # as if the net had been moved to a GPU without it
    before = snapshot(net)
    with pytest.raises(
        DeviceMismatchError,
        match=r"the net failed on the first batch in layer '1' \(Scale\(\)\), "
        r"which received x: .*attribute 'scale' is a plain tensor on meta, "
        r"not a registered buffer.*register_buffer\('scale'",
    ) as info:
        est.fit(class_batches(), epochs=1)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, RuntimeError)
    assert_untouched(est, before)


# -- 5. nan or inf in the inputs --------------------------------------------------------------------------------


def _with(value):
    """Class batches whose first holds ``value`` twice in its data."""
    batches = class_batches()
    x, y = batches[0]
    x = x.clone()
    x.view(-1)[:2] = value
    return [(x, y)] + batches[1:]


@pytest.mark.parametrize(
    "value, found",
    [(float("nan"), "2 nan and 0 inf"), (float("inf"), "0 nan and 2 inf"), (-float("inf"), "0 nan and 2 inf")],
    ids=["nan", "inf", "-inf"],
)
def test_nonfinite_inputs_are_rejected_before_the_forward(value, found):
    est = classifier()
    before = snapshot(est.net, buffers=True)
    with pytest.raises(NonFiniteInputError, match=re.escape(f"data: {found} of 40 values") + ".*torch.nan_to_num"):
        est.fit(_with(value), epochs=1)
    assert_untouched(est, before)  # BatchNorm's running statistics included: no forward ran


def test_nonfinite_labels_are_rejected_too():
    est = make_estimator()
    batches = regression_batches(2)
    batches[0] = (batches[0][0], torch.full((4, 1), float("nan")))
    with pytest.raises(NonFiniteInputError, match=re.escape("label: 4 nan and 0 inf of 4 values")):
        est.fit(batches, epochs=1)


def test_a_net_that_handles_nan_on_purpose_can_allow_it():
    class NanToNum(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(torch.nan_to_num(x))

    net = NanToNum()
    est = Estimator(
        net, nn.CrossEntropyLoss(), optimizer="sgd", device="cpu", batch_processor=BatchProcessor(allow_nonfinite=True)
    )
    est.fit(_with(float("nan")), epochs=1)


# -- 5. integer targets for an elementwise loss ---------------------------------------------------------------


@pytest.mark.parametrize(
    "loss",
    [nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss(), nn.HuberLoss(), nn.BCELoss(), nn.BCEWithLogitsLoss()],
    ids=lambda loss: type(loss).__name__,
)
def test_integer_targets_for_an_elementwise_loss_are_rejected(loss):
    net = nn.Sequential(nn.Linear(5, 1), nn.Sigmoid())
    est = Estimator(net, loss, optimizer=torch.optim.Adam(net.parameters()), device="cpu")
    batches = [(x, (y > 0).long().view(-1, 1)) for x, y in class_batches()]
    before = snapshot(net)
    name = type(loss).__name__
    with pytest.raises(
        LossInputError,
        match=re.escape(f"loss 0 ({name}) needs a floating-point label, got label shape (8, 1) int64")
        + r".*use label\.float\(\)",
    ):
        est.fit(batches, epochs=1)
    assert_untouched(est, before)


# -- 5. a feature-size mismatch --------------------------------------------------------------------------------


def test_data_with_the_wrong_feature_count_names_the_first_layer_and_the_fix():
    est = classifier(features=64)
    before = snapshot(est.net)
    with pytest.raises(
        ForwardError,
        match=re.escape(
            "the net failed on the first batch in layer '0' (Linear(in_features=64, out_features=8, bias=True)), "
            "which received input: shape (8, 32) float32"
        )
        + ".*"
        + re.escape("the data has 32 features but layer '0' expects 64: give it in_features=32, or check the data"),
    ) as info:
        est.fit(class_batches(features=32), epochs=1)
    assert isinstance(info.value, RuntimeError)  # code catching torch's error still catches it
    assert "mat1 and mat2 shapes cannot be multiplied" in str(info.value.__cause__)
    assert_untouched(est, before)
    assert not est.net._forward_pre_hooks  # nothing left behind for later batches


def test_a_hidden_layer_of_the_wrong_size_names_it_and_the_layer_before():
    net = nn.Sequential(nn.Linear(5, 64), nn.ReLU(), nn.Linear(32, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()), device="cpu")
    before = snapshot(net)
    with pytest.raises(
        ForwardError,
        match=re.escape(
            "layer '2' expects 32 features but receives 64 from the layers before it: give it in_features=64, "
            "or make the layers before it output 32"
        ),
    ):
        est.fit(class_batches(), epochs=1)
    assert_untouched(est, before)


class Rebinding(nn.Module):
    """A forward that rebinds its argument's name before the layer that fails."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(5, 64), nn.Linear(32, 3)

    def forward(self, x):
        x = self.first(x)
        return self.second(x)


def test_what_the_net_received_is_its_argument_even_when_forward_rebinds_the_name():
    # The layer received a tensor named like the net's argument, but not the net's input: the
    # message blames the layers before it, not the data.
    net = Rebinding()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), 0.1), device="cpu")
    with pytest.raises(ForwardError, match="layer 'second' expects 32 features but receives 64 from the layers before"):
        est.fit(class_batches(), epochs=1)


def test_what_the_net_received_is_what_its_forward_pre_hooks_gave_it():
    # A pre-hook that casts the input (as FSDP's mixed precision does): the data still has 5
    # features, and the message blames the data, not the layers before the first one.
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net.register_forward_pre_hook(lambda module, args: (args[0].float() / 255,))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), 0.1), device="cpu")
    data = [(torch.randint(0, 255, (8, 5), dtype=torch.uint8), torch.randint(0, 3, (8,)))]
    with pytest.raises(ForwardError, match="the data has 5 features but layer '0' expects 4"):
        est.fit(data, epochs=1)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, features):
        return self.layer(features)


def test_what_the_net_received_includes_its_keyword_arguments():
    est = Estimator(Keywords(), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    data = [{"features": torch.randn(8, 5), "labels": torch.randint(0, 3, (8,))}]
    with pytest.raises(ForwardError, match="the data has 5 features but layer 'layer' expects 4"):
        est.fit(data, epochs=1)


def test_net_arguments_is_empty_when_the_net_was_not_called_through_torch():
    from fitforge.checks.forward_errors import net_arguments

    net = nn.Linear(5, 3)
    try:
        net.forward(torch.zeros(2, 4))  # forward called directly: no Module.__call__ frame
    except RuntimeError as error:
        assert net_arguments(error, net) == ()
    x = torch.zeros(2, 4)
    try:
        net(x)
    except RuntimeError as error:
        (received,) = net_arguments(error, net)
        assert received is x


class OwnStep(BatchProcessor):
    """A custom training step that does not go through ``BatchProcessor.forward``."""

    def fit_batch(self, state, batch):
        x, y = batch
        pred = state.estimator.net(x)
        loss = nn.functional.cross_entropy(pred, y)
        loss.backward()
        return BatchOutput((x,), y, pred, loss, (loss,), len(x))


def test_a_custom_fit_batch_gets_the_explained_error_too():
    est = classifier(features=64, batch_processor=OwnStep())
    before = snapshot(est.net)
    with pytest.raises(ForwardError, match="the data has 32 features but layer '0' expects 64"):
        est.fit(class_batches(features=32), epochs=1)
    assert_untouched(est, before)


@pytest.mark.parametrize(
    "call", [lambda est, data: est.evaluate(data), lambda est, data: est.predict(data)], ids=["evaluate", "predict"]
)
def test_evaluate_and_predict_explain_the_first_batch_too(call):
    est = classifier(features=64)
    with pytest.raises(ForwardError, match="the data has 32 features but layer '0' expects 64"):
        call(est, class_batches(features=32))


def test_the_validation_check_explains_a_feature_mismatch_before_training():
    est = classifier()
    before = snapshot(est.net)
    with pytest.raises(
        ForwardError,
        match="^the first batch of val_data cannot be evaluated: the net failed on the first batch in layer '0'",
    ):
        est.fit(class_batches(), val_data=class_batches(features=4), epochs=1)
    assert_untouched(est, before)


def test_fitforge_errors_raised_inside_the_net_are_not_rewrapped():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            raise LossInputError("my own message")

    est = Estimator(Picky(), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    with pytest.raises(LossInputError, match="^my own message$"):
        est.fit(class_batches(), epochs=1)


def test_any_runtime_error_inside_the_net_names_the_module_and_keeps_the_original():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            raise RuntimeError("something else")

    est = Estimator(Broken(), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    with pytest.raises(
        ForwardError,
        match=re.escape(
            "the net failed on the first batch in the net's own forward "
            "(Broken()), which received x: shape (8, 5) float32"
        )
        + ".*Original error: something else",
    ) as info:
        est.fit(class_batches(), epochs=1)
    assert str(info.value.__cause__) == "something else"


def test_an_error_outside_the_net_is_raised_unchanged():
    class FailsAfterForward(OwnStep):
        def fit_batch(self, state, batch):
            state.estimator.net(batch[0])
            raise RuntimeError("outside the net")

    est = classifier(batch_processor=FailsAfterForward())
    with pytest.raises(RuntimeError, match="^outside the net$") as info:
        est.fit(class_batches(), epochs=1)
    assert type(info.value) is RuntimeError


def test_a_tensor_made_inside_forward_on_another_device_is_explained():
    class MakesItsOwn(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(x) + torch.zeros(3, device="meta")  # should be device=x.device

    est = Estimator(MakesItsOwn(), nn.CrossEntropyLoss(), optimizer="adam", device="cpu")
    with pytest.raises(
        DeviceMismatchError,
        match=re.escape("a tensor made inside forward is on another device: create it on the input's device"),
    ):
        est.fit(class_batches(), epochs=1)


def test_a_net_converted_to_half_after_the_estimator_gets_the_mixed_precision_fix():
    est = classifier()
    est.net.half()
    with pytest.raises(
        ForwardError,
        match=re.escape(
            "its weights are float16 but it received float32: keep the net in "
            "float32 and ask for mixed precision with Estimator(precision="
        ),
    ):
        est.fit(class_batches(), epochs=1)
    assert all(not opt.state for opt in est.optimizers)


@pytest.mark.parametrize(
    "labels, message",
    [
        (
            lambda y: y + 3,
            "labels go up to 5 but the net outputs 3 class scores, so labels must lie in 0..2: give the "
            "last layer 6 outputs",
        ),
        (
            lambda y: y - 1,
            "labels go down to -1, but class indices start at 0 (only ignore_index=-100 marks a label to "
            "skip): shift the labels",
        ),
    ],
    ids=["too high", "negative"],
)
def test_class_labels_out_of_range_are_rejected_before_any_step(labels, message):
    est = classifier()
    before = snapshot(est.net)
    with pytest.raises(LossInputError, match=re.escape(message)):
        est.fit([(x, labels(y)) for x, y in class_batches()], epochs=1)
    assert_untouched(est, before)


def test_the_class_range_costs_no_read_on_the_cpu_where_torch_checks_it():
    from fitforge.testing import HostReadCounter

    class Subclassed(nn.CrossEntropyLoss):  # fitforge checks its labels itself: a read
        pass

    def reads(loss):
        torch.manual_seed(0)
        est = Estimator(nn.Linear(5, 3), loss, optimizer="sgd", device="cpu")
        with HostReadCounter() as counter:
            est.fit(class_batches()[:1], epochs=1, default_handlers=False)
        return counter.count

    assert reads(nn.CrossEntropyLoss()) == reads(Subclassed()) - 1


@pytest.mark.parametrize("labels", [lambda y: y + 3, lambda y: y - 1], ids=["too high", "negative"])
def test_a_subclassed_classifier_loss_has_its_labels_checked_before_it_runs(labels):
    calls = []

    class Clamped(nn.CrossEntropyLoss):  # may take anything: fitforge checks for it
        def forward(self, pred, label):
            calls.append(1)
            return super().forward(pred, label.clamp(0, pred.shape[1] - 1))

    net = nn.Sequential(nn.Linear(5, 3))
    est = Estimator(net, Clamped(), optimizer="sgd", device="cpu")
    with pytest.raises(LossInputError, match="got class labels from"):
        est.fit([(x, labels(y)) for x, y in class_batches()], epochs=1)
    assert calls == []


def test_labels_the_loss_ignores_may_lie_outside_the_classes():
    est = classifier()
    data = class_batches()
    data[0][1][:2] = -100  # CrossEntropyLoss's default ignore_index: padding, say
    est.fit(data, epochs=1)


def test_nonfinite_values_in_a_dict_batch_are_named_by_key():
    class DictBatches(BatchProcessor):
        def unpack(self, batch):
            return (batch["x"],), batch["y"]

    est = classifier(batch_processor=DictBatches())
    data = [{"x": x, "y": y} for x, y in _with(float("inf"))]
    with pytest.raises(NonFiniteInputError, match=re.escape("batch['x']: 0 nan and 2 inf of 40 values")):
        est.fit(data, epochs=1)


def test_a_metric_that_cannot_be_copied_is_left_to_its_real_update():
    import threading

    class Locked(CountingMetric):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()  # deepcopy cannot copy a lock

    metric = Locked()
    make_estimator(train_metrics=metric, val_metrics="mae").fit(regression_batches(3), epochs=1)
    assert metric.updates == 3


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


class RecordedSamples(torch.utils.data.Dataset):
    """64 regression samples; records which indices this process fetched."""

    def __init__(self, label_shape=(1,)):
        self.fetched, self.label_shape = [], label_shape

    def __len__(self):
        return 64

    def __getitem__(self, index):
        self.fetched.append(index)
        return torch.full((1,), float(index)), torch.zeros(self.label_shape)


def test_the_validation_check_collates_two_samples_here_and_starts_no_worker():
    from torch.utils.data import DataLoader

    dataset = RecordedSamples()
    loader = DataLoader(dataset, batch_size=16, shuffle=True, num_workers=2)
    make_estimator().check_first_val_batch(loader, "val_data")
    assert dataset.fetched == [0, 1]  # fetched in this process: no worker was started to load a batch


def test_the_first_samples_of_a_tensor_dataset_are_what_collating_them_gives():
    from torch.utils.data import DataLoader, TensorDataset, default_collate

    from fitforge.checks.validation import first_samples

    x, y = torch.rand(8, 3), torch.arange(8)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    batch = first_samples(loader)
    expected = default_collate([loader.dataset[0], loader.dataset[1]])
    assert type(batch) is type(expected) and all(torch.equal(a, b) for a, b in zip(batch, expected))
    batch[0].zero_()  # a copy: a forward that changes its input in place leaves the dataset alone
    assert torch.equal(x[:2], expected[0])
    one = DataLoader(TensorDataset(x[:1], y[:1]), batch_size=4)
    assert [t.shape[0] for t in first_samples(one)] == [1, 1]


def test_the_first_samples_are_contiguous_as_batches_are_whatever_the_dataset_layout():
    from torch.utils.data import DataLoader, TensorDataset

    from fitforge.checks.validation import first_samples

    x = torch.rand(3, 4, 16).permute(2, 1, 0)  # 16 samples of (4, 3), not stored contiguously
    loader = DataLoader(TensorDataset(x, torch.zeros(16, 1)), batch_size=4)
    assert all(t.is_contiguous() for t in first_samples(loader)) and next(iter(loader))[0].is_contiguous()

    class Flatten(nn.Module):  # x.view needs a contiguous input, as the real batches are
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(12, 1)

        def forward(self, x):
            return self.fc(x.view(x.shape[0], -1))

    est = Estimator(Flatten(), nn.MSELoss(), optimizer="sgd", train_metrics=[])
    est.fit(loader, val_data=loader, epochs=1)  # the check before training runs the same forward


def test_a_mistake_in_the_first_samples_of_the_validation_data_still_fails_before_training():
    from torch.utils.data import DataLoader

    est = make_estimator()
    before = est.net.weight.detach().clone()
    val = DataLoader(RecordedSamples(label_shape=(3,)), batch_size=16)  # (N, 3) labels for a (N, 1) output
    with pytest.raises(LossInputError, match=r"^the first batch of val_data cannot be evaluated"):
        est.fit(regression_batches(), val_data=val, epochs=1)
    assert est.net.weight.detach().equal(before)


def test_check_first_false_leaves_the_validation_data_to_the_first_validation():
    from torch.utils.data import DataLoader

    dataset = RecordedSamples()
    validation = ValidationHandler(DataLoader(dataset, batch_size=16), check_first=False)
    seen = []

    class TrainBatches(BatchEnd):
        def batch_end(self, state):
            seen.append(len(dataset.fetched))

    make_estimator().fit(regression_batches(), epochs=1, event_handlers=[validation, TrainBatches()])
    assert seen == [0, 0, 0] and len(dataset.fetched) == 64  # nothing read before the validation itself
    with pytest.raises(FitforgeTypeError, match="ValidationHandler: check_first must be True or False"):
        ValidationHandler([], check_first="no")


def test_first_validation_batch_check_skips_one_shot_and_empty_data():
    est = make_estimator()
    batches = regression_batches(2)
    one_shot = iter(batches)
    est.check_first_val_batch(one_shot, "val_data")
    assert len(list(one_shot)) == 2  # nothing consumed
    est.check_first_val_batch([], "val_data")


def test_the_first_validation_batch_check_takes_arrays_as_evaluate_does():
    from fitforge.exceptions import LossInputError

    est = make_estimator()
    est.check_first_val_batch((torch.rand(8, 1), torch.rand(8, 1)))
    with pytest.raises(LossInputError, match="floating-point label"):
        est.check_first_val_batch((torch.rand(8, 1), torch.ones(8, 1, dtype=torch.long)))


def test_a_list_of_single_samples_is_recognised():
    samples = [(torch.rand(1), torch.tensor(2.0)) for _ in range(4)]  # (x, y) pairs, not batches
    with pytest.raises(FitforgeValueError, match="looks like a single sample, not a batch"):
        make_estimator(loss=lambda p, y: ((p.squeeze() - y) ** 2).mean(), train_metrics=[]).fit(samples, epochs=1)


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


class TokenScores(nn.Module):
    """A sequence model: scores of 11 classes on the last dim for each of a sequence's 5 positions."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

    def forward(self, tokens):
        return self.head(self.embed(tokens))  # (B, T, V)


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), nn.NLLLoss()], ids=["cross-entropy", "nll"])
def test_sequence_scores_with_classes_last_name_both_fixes_before_any_step(loss):
    net = TokenScores()
    before = [p.detach().clone() for p in net.parameters()]
    estimator = Estimator(net, loss, optimizer="sgd", device="cpu")
    tokens = torch.randint(0, 11, (4, 5))
    with pytest.raises(LossInputError) as info:
        estimator.fit([(tokens, tokens)], epochs=1)
    message = str(info.value)
    assert (
        "takes the class scores on dim 1, (N, C, T), but pred has shape (4, 5, 11) and the class labels (4, 5)"
        in message
    )
    assert "logits.transpose(1, 2) (shape (4, 11, 5))" in message
    assert f"loss = nn.{type(loss).__name__}(...), then Estimator(net, lambda pred, label: " in message
    assert "loss(pred.reshape(-1, 11), label.reshape(-1))" in message
    assert "prediction" not in message  # a BatchProcessor.prediction of one's own does not reach the loss
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_the_named_fixes_of_sequence_scores_train():
    tokens = torch.randint(0, 11, (4, 5))

    class Transposed(TokenScores):
        def forward(self, tokens):
            return super().forward(tokens).transpose(1, 2)

    smoothed = nn.CrossEntropyLoss(label_smoothing=0.1)
    flat = lambda pred, label: smoothed(pred.reshape(-1, 11), label.reshape(-1))  # noqa: E731  # as the message says
    for net, given in ((Transposed(), nn.CrossEntropyLoss()), (TokenScores(), flat)):
        history = Estimator(net, given, optimizer="adam", device="cpu").fit([(tokens, tokens)], epochs=3)
        assert history["train_loss"][-1] < history["train_loss"][0]
