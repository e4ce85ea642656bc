"""Default metrics (inferred from the loss) are left out, with an info line, when the step returns
no label (a GAN); a metric asked for that cannot do without one is a clear error before any step."""

import logging
import re

import pytest
import torch
from torch import nn

from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers import CheckpointHandler, MetricHandler
from fitforge.metrics import SumCountMetric
from helpers import TIME_KEYS, Crash

g = torch.Generator().manual_seed(0)
BINARY = [(torch.randn(8, 2, generator=g), torch.randint(0, 2, (8, 1), generator=g).float()) for _ in range(3)]
CLASSES = [(torch.randn(8, 2, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]


class NoLabel(BatchProcessor):
    """Computes the loss as usual but returns no label, as a GAN step would."""

    def __init__(self, fit=True, evaluate=True):
        super().__init__()
        self.fit, self.evaluate = fit, evaluate

    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        return BatchOutput(out.data, None, out.pred, out.loss, out.losses, out.batch_size) if self.fit else out

    def evaluate_batch(self, state, batch):
        out = super().evaluate_batch(state, batch)
        return BatchOutput(out.data, None, out.pred, out.loss, out.losses, out.batch_size) if self.evaluate else out


def estimator(loss, outputs, **kwargs):
    torch.manual_seed(0)
    net = nn.Linear(2, outputs)
    return Estimator(net, loss, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("loss", "outputs", "data", "name", "kind"),
    [
        (nn.BCEWithLogitsLoss(), 1, BINARY, "binary_accuracy", "BinaryAccuracy"),
        (nn.CrossEntropyLoss(), 3, CLASSES, "accuracy", "Accuracy"),
    ],
    ids=["BCEWithLogitsLoss", "CrossEntropyLoss"],
)
def test_a_default_metric_is_left_out_when_the_step_returns_no_label(caplog, loss, outputs, data, name, kind):
    est = estimator(loss, outputs, batch_processor=NoLabel())
    assert [s.name for s in est.train_metrics] == [name] and est.train_metrics[0].inferred
    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = est.fit(data, val_data=data, epochs=2)
    assert set(history) == {
        "train_loss",
        "train_samples_per_s",
        "val_loss",
        "lr",
        "epoch_time",
        *TIME_KEYS,
        "time_validation_s",
    }
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert left_out == [  # validation's first batch is checked before training's
        f"the default metric {name!r} ({kind}, inferred from the loss) is left out of {phase}: the step "
        "returns no label (BatchOutput(label=None))"
        for phase in ("validation", "training")
    ]
    assert est.train_metrics == [] and est.val_metrics == []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fitforge"):
        est.fit(data, val_data=data, epochs=1)  # once left out, no more lines
    assert not [r for r in caplog.records if "left out" in r.getMessage()]


def test_a_default_left_out_gets_no_csv_column(tmp_path):
    from fitforge.handlers.csv_logger import CSVLoggerHandler

    est = estimator(nn.BCEWithLogitsLoss(), 1, batch_processor=NoLabel())
    est.fit(BINARY, epochs=1, event_handlers=[CSVLoggerHandler(tmp_path / "log.csv")])
    assert (tmp_path / "log.csv").read_text().splitlines()[
        0
    ] == "epoch,epoch_time,lr,time_step_s,time_data_s,time_handlers_s,train_loss,train_samples_per_s"


def test_a_default_metric_that_cannot_take_the_first_label_is_left_out(caplog):
    # CrossEntropyLoss takes probability labels of the scores' shape; let the default accuracy not
    class Smoothed(BatchProcessor):
        def fit_batch(self, state, batch):
            out = super().fit_batch(state, batch)
            return BatchOutput(out.data, out.label[:, :1], out.pred, out.loss, out.losses, out.batch_size)

    est = estimator(nn.CrossEntropyLoss(), 3, batch_processor=Smoothed())
    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = est.fit([(x, torch.softmax(torch.randn(8, 3), 1)) for x, _ in CLASSES], epochs=1)
    assert "train_accuracy" not in history
    assert any("it cannot take the label" in r.getMessage() for r in caplog.records)


def test_evaluate_alone_leaves_the_default_out():
    est = estimator(nn.BCEWithLogitsLoss(), 1, batch_processor=NoLabel())
    assert set(est.evaluate(BINARY)) == {"val_loss"}


def test_only_the_phase_without_labels_loses_its_default():
    est = estimator(nn.BCEWithLogitsLoss(), 1, batch_processor=NoLabel(fit=False))
    history = est.fit(BINARY, val_data=BINARY, epochs=1)
    assert "train_binary_accuracy" in history and "val_binary_accuracy" not in history


def untouched(est, before):
    return all(torch.equal(a, b) for a, b in zip(est.net.state_dict().values(), before))


@pytest.mark.parametrize(
    ("kwargs", "processor", "message"),
    [
        (
            {"train_metrics": "binary_accuracy"},
            NoLabel(evaluate=False),
            "metric 'binary_accuracy' (BinaryAccuracy) needs a label, but the step (fit_batch) returned none "
            "(BatchOutput(label=None)) in batch 0: give the batches a label (data alone, a tensor or (x,), has "
            "none), return the label in the BatchOutput of a step of your own, or leave the metric out of "
            "train_metrics",
        ),
        (
            {"train_metrics": [], "val_metrics": "binary_accuracy"},
            NoLabel(fit=False),
            "the first batch of val_data cannot be evaluated: metric 'binary_accuracy' (BinaryAccuracy) needs a "
            "label, but the step (evaluate_batch) returned none (BatchOutput(label=None)) in batch 0",
        ),
    ],
    ids=["train", "validation"],
)
def test_a_metric_asked_for_is_a_clear_error_before_the_first_step(kwargs, processor, message):
    est = estimator(nn.BCEWithLogitsLoss(), 1, batch_processor=processor, **kwargs)
    before = [t.clone() for t in est.net.state_dict().values()]
    with pytest.raises(FitforgeValueError, match=re.escape(message)):
        est.fit(BINARY, val_data=BINARY, epochs=1)
    assert untouched(est, before)


def test_a_metric_handler_metric_names_its_argument():
    est = estimator(nn.BCEWithLogitsLoss(), 1, batch_processor=NoLabel())
    with pytest.raises(FitforgeValueError, match=r"leave the metric out of MetricHandler\(metrics=\.\.\.\)"):
        est.fit(BINARY, epochs=1, event_handlers=[MetricHandler("binary_accuracy")])


class MeanPrediction(SumCountMetric):
    """A metric of the predictions alone: it needs no label."""

    name = "mean_pred"

    def batch_stats(self, pred, label):
        return pred.sum(), pred.numel()


def test_a_metric_asked_for_that_needs_no_label_still_works():
    est = estimator(nn.BCEWithLogitsLoss(), 1, batch_processor=NoLabel(), train_metrics=MeanPrediction())
    assert "train_mean_pred" in est.fit(BINARY, epochs=1)


def test_a_resume_of_a_run_that_left_a_default_out_continues_exactly(tmp_path, caplog):
    def train(crash=None, resume=False, folder=tmp_path / "run"):
        est = estimator(nn.BCEWithLogitsLoss(), 1, batch_processor=NoLabel())
        handlers = [CheckpointHandler(folder, epoch_period=None, batch_period=1, resume_from_checkpoint=resume)]
        try:
            return est.fit(BINARY, epochs=2, event_handlers=handlers + ([Crash(crash)] if crash else []))
        except RuntimeError:
            return None

    whole = train(folder=tmp_path / "whole")
    assert train(crash=4) is None
    with caplog.at_level(logging.INFO, logger="fitforge"):
        resumed = train(resume=True)  # its checkpoint has no sums for the metric: it is left out again
    assert resumed["train_loss"] == whole["train_loss"] and "train_binary_accuracy" not in resumed
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("is left out of training" in r.getMessage() for r in caplog.records)
