"""Built-in metrics (values against hand computations), the Metric protocol, name resolution,
default metrics for a loss and metric-slot resolution."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.metrics import (
    Accuracy,
    BinaryAccuracy,
    Mean,
    MeanAbsoluteError,
    MeanSquaredError,
    Metric,
    MetricSlot,
    RootMeanSquaredError,
    SumCountMetric,
    TopKAccuracy,
    check_output_indices,
    default_metrics,
    metric_from_name,
    metric_name,
    resolve_metrics,
)
from fitforge.metrics.resolve import copy_slots

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402


def scores(indices, num_classes):
    """Scores of shape (N, C, ...) whose argmax over dim 1 is ``indices`` (N, ...), with seeded noise."""
    indices = torch.as_tensor(indices)
    one_hot = F.one_hot(indices, num_classes).float()
    one_hot = one_hot.movedim(-1, 1)  # (N, ..., C) -> (N, C, ...)
    return 2.0 * one_hot + 0.5 * torch.rand(one_hot.shape)


def value(metric):
    return float(metric.compute())


ALL_BUILTINS = [
    Accuracy,
    lambda: TopKAccuracy(2),
    BinaryAccuracy,
    MeanSquaredError,
    RootMeanSquaredError,
    MeanAbsoluteError,
    Mean,
]


# -- values against hand computations --------------------------------------------------------------
class TestAccuracy:
    def test_class_scores_weighted_by_batch_size(self):
        metric = Accuracy()
        # batch sizes 3, 5, 2 with 2, 3 and 2 correct -> 7/10 (the mean of batch accuracies would be 0.756)
        metric.update(scores([0, 1, 2], 3), torch.tensor([0, 1, 0]))
        metric.update(scores([0, 0, 1, 2, 2], 3), torch.tensor([0, 1, 1, 2, 0]))
        metric.update(scores([1, 1], 3), torch.tensor([1, 1]))
        assert value(metric) == pytest.approx(0.7)

    def test_segmentation_scores(self):
        metric = Accuracy()
        pred_idx = torch.tensor([[[0, 1], [2, 1]], [[0, 0], [1, 2]]])  # (N=2, H=2, W=2)
        label = torch.tensor([[[0, 1], [1, 1]], [[2, 0], [1, 2]]])
        pred = scores(pred_idx, 3)
        assert pred.shape == (2, 3, 2, 2)
        metric.update(pred, label)  # 3 + 3 of 8 pixels
        assert value(metric) == pytest.approx(6 / 8)
        metric.update(scores(torch.zeros(1, 2, 2, dtype=torch.long), 3), torch.tensor([[[0, 1], [2, 0]]]))
        assert value(metric) == pytest.approx(8 / 12)  # per pixel, over both batches

    def test_class_index_predictions_of_label_shape(self):
        metric = Accuracy()
        metric.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
        assert value(metric) == pytest.approx(2 / 3)

    def test_shape_mismatch(self):
        metric = Accuracy()
        msg = "accuracy: pred of shape (4,) (after argmax over dim 1) does not match label of shape (4, 2)"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            metric.update(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.long))
        assert math.isnan(value(metric))  # a failed update leaves the state untouched


class TestTopKAccuracy:
    def test_values(self):
        metric = TopKAccuracy(2)
        assert metric.name == "top2_accuracy"
        pred = torch.tensor(
            [
                [0.1, 0.5, 0.3, 0.2],  # top2 {1, 2}, label 2: hit
                [0.9, 0.05, 0.03, 0.02],  # top2 {0, 1}, label 3: miss
                [0.1, 0.2, 0.3, 0.4],  # top2 {3, 2}, label 2: hit
            ]
        )
        metric.update(pred, torch.tensor([2, 3, 2]))
        assert value(metric) == pytest.approx(2 / 3)
        metric.update(torch.tensor([[0.4, 0.3, 0.2, 0.1]]), torch.tensor([1]))  # top2 {0, 1}: hit
        assert value(metric) == pytest.approx(3 / 4)  # not (2/3 + 1) / 2

    def test_top1_equals_accuracy(self):
        pred, label = torch.randn(20, 5), torch.randint(0, 5, (20,))
        top1, acc = TopKAccuracy(1), Accuracy()
        top1.update(pred, label)
        acc.update(pred, label)
        assert value(top1) == pytest.approx(value(acc))

    def test_topk_with_k_equal_classes_is_one(self):
        metric = TopKAccuracy(3)
        metric.update(torch.randn(6, 3), torch.randint(0, 3, (6,)))
        assert value(metric) == 1.0

    @pytest.mark.parametrize("shape", [(4, 3), (4,)])
    def test_too_few_classes(self, shape):
        msg = f"top5_accuracy: needs scores of shape (N, C) with C >= 5, got {shape}"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            TopKAccuracy(5).update(torch.randn(*shape), torch.zeros(4, dtype=torch.long))

    @pytest.mark.parametrize("k", [0, -1, 2.0, "3"])
    def test_bad_k(self, k):
        with pytest.raises(FitforgeValueError, match=re.escape(f"k must be a positive int, got {k!r}")):
            TopKAccuracy(k)

    def test_bool_k_rejected(self):
        with pytest.raises(FitforgeValueError, match="k must be a positive int"):
            TopKAccuracy(True)

    def test_label_of_wrong_shape_is_an_error(self):
        metric = TopKAccuracy(2)
        pred = torch.tensor([[3.0, 2.0, 1.0], [2.0, 3.0, 1.0]])  # both rows have class 0 in their top 2
        with pytest.raises(FitforgeValueError, match="top2_accuracy"):
            metric.update(pred, torch.tensor([[0], [0]]))


class TestBinaryAccuracy:
    def test_probabilities(self):
        metric = BinaryAccuracy()
        metric.update(torch.tensor([0.9, 0.2, 0.6, 0.4]), torch.tensor([1.0, 0.0, 0.0, 0.0]))  # 3 of 4
        metric.update(torch.tensor([0.7, 0.1]), torch.tensor([1.0, 1.0]))  # 1 of 2
        assert value(metric) == pytest.approx(4 / 6)

    def test_threshold(self):
        metric = BinaryAccuracy(threshold=0.65)
        metric.update(torch.tensor([0.9, 0.2, 0.6, 0.4]), torch.tensor([1.0, 0.0, 0.0, 0.0]))  # 4 of 4
        metric.update(torch.tensor([0.7, 0.1]), torch.tensor([1.0, 1.0]))  # 1 of 2
        assert value(metric) == pytest.approx(5 / 6)

    def test_logits(self):
        metric = BinaryAccuracy(logits=True)
        metric.update(torch.tensor([2.0, -1.0, 0.5, -0.3]), torch.tensor([1.0, 0.0, 0.0, 0.0]))  # 3 of 4
        metric.update(torch.tensor([-0.2, 3.0]), torch.tensor([0, 1]))  # integer labels work too: 2 of 2
        assert value(metric) == pytest.approx(5 / 6)

    def test_logits_treated_as_probabilities_without_flag(self):
        metric = BinaryAccuracy()
        metric.update(torch.tensor([2.0, -1.0, 0.5, -0.3]), torch.tensor([1.0, 0.0, 0.0, 0.0]))  # 0.5 > 0.5 is False
        assert value(metric) == pytest.approx(1.0)

    def test_repr(self):
        assert repr(BinaryAccuracy(0.3, logits=True)) == "BinaryAccuracy(threshold=0.3, logits=True)"

    def test_shape_mismatch(self):
        msg = "binary_accuracy: pred shape (4, 1) must equal label shape (4,)"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            BinaryAccuracy().update(torch.rand(4, 1), torch.ones(4))


class TestElementwise:
    def feed(self, metric):
        # batch 1: diffs [0, 2, 3] -> squares 13, abs 5 over 3 elements
        metric.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 0.0]))
        # batch 2 (2x2 = 4 elements): diffs [0, 0, 0, -1] -> squares 1, abs 1
        metric.update(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
        return metric

    def test_mse(self):
        assert value(self.feed(MeanSquaredError())) == pytest.approx(14 / 7)

    def test_rmse_is_sqrt_of_epoch_mean(self):
        rmse = value(self.feed(RootMeanSquaredError()))
        assert rmse == pytest.approx(math.sqrt(14 / 7))
        mean_of_batch_rmses = (math.sqrt(13 / 3) + math.sqrt(1 / 4)) / 2
        assert rmse != pytest.approx(mean_of_batch_rmses)

    def test_mae(self):
        assert value(self.feed(MeanAbsoluteError())) == pytest.approx(6 / 7)

    def test_integer_labels(self):
        metric = MeanSquaredError()
        metric.update(torch.tensor([0.5, 2.0]), torch.tensor([1, 2]))
        assert value(metric) == pytest.approx(0.125)

    @pytest.mark.parametrize(
        "cls,name", [(MeanSquaredError, "mse"), (RootMeanSquaredError, "rmse"), (MeanAbsoluteError, "mae")]
    )
    def test_shape_mismatch(self, cls, name):
        msg = f"{name}: pred shape (4, 1) must equal label shape (4,)"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            cls().update(torch.randn(4, 1), torch.randn(4))


class TestMean:
    def test_weighted_by_batch_size(self):
        metric = Mean()
        metric.update(torch.tensor(2.0), 3)
        metric.update(torch.tensor(0.5), 1)
        assert value(metric) == pytest.approx((2.0 * 3 + 0.5) / 4)

    def test_default_weight_one(self):
        metric = Mean()
        metric.update(torch.tensor(1.0))
        metric.update(torch.tensor(3.0))
        assert value(metric) == pytest.approx(2.0)

    def test_matches_dataset_mean(self):
        losses = torch.rand(10)
        metric = Mean()
        for chunk in (losses[:3], losses[3:8], losses[8:]):
            metric.update(chunk.mean(), len(chunk))
        assert value(metric) == pytest.approx(float(losses.double().mean()))


# -- state: reset, nan before update, device, graphs -------------------------------------------------
@pytest.mark.parametrize("factory", ALL_BUILTINS)
def test_compute_before_update_is_nan(factory):
    result = factory().compute()
    assert isinstance(result, torch.Tensor)
    assert math.isnan(float(result))


@pytest.mark.parametrize("factory", ALL_BUILTINS)
def test_value_is_compute_read_to_the_host(factory):
    torch.manual_seed(0)
    metric = factory()
    assert math.isnan(metric.value())  # nothing counted yet
    for _ in range(3):
        pred, label = (
            (torch.randn(7), torch.randn(7))
            if factory in (MeanSquaredError, MeanAbsoluteError, RootMeanSquaredError)
            else (torch.randn(7, 5), torch.randint(0, 5, (7,)))
        )
        if factory is BinaryAccuracy:
            pred, label = torch.randn(7), torch.randint(0, 2, (7,)).float()
        if factory is Mean:
            pred, label = torch.rand(()), 7
        metric.update(pred, label)
    assert isinstance(metric.value(), float)
    assert metric.value() == float(metric.compute())  # the same float64 division, bit for bit


def test_value_of_a_subclass_computing_its_own_way_goes_through_compute():
    class Halved(Mean):
        def compute(self):
            return super().compute() / 2

    class Counted(SumCountMetric):  # a count that depends on the values stays a device tensor
        def batch_stats(self, pred, label):
            return pred.sum(), (pred > 0).sum()

    halved, counted = Halved(), Counted()
    halved.update(torch.tensor(3.0), 1)
    counted.update(torch.tensor([1.0, 2.0, -1.0]), torch.zeros(3))
    assert halved.value() == 1.5
    assert counted.value() == 1.0


def test_reset():
    metric = Accuracy()
    metric.update(scores([0, 1], 3), torch.tensor([0, 0]))
    assert value(metric) == pytest.approx(0.5)
    metric.reset()
    assert math.isnan(value(metric))
    metric.update(scores([2], 3), torch.tensor([2]))
    assert value(metric) == 1.0  # nothing of the first epoch remains


def test_reset_mean():
    metric = Mean()
    metric.update(torch.tensor(5.0), 4)
    metric.reset()
    metric.update(torch.tensor(1.0), 2)
    assert value(metric) == 1.0


def test_to_device_before_and_after_update():
    metric = MeanSquaredError()
    assert metric.to("cpu") is metric
    assert metric.to(torch.device("cpu")) is metric
    metric.update(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0]))
    assert metric.to("cpu") is metric
    assert value(metric) == pytest.approx(5.0)
    moved = metric.to("meta")  # moves the accumulator without needing an accelerator
    assert moved is metric
    assert metric._sum.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accumulates_on_cuda():  # pragma: no cover - depends on the machine
    metric = Accuracy().to("cuda")
    metric.update(scores([0, 1, 2], 3).cuda(), torch.tensor([0, 1, 0]).cuda())
    assert metric.compute().device.type == "cuda"
    assert value(metric) == pytest.approx(2 / 3)
    metric.to("cpu")
    assert metric.compute().device.type == "cpu"


@pytest.mark.parametrize(
    "factory,pred,label",
    [
        (Accuracy, torch.randn(4, 3), torch.tensor([0, 1, 2, 0])),
        (lambda: TopKAccuracy(2), torch.randn(4, 3), torch.tensor([0, 1, 2, 0])),
        (lambda: BinaryAccuracy(logits=True), torch.randn(4), torch.tensor([0.0, 1.0, 1.0, 0.0])),
        (MeanSquaredError, torch.randn(4), torch.randn(4)),
        (RootMeanSquaredError, torch.randn(4), torch.randn(4)),
        (MeanAbsoluteError, torch.randn(4), torch.randn(4)),
    ],
)
def test_update_with_grad_keeps_no_graph(factory, pred, label):
    metric = factory()
    pred = pred.clone().requires_grad_(True)
    metric.update(pred * 2, label)
    metric.update(pred * 3, label)
    assert not metric._sum.requires_grad and metric._sum.grad_fn is None
    assert not metric.compute().requires_grad


def test_mean_with_grad_keeps_no_graph():
    weight = torch.ones(3, requires_grad=True)
    metric = Mean()
    metric.update((weight * 2).sum(), 4)
    metric.update((weight * 3).sum(), 2)
    assert not metric._sum.requires_grad and metric._sum.grad_fn is None
    assert value(metric) == pytest.approx((6 * 4 + 9 * 2) / 6)


def test_reprs():
    assert repr(Accuracy()) == "Accuracy()"
    assert repr(MeanSquaredError()) == "MeanSquaredError()"
    assert repr(TopKAccuracy(3)) == "TopKAccuracy(k=3)"


def test_sum_count_metric_subclass_contract():
    class Incomplete(SumCountMetric):
        pass

    with pytest.raises(NotImplementedError):
        Incomplete().update(torch.zeros(2), torch.zeros(2))

    class Positives(SumCountMetric):
        name = "positives"

        def batch_stats(self, pred, label):
            return (pred > 0).sum(), pred.numel()

    metric = Positives()
    metric.update(torch.tensor([1.0, -1.0, 2.0]), torch.zeros(3))
    metric.update(torch.tensor([-1.0]), torch.zeros(1))
    assert value(metric) == pytest.approx(0.5)
    assert isinstance(metric, Metric) and metric_name(metric) == "positives"


# -- the protocol -------------------------------------------------------------------------------------
def test_protocol_accepts_builtins_and_torchmetrics():
    for factory in ALL_BUILTINS:
        assert isinstance(factory(), Metric)
    assert isinstance(MulticlassAccuracy(num_classes=3), Metric)
    assert issubclass(Accuracy, SumCountMetric)


@pytest.mark.parametrize("obj", [object(), nn.Linear(1, 1), "accuracy", 3, lambda p, y: 0])
def test_protocol_rejects_non_metrics(obj):
    assert not isinstance(obj, Metric)


# -- name resolution -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,cls,name_attr",
    [
        ("accuracy", Accuracy, "accuracy"),
        ("acc", Accuracy, "accuracy"),
        ("Accuracy", Accuracy, "accuracy"),
        ("top3_accuracy", TopKAccuracy, "top3_accuracy"),
        ("top5_acc", TopKAccuracy, "top5_accuracy"),
        ("TOP10_ACCURACY", TopKAccuracy, "top10_accuracy"),
        ("mse", MeanSquaredError, "mse"),
        ("rmse", RootMeanSquaredError, "rmse"),
        ("mae", MeanAbsoluteError, "mae"),
        ("binary_accuracy", BinaryAccuracy, "binary_accuracy"),
    ],
)
def test_metric_from_name(name, cls, name_attr):
    metric = metric_from_name(name)
    assert type(metric) is cls
    assert metric.name == name_attr
    assert metric_from_name(name) is not metric  # a fresh object each time


def test_metric_from_name_topk_k():
    assert metric_from_name("top3_accuracy").k == 3
    assert not metric_from_name("binary_accuracy").logits


@pytest.mark.parametrize("name", ["f1", "accuracy_top3", "top_accuracy", "topk_accuracy", ""])
def test_unknown_metric_name(name):
    known = "acc, accuracy, binary_accuracy, mae, mse, rmse, top<k>_accuracy"
    with pytest.raises(FitforgeValueError, match=re.escape(f"unknown metric name {name!r}; known names: {known}")):
        metric_from_name(name)


def test_top0_accuracy_name_is_an_error():
    with pytest.raises(FitforgeValueError, match="k must be a positive int, got 0"):
        metric_from_name("top0_accuracy")


# -- default metrics ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loss,cls,logits",
    [
        (nn.CrossEntropyLoss(), Accuracy, None),
        (nn.NLLLoss(), Accuracy, None),
        (nn.BCELoss(), BinaryAccuracy, False),
        (nn.BCEWithLogitsLoss(), BinaryAccuracy, True),
        (nn.MSELoss(), MeanAbsoluteError, None),
    ],
)
def test_default_metrics(loss, cls, logits):
    metrics = default_metrics(loss)
    assert len(metrics) == 1 and type(metrics[0]) is cls
    if logits is not None:
        assert metrics[0].logits is logits


@pytest.mark.parametrize("loss", [nn.L1Loss(), nn.SmoothL1Loss(), lambda p, y: (p - y).abs().mean(), None])
def test_default_metrics_other_losses(loss):
    assert default_metrics(loss) == []


def test_default_metrics_fresh_objects():
    loss = nn.CrossEntropyLoss()
    assert default_metrics(loss)[0] is not default_metrics(loss)[0]


# -- resolve_metrics --------------------------------------------------------------------------------------
def names(slots):
    return [(s.name, s.output) for s in slots]


class TestResolveMetrics:
    def test_none_uses_default_for_loss(self):
        slots = resolve_metrics(None, nn.CrossEntropyLoss())
        assert names(slots) == [("accuracy", 0)]
        assert isinstance(slots[0], MetricSlot) and type(slots[0].metric) is Accuracy
        assert names(resolve_metrics(None, nn.MSELoss())) == [("mae", 0)]
        assert resolve_metrics(None, nn.L1Loss()) == []

    def test_none_with_loss_list_uses_first_loss(self):
        assert names(resolve_metrics(None, [nn.CrossEntropyLoss(), nn.MSELoss()])) == [("accuracy", 0)]
        assert names(resolve_metrics(None, (nn.BCEWithLogitsLoss(),))) == [("binary_accuracy", 0)]

    def test_name(self):
        slots = resolve_metrics("top3_accuracy", nn.CrossEntropyLoss())
        assert names(slots) == [("top3_accuracy", 0)]
        assert slots[0].metric.k == 3

    def test_object_is_used_as_is(self):
        metric = MeanSquaredError()
        slots = resolve_metrics(metric, nn.MSELoss())
        assert names(slots) == [("mse", 0)] and slots[0].metric is metric

    def test_torchmetrics_object(self):
        metric = MulticlassAccuracy(num_classes=3)
        slots = resolve_metrics(metric, nn.CrossEntropyLoss())
        assert names(slots) == [("multiclass_accuracy", 0)] and slots[0].metric is metric

    def test_list_and_tuple(self):
        mse = MeanSquaredError()
        slots = resolve_metrics(["rmse", mse, "mae"], nn.MSELoss())
        assert names(slots) == [("rmse", 0), ("mse", 0), ("mae", 0)]
        assert slots[1].metric is mse
        assert names(resolve_metrics(("accuracy", "top2_acc"), None)) == [("accuracy", 0), ("top2_accuracy", 0)]

    def test_empty_list(self):
        assert resolve_metrics([], nn.CrossEntropyLoss()) == []

    def test_dict_of_names(self):
        mae = MeanAbsoluteError()
        slots = resolve_metrics({"my_acc": "accuracy", "err": mae}, nn.CrossEntropyLoss())
        assert names(slots) == [("my_acc", 0), ("err", 0)]
        assert type(slots[0].metric) is Accuracy and slots[1].metric is mae

    def test_dict_of_output_indices(self):
        slots = resolve_metrics(
            {0: "accuracy", 1: ["mse", "mae"], 2: {"err": "rmse"}}, [nn.CrossEntropyLoss(), nn.MSELoss(), nn.MSELoss()]
        )
        assert names(slots) == [("accuracy_0", 0), ("mse_1", 1), ("mae_1", 1), ("err", 2)]
        assert type(slots[3].metric) is RootMeanSquaredError

    def test_duplicate_names(self):
        msg = "train_metrics has several metrics named ['accuracy']; name them with a dict"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            resolve_metrics(["accuracy", "acc"], nn.CrossEntropyLoss())
        with pytest.raises(FitforgeValueError, match=re.escape("several metrics named ['mse']")):
            resolve_metrics([MeanSquaredError(), MeanSquaredError(), "mae"], nn.MSELoss())

    def test_duplicate_names_within_an_output(self):
        with pytest.raises(FitforgeValueError, match=re.escape("val_metrics has several metrics named ['accuracy_1']")):
            resolve_metrics({1: ["acc", "accuracy"]}, nn.CrossEntropyLoss(), argument="val_metrics")

    def test_names_chosen_per_output_keep_no_index(self):
        slots = resolve_metrics({0: {"cls_acc": "accuracy"}, 1: ["mae", "mse"]}, None)
        assert names(slots) == [("cls_acc", 0), ("mae_1", 1), ("mse_1", 1)]

    def test_a_name_chosen_on_several_outputs_gets_their_index(self):
        slots = resolve_metrics({0: {"score": "accuracy", "top": "top2_acc"}, 1: {"score": "mae"}}, None)
        assert names(slots) == [("score_0", 0), ("top", 0), ("score_1", 1)]

    def test_a_name_chosen_clashing_with_a_kind_name(self):
        with pytest.raises(FitforgeValueError, match=re.escape("train_metrics has several metrics named ['mae_1']")):
            resolve_metrics({0: {"mae_1": "mae"}, 1: "mae"}, None)

    def test_nested_names_must_be_strs(self):
        with pytest.raises(
            FitforgeTypeError, match=re.escape("metric names in a dict must be non-empty strs, got keys [2]")
        ):
            resolve_metrics({0: {2: "mae"}}, None)

    def test_same_name_on_different_outputs_is_fine(self):
        slots = resolve_metrics({0: "accuracy", 1: "accuracy"}, None)
        assert names(slots) == [("accuracy_0", 0), ("accuracy_1", 1)]
        assert slots[0].metric is not slots[1].metric

    def test_mixed_dict_keys(self):
        msg = "train_metrics dict keys must be all metric names (str) or all output indices (int), got keys [0, 'x']"
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            resolve_metrics({0: "accuracy", "x": "mse"}, nn.CrossEntropyLoss())

    @pytest.mark.parametrize("spec", [Accuracy, [Accuracy], {"acc": Accuracy}, {0: Accuracy}])
    def test_class_instead_of_instance(self, spec):
        msg = "train_metrics got the class Accuracy; pass an instance: Accuracy()"
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            resolve_metrics(spec, nn.CrossEntropyLoss())

    def test_torchmetrics_class_instead_of_instance(self):
        with pytest.raises(FitforgeTypeError, match=re.escape("pass an instance: MulticlassAccuracy()")):
            resolve_metrics(MulticlassAccuracy, nn.CrossEntropyLoss())

    @pytest.mark.parametrize("spec,shown", [(42, "int 42"), (nn.Linear(1, 1), "Linear"), ([object()], "object")])
    def test_not_a_metric(self, spec, shown):
        with pytest.raises(FitforgeTypeError, match=re.escape(f"val_metrics got {shown}")) as info:
            resolve_metrics(spec, nn.CrossEntropyLoss(), argument="val_metrics")
        assert "update(pred, label), compute(), reset() and to(device)" in str(info.value)

    def test_unknown_name_inside_list(self):
        with pytest.raises(FitforgeValueError, match=re.escape("unknown metric name 'f1'")):
            resolve_metrics(["accuracy", "f1"], nn.CrossEntropyLoss())

    def test_user_metric_objects_never_renamed(self):
        acc, topk, tm = Accuracy(), TopKAccuracy(3), MulticlassAccuracy(num_classes=3)
        before = (dict(vars(acc)), dict(vars(topk)), set(vars(tm)))
        slots = resolve_metrics({"my_acc": acc, "my_top": topk, "tm": tm}, nn.CrossEntropyLoss())
        assert names(slots) == [("my_acc", 0), ("my_top", 0), ("tm", 0)]
        slots += resolve_metrics({1: [acc, topk, tm]}, None)
        assert names(slots[3:]) == [("accuracy_1", 1), ("top3_accuracy_1", 1), ("multiclass_accuracy_1", 1)]
        assert (dict(vars(acc)), dict(vars(topk)), set(vars(tm))) == before
        assert acc.name == "accuracy" and topk.name == "top3_accuracy"
        assert getattr(tm, "name", None) is None


LOSS_BY_NAME = {"cls": nn.CrossEntropyLoss(), "reg": nn.MSELoss(), "aux": nn.L1Loss()}


class TestResolveMetricsByOutputName:
    def test_none_gives_each_output_its_loss_default(self):
        slots = resolve_metrics(None, LOSS_BY_NAME)
        assert names(slots) == [("cls_accuracy", "cls"), ("reg_mae", "reg")]
        assert all(slot.inferred for slot in slots)

    def test_every_form_per_output(self):
        mae = MeanAbsoluteError()
        slots = resolve_metrics({"cls": "accuracy", "reg": [mae, "rmse"], "aux": {"err": "mse"}}, LOSS_BY_NAME)
        assert names(slots) == [("cls_accuracy", "cls"), ("reg_mae", "reg"), ("reg_rmse", "reg"), ("aux_err", "aux")]
        assert slots[1].metric is mae and not any(slot.inferred for slot in slots)
        assert slots[0].output_index == "cls"  # the older name of ``output``

    @pytest.mark.parametrize("spec", [[], {}])
    def test_no_metrics(self, spec):
        assert resolve_metrics(spec, LOSS_BY_NAME) == []

    def test_an_output_the_loss_does_not_name(self):
        msg = "val_metrics names the output(s) 'box', which loss does not: its outputs are 'cls', 'reg', 'aux'"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            resolve_metrics({"cls": "accuracy", "box": "mae"}, LOSS_BY_NAME, argument="val_metrics")

    @pytest.mark.parametrize("spec,shown", [("accuracy", "str 'accuracy'"), (["mae"], "list ['mae']")])
    def test_not_by_output_name(self, spec, shown):
        msg = f"train_metrics must be a dict by output name, as loss is (its outputs: 'cls', 'reg', 'aux'), got {shown}"
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            resolve_metrics(spec, LOSS_BY_NAME)

    def test_copies_keep_the_output(self):
        copies = copy_slots(resolve_metrics({"reg": "mae"}, LOSS_BY_NAME))
        assert names(copies) == [("reg_mae", "reg")]


class TestCheckOutputIndices:
    def test_a_metric_named_as_a_loss(self):
        slots = resolve_metrics({0: {"loss_1": "accuracy"}}, None)
        with pytest.raises(
            FitforgeValueError, match=re.escape("the metric name 'loss_1' is the history name of a loss")
        ):
            check_output_indices(slots, 2, "train_metrics")
        check_output_indices(slots, 1, "train_metrics")  # one loss: no loss_1

    def test_a_name_the_loss_does_not_know(self):
        slots = resolve_metrics({"cls": "accuracy"}, {"cls": nn.CrossEntropyLoss()})
        msg = "metric 'cls_accuracy' reads the output 'cls', which the loss does not name: its outputs are 'a', 'b'"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            check_output_indices(slots, ("a", "b"), "val_metrics")


# -- metric_name ------------------------------------------------------------------------------------------
class NamedThing:
    def __init__(self, name):
        self.name = name


class MyCustomScore:
    pass


@pytest.mark.parametrize(
    "metric,expected",
    [
        (Accuracy(), "accuracy"),
        (TopKAccuracy(4), "top4_accuracy"),
        (BinaryAccuracy(), "binary_accuracy"),
        (Mean(), "mean"),
        (MulticlassAccuracy(num_classes=3), "multiclass_accuracy"),
        (torchmetrics.MeanSquaredError(), "mean_squared_error"),
        (torchmetrics.R2Score(), "r2_score"),
        (MyCustomScore(), "my_custom_score"),
        (NamedThing("custom"), "custom"),
        (NamedThing(""), "named_thing"),
        (NamedThing(3), "named_thing"),
    ],
)
def test_metric_name(metric, expected):
    assert metric_name(metric) == expected


@pytest.mark.parametrize(
    "metric,expected",
    [
        (torchmetrics.classification.BinaryF1Score(), "binary_f1_score"),
        (torchmetrics.classification.MulticlassAUROC(num_classes=3), "multiclass_auroc"),
    ],
)
def test_metric_name_acronyms(metric, expected):
    assert metric_name(metric) == expected


# -- copy_slots -----------------------------------------------------------------------------------------
def test_copy_slots_gives_independent_objects():
    tm = MulticlassAccuracy(num_classes=3)
    slots = resolve_metrics({0: ["accuracy", tm], 1: "mse"}, None)
    copies = copy_slots(slots)
    assert names(copies) == names(slots)
    for original, copy in zip(slots, copies):
        assert copy is not original and copy.metric is not original.metric
        assert type(copy.metric) is type(original.metric)
    copies[0].metric.update(scores([0, 1], 3), torch.tensor([0, 1]))
    copies[1].metric.update(scores([0, 1], 3), torch.tensor([0, 1]))
    assert value(copies[0].metric) == 1.0
    assert math.isnan(value(slots[0].metric))  # the original saw nothing
    assert float(copies[1].metric.compute()) == 1.0
    slots[1].metric.update(scores([0, 1], 3), torch.tensor([2, 2]))
    assert float(slots[1].metric.compute()) == 0.0
    assert float(copies[1].metric.compute()) == 1.0


def test_accuracy_ignore_index_counts_only_kept_labels_on_the_device():
    metric = Accuracy(ignore_index=0)
    scores = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]]).transpose(1, 2)  # (1, C=3, T=3)
    metric.update(scores, torch.tensor([[2, 0, 2]]))  # right, padding, wrong
    metric.update(scores, torch.tensor([[2, 0, 0]]))  # right, padding, padding
    assert isinstance(metric._count, torch.Tensor)  # never read to the host while updating
    assert float(metric.compute()) == pytest.approx(2 / 3)
    assert repr(metric) == "Accuracy(ignore_index=0)" and repr(Accuracy()) == "Accuracy()"
    metric.reset()
    metric.update(scores, torch.zeros(1, 3, dtype=torch.int64))  # all padding: no value
    assert math.isnan(float(metric.compute()))
    with pytest.raises(FitforgeTypeError, match="Accuracy: ignore_index must be an int label value or None, got 0.5"):
        Accuracy(ignore_index=0.5)


def test_a_tensor_count_moves_with_the_metric():
    metric = Accuracy(ignore_index=-1)
    metric.update(torch.tensor([[0.1, 0.9]]), torch.tensor([1]))
    assert metric.to("cpu")._count.device.type == "cpu" and float(metric.compute()) == 1.0


def test_the_default_accuracy_ignores_what_the_loss_ignores():
    (padded,) = default_metrics(nn.CrossEntropyLoss(ignore_index=0))
    assert padded.ignore_index == 0
    (plain,) = default_metrics(nn.CrossEntropyLoss())
    assert plain.ignore_index == -100  # torch's default: labels of -100 are padding for the loss too
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.1, 0.9], [0.1, 0.9]])
    plain.update(scores, torch.tensor([1, 0, -100, -100]))
    assert float(plain.compute()) == 1.0


def test_ignore_index_does_not_apply_to_one_hot_labels():
    metric = Accuracy(ignore_index=0)
    metric.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert float(metric.compute()) == 1.0  # both samples count, class 0 included


def test_accuracy_checks_shapes_on_the_first_batch_after_each_reset():
    metric = Accuracy()
    metric.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    assert metric._kind == "scores"
    metric.reset()
    with pytest.raises(
        FitforgeValueError,
        match=re.escape("pred of shape (4,) (after argmax over dim 1) does not match label of shape (4, 1)"),
    ):
        metric.update(torch.randn(4, 3), torch.tensor([[0], [1], [2], [0]]))


def test_accuracy_update_does_not_detach_yet_records_no_graph():
    pred = torch.randn(4, 3, requires_grad=True)
    metric = Accuracy(ignore_index=-100)
    metric.update(pred, torch.tensor([0, 1, -100, 0]))
    assert not metric._sum.requires_grad and metric._sum.grad_fn is None
    assert float(metric.compute()) == pytest.approx(
        float((pred.argmax(1)[[0, 1, 3]] == torch.tensor([0, 1, 0])).float().mean())
    )


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


def test_accuracy_with_integer_one_hot_labels_and_one_dimensional_scores():
    metric = Accuracy()
    metric.update(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]), F.one_hot(torch.tensor([0, 1]), 3))
    assert metric.compute().item() == 1.0
    with pytest.raises(FitforgeValueError, match="no class axis.*'binary_accuracy'"):
        Accuracy().update(torch.tensor([2.3, -1.0, 0.7]), torch.tensor([1, 0, 1]))
    exact = Accuracy()  # integer class predictions are compared as they are
    exact.update(torch.tensor([1, 0, 2]), torch.tensor([1, 1, 2]))
    assert exact.compute().item() == pytest.approx(2 / 3)


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
