"""Named outputs: a net returning a dict of heads, with losses, weights and metrics keyed by output
name (Keras's ``loss={"cls": ..., "reg": ...}``); and positional multi-output metric names."""

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.exceptions import BatchFormatError, FitforgeTypeError, FitforgeValueError, LossInputError, MonitorKeyError
from fitforge.handlers import EarlyStoppingHandler, MetricHandler
from fitforge.metrics import MeanAbsoluteError
from fitforge.testing import HostReadCounter
from helpers import TIME_KEYS

LOSSES = {"cls": nn.CrossEntropyLoss(), "reg": nn.MSELoss()}


class Heads(nn.Module):
    """A shared body, a 3-class head and a regression head, returned by name."""

    def __init__(self, names=("cls", "reg")):
        super().__init__()
        self.names = names
        self.body = nn.Linear(5, 8)
        self.cls, self.reg = nn.Linear(8, 3), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return dict(zip(self.names, (self.cls(h), self.reg(h))))


def data(n_batches=4, batch_size=8, seed=0):
    """``(x, {"cls": class, "reg": target})`` batches: the class and the target follow from x."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        x = torch.randn(batch_size, 5, generator=g)
        batches.append((x, {"cls": x[:, :3].argmax(1), "reg": x[:, 3:4] - x[:, 4:5]}))
    return batches


def estimator(net=None, loss=None, **kwargs):
    net = net or Heads()
    kwargs.setdefault("optimizer", torch.optim.Adam(net.parameters(), lr=0.02))
    return Estimator(net, dict(LOSSES) if loss is None else loss, device="cpu", **kwargs)


def weights_of(net):
    return {name: value.clone() for name, value in net.state_dict().items()}


def unchanged(net, before):
    return all(torch.equal(before[name], value) for name, value in net.state_dict().items())


# -- training with named losses, weights and metrics ------------------------------------------------------
def test_two_heads_trained_by_name():
    net = Heads()
    est = estimator(net, loss_weights={"cls": 1.0, "reg": 0.5}, train_metrics={"cls": ["accuracy"], "reg": ["mae"]})
    history = est.fit(data(), val_data=data(seed=1), epochs=4)
    assert list(history.keys()) == [
        "epoch_time",
        "lr",
        *TIME_KEYS,
        "time_validation_s",
        "train_loss",
        "train_cls_loss",
        "train_reg_loss",
        "train_cls_accuracy",
        "train_reg_mae",
        "train_samples_per_s",
        "val_loss",
        "val_cls_loss",
        "val_reg_loss",
        "val_cls_accuracy",
        "val_reg_mae",
    ]
    for key in ("train_cls_loss", "train_reg_loss"):  # both heads learn
        assert history[key][-1] < history[key][0], history[key]
    # train_loss and val_loss are the weighted totals of the per-output means (sample means are linear)
    for prefix in ("train_", "val_"):
        for epoch in range(4):
            total = history[prefix + "cls_loss"][epoch] + 0.5 * history[prefix + "reg_loss"][epoch]
            assert history[prefix + "loss"][epoch] == pytest.approx(total, rel=1e-5)


def test_each_loss_and_metric_reads_its_own_output_and_label():
    est = estimator(train_metrics={"cls": "accuracy", "reg": "mae"})
    val = data(seed=1)
    result = est.evaluate(val)
    with torch.no_grad():
        outputs = [est.net(x) for x, _ in val]
    cls = torch.cat([o["cls"] for o in outputs])
    reg = torch.cat([o["reg"] for o in outputs])
    y_cls = torch.cat([y["cls"] for _, y in val])
    y_reg = torch.cat([y["reg"] for _, y in val])
    assert result["val_cls_loss"] == pytest.approx(nn.functional.cross_entropy(cls, y_cls).item(), rel=1e-5)
    assert result["val_reg_loss"] == pytest.approx(nn.functional.mse_loss(reg, y_reg).item(), rel=1e-5)
    assert result["val_cls_accuracy"] == pytest.approx((cls.argmax(1) == y_cls).float().mean().item())
    assert result["val_reg_mae"] == pytest.approx((reg - y_reg).abs().mean().item(), rel=1e-5)
    assert result["val_loss"] == pytest.approx(result["val_cls_loss"] + result["val_reg_loss"], rel=1e-5)


def test_a_weight_left_out_weighs_one():
    est = estimator(loss_weights={"reg": 2.0}, train_metrics={})
    result = est.evaluate(data())
    assert result["val_loss"] == pytest.approx(result["val_cls_loss"] + 2.0 * result["val_reg_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "metrics,keys",
    [
        (None, ["cls_accuracy", "reg_mae"]),  # each output gets its own loss's default
        ({"cls": "top2_accuracy"}, ["cls_top2_accuracy"]),
        ({"reg": MeanAbsoluteError()}, ["reg_mae"]),
        ({"cls": ["accuracy", "top2_acc"], "reg": []}, ["cls_accuracy", "cls_top2_accuracy"]),
        ({"cls": {"hit": "accuracy"}, "reg": {"err": "mae", "sq": "mse"}}, ["cls_hit", "reg_err", "reg_sq"]),
        ({}, []),
    ],
)
def test_metric_forms_per_output(metrics, keys):
    est = estimator(train_metrics=metrics)
    assert est.history_keys() == ["train_loss", "train_cls_loss", "train_reg_loss", *("train_" + k for k in keys)] + [
        "train_samples_per_s",
        "lr",
        "epoch_time",
        *TIME_KEYS,
    ]
    assert set(est.fit(data(2), val_data=data(1), epochs=1)) >= {"val_" + k for k in keys}


def test_one_named_output_records_its_loss_by_name():
    net = Heads()
    est = Estimator(net, {"reg": nn.MSELoss()}, optimizer="sgd", device="cpu")
    history = est.fit(data(2), epochs=1)
    assert {"train_loss", "train_reg_loss", "train_reg_mae"} <= set(history)
    assert history["train_loss"] == pytest.approx(history["train_reg_loss"])


def test_named_val_loss_and_val_metrics():
    est = estimator(
        val_loss={"cls": nn.CrossEntropyLoss(), "reg": nn.L1Loss()},
        val_metrics={"reg": {"err": "mse"}},
    )
    history = est.fit(data(2), val_data=data(1), epochs=1)
    assert {"val_cls_loss", "val_reg_loss", "val_reg_err"} <= set(history)
    assert "val_cls_accuracy" not in history


def test_a_metric_handler_of_named_metrics():
    est = estimator(train_metrics={})
    history = est.fit(data(2), epochs=1, event_handlers=[MetricHandler({"cls": {"acc": "accuracy"}})])
    assert "train_cls_acc" in history


def test_no_host_read_per_batch_with_named_outputs():
    def reads(batches):
        net = Heads()
        est = estimator(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))  # Adam on CPU reads its step
        with HostReadCounter() as counter:
            est.fit(data(batches), val_data=data(1), epochs=1)
        return counter.count

    assert reads(2) == reads(8) > 0


# -- mistakes: at the first batch, before any step --------------------------------------------------------
class Renamed(BatchProcessor):
    """Returns the net's outputs under other names, to feed metrics an output without their key."""

    def fit_batch(self, state, batch):
        output = super().fit_batch(state, batch)
        output.pred = {"cls": output.pred["cls"]}
        return output


@pytest.mark.parametrize(
    "setup,error,message",
    [
        (
            dict(net=Heads(("cls", "value"))),
            LossInputError,
            "loss names the output(s) 'reg', which the net's output lacks: its keys are 'cls', 'value'",
        ),
        (
            dict(loss={"cls": nn.CrossEntropyLoss(), "rg": nn.MSELoss()}, loss_weights={"rg": 0.5}),
            LossInputError,
            "loss names the output(s) 'rg', which the net's output lacks: its keys are 'cls', 'reg'",
        ),
        (
            dict(loss={"cls": nn.CrossEntropyLoss(), "rg": nn.MSELoss()}, train_metrics={"rg": "mae"}),
            LossInputError,
            "loss names the output(s) 'rg', which the net's output lacks: its keys are 'cls', 'reg'",
        ),
        (
            dict(batch_processor=Renamed()),
            FitforgeValueError,
            "metric 'reg_mae' (MeanAbsoluteError) reads the item 'reg' of the net's output, which has none: "
            "it holds 'cls'",
        ),
    ],
)
def test_a_name_the_output_lacks_fails_before_any_step(setup, error, message):
    net = setup.pop("net", None) or Heads()
    est = estimator(net, **setup)
    before = weights_of(net)
    with pytest.raises(error, match=re.escape(message)):
        est.fit(data(), epochs=1)
    assert unchanged(net, before)
    assert not est.optimizer.state  # no step


def test_a_label_without_a_name_of_the_loss():
    batches = [(x, {"cls": y["cls"], "target": y["reg"]}) for x, y in data()]
    with pytest.raises(LossInputError, match=re.escape("which the batch's label lacks: its keys are 'cls', 'target'")):
        estimator().fit(batches, epochs=1)


def test_a_tuple_output_for_a_dict_loss():
    class Tuple(Heads):
        def forward(self, x):
            return tuple(super().forward(x).values())

    message = "loss is a dict by output name ('cls', 'reg'), so the net's output must be a dict holding those names"
    with pytest.raises(LossInputError, match=re.escape(message) + ".*return a dict of outputs from forward"):
        estimator(Tuple()).fit(data(), epochs=1)


def test_a_tuple_label_for_a_dict_loss():
    batches = [(x, (y["cls"], y["reg"])) for x, y in data()]
    message = "so the batch's label must be a dict holding those names, got tuple"
    with pytest.raises(LossInputError, match=re.escape(message) + r".*make it \(x, \{'cls': y_cls, 'reg': y_reg\}\)"):
        estimator().fit(batches, epochs=1)


def test_a_dict_label_for_a_positional_loss_says_how_to_name_outputs():
    batches = [(x, {"reg": y["reg"]}) for x, y in data()]
    net = nn.Linear(5, 1)
    est = Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu")
    with pytest.raises(LossInputError, match=re.escape("the label is a dict (keys: 'reg'): to give each output")):
        est.fit(batches, epochs=1)


def test_a_dict_output_for_a_positional_loss_says_how_to_name_outputs():
    est = Estimator(Heads(), nn.MSELoss(), optimizer="sgd", device="cpu")
    batches = [(x, y["reg"]) for x, y in data()]
    with pytest.raises(LossInputError, match=re.escape("or a dict loss={'cls': ..., 'reg': ...} to train each output")):
        est.fit(batches, epochs=1)


def test_several_labels_not_paired_show_the_working_forms():
    x, y_cls, y_reg = torch.randn(8, 5), torch.randint(0, 3, (8,)), torch.randn(8, 1)
    loader = DataLoader(TensorDataset(x, y_cls, y_reg), batch_size=4)
    with pytest.raises(BatchFormatError, match=re.escape("got a list of 3")) as info:
        estimator().fit(loader, epochs=1)
    assert "(x, (y1, y2))" in str(info.value) and "(x, {'cls': y1, 'reg': y2})" in str(info.value)


# -- mistakes: at construction ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "setup,error,message",
    [
        (
            dict(train_metrics={"cls": "accuracy", "rg": "mae"}),
            FitforgeValueError,
            "train_metrics names the output(s) 'rg', which loss does not: its outputs are 'cls', 'reg'",
        ),
        (
            dict(val_metrics={"value": "mae"}),
            FitforgeValueError,
            "val_metrics names the output(s) 'value', which loss does not: its outputs are 'cls', 'reg'",
        ),
        (
            dict(loss_weights={"cls": 1.0, "rg": 0.5}),
            FitforgeValueError,
            "loss_weights names the output(s) 'rg', which loss does not: its outputs are 'cls', 'reg'",
        ),
        (
            dict(loss_weights=[1.0, 0.5]),
            FitforgeTypeError,
            "loss_weights must be a dict of numbers by output name, as loss is (its outputs: 'cls', 'reg')",
        ),
        (
            dict(loss_weights={"cls": "1"}),
            FitforgeTypeError,
            "loss_weights must be a dict of numbers by output name",
        ),
        (
            dict(train_metrics="accuracy"),
            FitforgeTypeError,
            "train_metrics must be a dict by output name, as loss is (its outputs: 'cls', 'reg'), got str 'accuracy'",
        ),
        (
            dict(train_metrics={0: "accuracy"}),
            FitforgeValueError,
            "train_metrics names the output(s) 0, which loss does not",
        ),
        (
            dict(train_metrics={"cls": {"loss": "accuracy"}}),
            FitforgeValueError,
            "train_metrics: the metric name 'cls_loss' is the history name of a loss",
        ),
        (
            dict(val_loss=nn.MSELoss()),
            FitforgeTypeError,
            "loss and val_loss must match outputs alike, by name (both dicts) or by position (neither)",
        ),
        (
            dict(loss={0: nn.MSELoss()}),
            FitforgeTypeError,
            "loss as a dict is keyed by the names of the net's outputs (non-empty strs), got the key(s) 0",
        ),
        (dict(loss={}), FitforgeValueError, "loss is an empty dict; give at least one loss"),
        (
            dict(loss={"cls": nn.CrossEntropyLoss, "reg": nn.MSELoss()}),
            FitforgeTypeError,
            "loss got the class CrossEntropyLoss; pass an instance",
        ),
    ],
)
def test_key_mismatches_known_at_construction(setup, error, message):
    with pytest.raises(error, match=re.escape(message)):
        estimator(**setup)


def test_dict_weights_for_positional_losses():
    with pytest.raises(FitforgeTypeError, match=re.escape("weighs outputs by name, but loss matches them by position")):
        Estimator(nn.Linear(5, 1), [nn.MSELoss(), nn.L1Loss()], loss_weights={"a": 1.0}, optimizer="sgd", device="cpu")


# -- monitors and predict ---------------------------------------------------------------------------------
def test_a_monitor_of_a_named_metric():
    stopper = EarlyStoppingHandler(monitor="val_cls_accuracy", patience=5)
    est = estimator()
    assert "val_cls_accuracy" in est.history_keys(validation=True)
    est.fit(data(2), val_data=data(1), epochs=2, event_handlers=[stopper])
    assert stopper._monitor.resolved_mode == "max"  # Accuracy.higher_is_better, found by the metric's name


def test_a_monitor_of_a_name_no_output_has():
    with pytest.raises(
        MonitorKeyError, match="monitors 'val_cls_acc', which this run will not produce.*val_cls_accuracy"
    ):
        estimator().fit(data(2), val_data=data(1), epochs=1, event_handlers=[EarlyStoppingHandler("val_cls_acc")])


def test_predict_returns_a_dict_of_concatenated_outputs():
    est = estimator()
    batches = data(3)
    pred = est.predict(batches)
    assert isinstance(pred, dict) and list(pred) == ["cls", "reg"]
    with torch.no_grad():
        expected = est.net(torch.cat([x for x, _ in batches]))
    assert pred["cls"].shape == (24, 3) and pred["reg"].shape == (24, 1)
    assert torch.allclose(pred["cls"], expected["cls"]) and torch.allclose(pred["reg"], expected["reg"])


def test_predict_with_a_custom_step_returning_named_outputs():
    class Halved(BatchProcessor):
        def predict_batch(self, state, batch):
            return {"half": state.estimator.net(batch[0])["reg"] / 2}

    est = estimator(batch_processor=Halved())
    assert est.predict(data(2))["half"].shape == (16, 1)


# -- positional outputs: names the user chose -------------------------------------------------------------
class TupleHeads(Heads):
    def forward(self, x):
        return tuple(super().forward(x).values())


def tuple_data(n=2):
    return [(x, (y["cls"], y["reg"])) for x, y in data(n)]


def positional(metrics):
    net = TupleHeads()
    return Estimator(net, [nn.CrossEntropyLoss(), nn.MSELoss()], train_metrics=metrics, optimizer="sgd", device="cpu")


def test_positional_metric_names_chosen_by_the_user_keep_no_index():
    est = positional({0: {"cls_acc": "accuracy"}, 1: ["mae"]})
    history = est.fit(tuple_data(), val_data=tuple_data(1), epochs=1)
    assert {"train_loss_0", "train_loss_1", "train_cls_acc", "train_mae_1", "val_cls_acc", "val_mae_1"} <= set(history)
    assert "train_cls_acc_0" not in history


def test_positional_metric_names_chosen_twice_get_their_index():
    est = positional({0: {"score": "accuracy"}, 1: {"score": "mae", "err": "mse"}})
    assert est.history_keys()[3:-6] == ["train_score_0", "train_score_1", "train_err"]


def test_a_dict_batch_with_a_dict_label():
    batches = [{"x": x, "labels": y} for x, y in data(2)]

    class Keyword(Heads):
        def forward(self, x):
            return super().forward(x)

    history = estimator(Keyword()).fit(batches, epochs=1)
    assert {"train_cls_loss", "train_reg_loss"} <= set(history)


def test_batch_output_with_a_dict_label_of_one_sample_is_refused():
    class OneSample(BatchProcessor):
        def fit_batch(self, state, batch):
            output = super().fit_batch(state, batch)
            return BatchOutput(output.data, {"cls": torch.tensor(1)}, output.pred, output.loss, output.losses, 8)

    with pytest.raises(FitforgeValueError, match="the label of the first batch is a 0-d tensor"):
        estimator(batch_processor=OneSample(), train_metrics={}).fit(data(), epochs=1)
