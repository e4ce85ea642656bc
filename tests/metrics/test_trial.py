"""The first batch's trial copy of a metric (fitforge.metrics.trial)."""

import re
import warnings

import pytest
import torch

from fitforge.exceptions import FitforgeValueError
from fitforge.metrics import Accuracy, SumCountMetric, builtin
from fitforge.metrics.trial import trial_copy, trial_update


def test_the_first_batch_trial_of_a_builtin_metric_leaves_its_running_state_alone():
    metric = Accuracy(ignore_index=-1)
    metric.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))  # 1 of 2 right
    trial = trial_copy(metric)
    trial.update(torch.tensor([[0.9, 0.1]]), torch.tensor([0]))
    assert trial.ignore_index == -1 and float(trial.compute()) == 1.0  # fresh: only its own batch
    assert float(metric.compute()) == 0.5 and metric._count == 2  # the original's sums untouched


def test_the_first_batch_trial_of_another_metric_is_a_deep_copy():
    class Buffered(SumCountMetric):  # a user's metric whose reset() empties a list in place
        def __init__(self):
            super().__init__()
            self.seen = []

        def reset(self):
            super().reset()
            self.seen.clear()

    metric = Buffered()
    metric.seen.append(1)
    trial_copy(metric).seen.append(2)
    assert metric.seen == [1]


def test_a_builtin_metric_is_tried_without_a_copy_and_its_sums_stay_untouched():
    metric = Accuracy()
    metric.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))  # 1 of 2 right
    pred = torch.tensor([[0.9, 0.1]], requires_grad=True)
    assert trial_update(metric, pred, torch.tensor([0]), torch.device("cpu")) is None  # one number by construction
    assert float(metric.compute()) == 0.5 and metric._count == 2


def test_a_builtin_metric_that_cannot_take_the_batch_raises_its_own_error():
    with pytest.raises(FitforgeValueError, match="does not match label of shape"):
        trial_update(Accuracy(), torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long), torch.device("cpu"))


def test_another_metric_is_tried_on_a_copy_returned_for_the_value_check():
    class Counting(SumCountMetric):
        def batch_stats(self, pred, label):
            return (pred == label).sum(), label.numel()

    metric = Counting()
    trial = trial_update(metric, torch.tensor([1, 2]), torch.tensor([1, 0]), torch.device("cpu"))
    assert trial is not metric and float(trial.compute()) == 0.5
    assert metric._sum is None  # the original untouched


def test_a_builtin_metric_is_tried_afresh_not_with_what_it_learned_from_the_last_run():
    metric = Accuracy()
    metric.update(torch.rand(4, 3), torch.eye(3)[[0, 1, 2, 0]])  # one-hot labels: it settles on that kind
    scores, classes = torch.rand(4, 3), torch.tensor([0, 1, 2, 0])  # the next run's class indices
    assert trial_update(metric, scores, classes, torch.device("cpu")) is None
    with pytest.raises(FitforgeValueError, match="does not match label"):  # and its shapes are checked
        trial_update(metric, scores, torch.tensor([0, 1]), torch.device("cpu"))


def test_is_builtin_takes_fitforge_s_classes_exactly():
    from fitforge.metrics import Accuracy, Mean
    from fitforge.metrics.builtin import is_builtin

    class Mine(Accuracy):
        pass

    assert is_builtin(Accuracy()) and is_builtin(Mean())
    assert not is_builtin(Mine()) and not is_builtin(object())


def _batches():
    """Pairs of pred and label of many shapes and dtypes, fitting and not."""
    dtypes = (torch.float32, torch.float16, torch.int64, torch.bool, torch.uint16, torch.float8_e4m3fn)
    shapes = ((4,), (4, 1), (4, 3), (4, 3, 2), (4, 2), (3,), (4, 6), (4, 0), (0, 3), (0,))
    for pred_shape in shapes:
        for label_shape in shapes:
            for pred_dtype in dtypes:
                for label_dtype in (torch.int64, torch.float32, torch.bool, torch.uint16):
                    yield torch.ones(pred_shape).to(pred_dtype), torch.zeros(label_shape).to(label_dtype)


BUILTINS = [
    lambda: Accuracy(),
    lambda: Accuracy(ignore_index=1),
    lambda: builtin.TopKAccuracy(2),
    lambda: builtin.BinaryAccuracy(),
    lambda: builtin.BinaryAccuracy(logits=True),
    lambda: builtin.BinaryAccuracy(threshold=None),
    lambda: builtin.BinaryAccuracy(threshold=2**63),
    lambda: Accuracy(ignore_index=-(2**63) - 1),
    lambda: builtin.MeanSquaredError(),
    lambda: builtin.RootMeanSquaredError(),
    lambda: builtin.MeanAbsoluteError(),
]


@pytest.mark.parametrize("make", BUILTINS, ids=lambda make: repr(make()))
def test_takes_batch_agrees_with_batch_stats_on_every_shape_and_dtype(make):
    # takes_batch reads metadata only; where it answers, batch_stats must agree: True means
    # batch_stats takes the batch, an error means batch_stats raises that same error.
    answered = 0
    for pred, label in _batches():
        try:
            said = builtin.takes_batch(make(), pred, label)
        except FitforgeValueError as error:
            with pytest.raises(FitforgeValueError, match=re.escape(str(error))):
                make().batch_stats(pred, label)
            answered += 1
            continue
        if said:
            make().batch_stats(pred, label)
            answered += 1
    metric = make()
    threshold, ignore_index = getattr(metric, "threshold", 0), getattr(metric, "ignore_index", 0)
    plain = threshold is not None and builtin._compares(threshold) and builtin._compares(ignore_index)
    assert answered > 100 or not plain  # most batches are answered by metadata


def test_takes_batch_leaves_the_rest_to_batch_stats():
    pred, label = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    assert builtin.takes_batch(Accuracy(), pred, label)
    assert not builtin.takes_batch(Accuracy(), pred.to("meta"), label)  # two devices: torch decides
    assert not builtin.takes_batch(Accuracy(), pred, label.tolist())  # not a tensor
    assert not builtin.takes_batch(Accuracy(), pred.to(torch.complex64), label)
    assert not builtin.takes_batch(builtin.TopKAccuracy(2), pred.bool(), label)  # topk of bools fails in torch
    assert not builtin.takes_batch(builtin.BinaryAccuracy(logits=True), label, label)  # sigmoid of ints fails
    assert not builtin.takes_batch(builtin.Mean(), pred, label)  # not a metric of a batch's pred and label
    assert not builtin.takes_batch(Accuracy(), pred, label.to(torch.uint16))  # uint16 does not promote
    assert not builtin.takes_batch(Accuracy(), torch.zeros(4, 0), label)  # no class to take the argmax of
    assert not builtin.takes_batch(builtin.BinaryAccuracy(threshold=None), pred, pred)
    assert not builtin.takes_batch(builtin.BinaryAccuracy(threshold=2**64), pred, pred)  # overflows in torch
    assert not builtin.takes_batch(Accuracy(ignore_index=2**63), pred, label)
    with warnings.catch_warnings():  # nested tensors are a prototype: torch says so
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(3, 3)])
    assert not builtin.takes_batch(builtin.MeanSquaredError(), nested, nested)  # no shape to read


def test_a_builtin_metric_answered_by_its_shapes_is_left_untouched():
    metric = Accuracy(ignore_index=-100)
    assert trial_update(metric, torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), torch.device("cpu")) is None
    assert metric._kind is None and metric._sum is None


def test_a_metric_failing_on_a_dtype_metadata_cannot_judge_fails_before_the_first_step():
    # uint16 labels (16-bit masks) pass every shape check, but accuracy's comparison cannot promote
    # them: the trial must still run the metric's operations and fail before the optimizer step.
    from fitforge import Estimator

    torch.manual_seed(0)
    net = torch.nn.Linear(5, 3)
    before = net.weight.detach().clone()
    data = [(torch.randn(8, 5), torch.randint(0, 3, (8,)).to(torch.uint16)) for _ in range(3)]
    est = Estimator(
        net,
        lambda p, y: torch.nn.functional.cross_entropy(p, y.long()),
        train_metrics="accuracy",
        optimizer=torch.optim.Adam(net.parameters()),
        device="cpu",
    )
    with pytest.raises(FitforgeValueError, match="metric 'accuracy' .* uint16"):
        est.fit(data, epochs=1)
    assert torch.equal(net.weight, before)
