"""The bad-input battery: every mistake in the data, the model or the configuration that fitforge
checks must fail before the first optimizer step, with its own error and message, and leave the
weights bitwise unchanged and the optimizer without state. The figure is how many of the cases are
rejected so (``FIGURES["bad_inputs"]``, printed at the end of the run)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torchmetrics
from torch import nn

from figures import FIGURES
from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.exceptions import (
    BatchFormatError,
    DeviceMismatchError,
    FitforgeValueError,
    ForwardError,
    LossInputError,
    NonFiniteInputError,
)
from fitforge.handlers import MetricHandler


def batches(n=3, size=8, features=5, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, features, generator=g), torch.randint(0, classes, (size,), generator=g)) for _ in range(n)
    ]


def mlp(features=5, hidden=8, classes=3):
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def estimator(net=None, loss=None, **kwargs):
    net = net if net is not None else mlp()
    return Estimator(
        net,
        loss if loss is not None else nn.CrossEntropyLoss(),
        optimizer=torch.optim.Adam(net.parameters()),
        device="cpu",
        **kwargs,
    )


def regression(net=None, loss=None):
    return estimator(net if net is not None else nn.Linear(5, 1), loss if loss is not None else nn.MSELoss())


def nonfinite(data, value, in_labels=False):
    """``data`` whose first batch holds ``value`` twice, in its data or in its (float) labels."""
    x, y = data[0]
    x, y = x.clone(), y.float().view(-1, 1) if in_labels else y
    (y.view(-1) if in_labels else x.view(-1))[:2] = value
    return [(x, y)] + data[1:]


def changed(data, inputs=lambda x: x, labels=lambda y: y):
    return [(inputs(x), labels(y)) for x, y in data]


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.ones(8)  # a plain attribute: the net's .to(...) does not move it

    def forward(self, x):
        return x * self.scale


class DictOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return {"logits": self.fc(x)}


class NoBatchSize(BatchProcessor):
    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        return BatchOutput(out.data, out.label, out.pred, out.loss, out.losses)


def fit(data, **kwargs):
    return lambda est: est.fit(data, epochs=1, **kwargs)


def moved_net():
    est = estimator()
    est.net[2].to("meta")  # after the Estimator placed the net
    return est, fit(batches())


def stray_attribute():
    est = estimator(nn.Sequential(nn.Linear(5, 8), Scale(), nn.Linear(8, 3)))
    est.net[1].scale = torch.ones(8, device="meta")  # as if the net had moved to a GPU without it
    return est, fit(batches())


@dataclass
class Case:
    """``make()`` returns an estimator and the call on it that must raise ``error`` matching ``match``."""

    name: str
    error: type[Exception]
    match: str
    make: Callable[[], tuple[Estimator, Callable[[Estimator], object]]]


CASES = [
    # the batch
    Case(
        "dict batch",
        BatchFormatError,
        "got a dict batch with keys",
        lambda: (estimator(), fit([{"x": x, "y": y} for x, y in batches()])),
    ),
    Case(
        "batch not a pair",
        BatchFormatError,
        r"a batch must be a \(data, label\) pair or data alone, got a tuple of 3",
        lambda: (estimator(), fit([(x, x, y) for x, y in batches()])),
    ),
    Case(
        "0-d label",
        FitforgeValueError,
        "the label of the first batch is a 0-d tensor",
        lambda: (estimator(), fit([(torch.randn(5), torch.tensor(1))] * 2)),
    ),
    Case(
        "nan in the data",
        NonFiniteInputError,
        r"data: 2 nan and 0 inf of 40 values.*torch\.nan_to_num",
        lambda: (estimator(), fit(nonfinite(batches(), float("nan")))),
    ),
    Case(
        "inf in the labels",
        NonFiniteInputError,
        "label: 0 nan and 2 inf of 8 values",
        lambda: (regression(), fit(nonfinite(batches(), float("inf"), in_labels=True))),
    ),
    # the labels the loss needs
    Case(
        "label shape MSELoss would broadcast",
        LossInputError,
        r"pred has shape \(8, 1\) and label \(8,\), which",
        lambda: (regression(), fit(changed(batches(), labels=lambda y: y.float()))),
    ),
    Case(
        "integer targets for MSELoss",
        LossInputError,
        r"\(MSELoss\) needs a floating-point label.*label\.float\(\)",
        lambda: (regression(), fit(changed(batches(), labels=lambda y: y.view(-1, 1)))),
    ),
    Case(
        "integer targets for BCEWithLogitsLoss",
        LossInputError,
        r"\(BCEWithLogitsLoss\) needs a floating-point",
        lambda: (regression(loss=nn.BCEWithLogitsLoss()), fit(changed(batches(), labels=lambda y: y.view(-1, 1)))),
    ),
    Case(
        "class labels out of range",
        LossInputError,
        "labels go up to 5 but the net outputs 3 class scores",
        lambda: (estimator(), fit(changed(batches(), labels=lambda y: y + 3))),
    ),
    Case(
        "float labels for CrossEntropyLoss",
        LossInputError,
        r"class-index labels must be int64 .*label\.long\(\)",
        lambda: (estimator(), fit(changed(batches(), labels=lambda y: y.float()))),
    ),
    Case(
        "int32 labels for CrossEntropyLoss",
        LossInputError,
        r"must be int64, got int32: use label\.long\(\)",
        lambda: (estimator(), fit(changed(batches(), labels=lambda y: y.int()))),
    ),
    # counts, outputs and the loss
    Case(
        "label count differs from loss count",
        LossInputError,
        r"the net returned 1 output\(s\), 1 loss\(es\) are configured and the batch has 2 label\(s\)",
        lambda: (estimator(), fit(changed(batches(), labels=lambda y: (y, y)))),
    ),
    Case(
        "net returning a non-tensor",
        LossInputError,
        "output 0 of the net is dict",
        lambda: (estimator(DictOutput()), fit(batches())),
    ),
    Case(
        "non-scalar loss",
        LossInputError,
        r"the loss must be a scalar tensor, got shape \(8,\)",
        lambda: (estimator(loss=nn.CrossEntropyLoss(reduction="none")), fit(batches())),
    ),
    Case(
        "loss without grad",
        LossInputError,
        "the loss does not require grad",
        lambda: (estimator(loss=lambda p, y: nn.functional.cross_entropy(p.detach(), y)), fit(batches())),
    ),
    Case(
        "BatchOutput without batch_size",
        FitforgeValueError,
        r"fit_batch returned BatchOutput\(batch_size=0\)",
        lambda: (estimator(batch_processor=NoBatchSize()), fit(batches())),
    ),
    # metrics
    Case(
        "failing metric",
        FitforgeValueError,
        r"metric 'top5_accuracy' \(TopKAccuracy\) failed on pred",
        lambda: (estimator(train_metrics="top5_accuracy"), fit(batches())),
    ),
    Case(
        "failing MetricHandler metric",
        FitforgeValueError,
        r"metric 'mse' \(MeanSquaredError\) failed on pred",
        lambda: (estimator(), fit(batches(), event_handlers=[MetricHandler("mse")])),
    ),
    Case(
        "failing torchmetrics metric",
        FitforgeValueError,
        r"metric 'f1' \(BinaryF1Score\) failed on pred",
        lambda: (estimator(train_metrics={"f1": torchmetrics.F1Score("binary")}), fit(batches())),
    ),
    Case(
        "failing validation metric",
        FitforgeValueError,
        "the first batch of val_data cannot be evaluated: metric 'top5_accuracy'",
        lambda: (estimator(val_metrics="top5_accuracy"), fit(batches(), val_data=batches(seed=1))),
    ),
    # the model
    Case(
        "net moved off the estimator's device",
        DeviceMismatchError,
        r"parameter '2\.weight' of net is on the meta device, which holds no values: load the net's weights first",
        moved_net,
    ),
    Case(
        "tensor attribute on another device",
        DeviceMismatchError,
        r"in layer '1' \(Scale\(\)\).*attribute 'scale' is a plain tensor on meta.*register_buffer",
        stray_attribute,
    ),
    Case(
        "data with too few features",
        ForwardError,
        "the data has 32 features but layer '0' expects 64: give it in_features=32",
        lambda: (estimator(mlp(features=64)), fit(batches(features=32))),
    ),
    Case(
        "hidden layer of the wrong size",
        ForwardError,
        "layer '2' expects 8 features but receives 16 from the layers before it",
        lambda: (estimator(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(8, 3))), fit(batches())),
    ),
    Case(
        "image with the wrong channel count",
        ForwardError,
        "the data has 1 channels but layer '0' expects 3: give it in_channels=1",
        lambda: (
            estimator(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 3))),
            fit(changed(batches(), inputs=lambda x: torch.randn(8, 1, 4, 4))),
        ),
    ),
    Case(
        "float64 data for a float32 net",
        ForwardError,
        "its weights are float32 but it received float64",
        lambda: (estimator(), fit(changed(batches(), inputs=lambda x: x.double()))),
    ),
    Case(
        "validation data with the wrong feature count",
        ForwardError,
        "the first batch of val_data cannot be evaluated: the net failed on the first batch in layer '0'",
        lambda: (estimator(), fit(batches(), val_data=batches(features=4))),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_bad_input_is_rejected_before_the_first_step(case):
    FIGURES["bad_inputs"][case.name] = False
    est, call = case.make()
    before = {k: v.detach().clone() for k, v in est.net.named_parameters() if v.device.type != "meta"}
    with pytest.raises(case.error, match=case.match):
        call(est)
    now = dict(est.net.named_parameters())
    assert all(now[k].detach().equal(v) for k, v in before.items()), "the weights changed: a step happened"
    assert all(not opt.state for opt in est.optimizers), "the optimizer has state: a step happened"
    FIGURES["bad_inputs"][case.name] = True
