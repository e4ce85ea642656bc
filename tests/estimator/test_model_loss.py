"""Models that compute their own loss (``Estimator(loss=None)``), the label and output keys of dict
batches and outputs, and the errors that point to them."""

import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from fitforge import BatchProcessor, Estimator
from fitforge.exceptions import BatchFormatError, FitforgeTypeError, FitforgeValueError, LossInputError


@dataclass
class Output:
    """A ModelOutput-like object: the loss and the logits as attributes."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class Classifier(nn.Module):
    """Takes keyword inputs and, given ``labels``, returns its own cross-entropy loss."""

    def __init__(self, as_dict=False):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.as_dict = as_dict

    def forward(self, features, mask=None, labels=None):
        logits = self.linear(features if mask is None else features * mask)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits} if self.as_dict else Output(loss, logits)


def dict_batches(n=4, key="labels"):
    torch.manual_seed(0)
    data = []
    for _ in range(n):
        x = torch.randn(8, 4)
        data.append({"features": x, "mask": torch.ones(8, 4), key: (x[:, 0] > 0).long() + (x[:, 1] > 0).long()})
    return data


def make(net, processor=None, **kwargs):
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    return Estimator(net, None, optimizer=optimizer, device="cpu", batch_processor=processor, **kwargs)


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_model_that_computes_its_loss_trains_on_it(as_dict):
    net = Classifier(as_dict)
    estimator = make(net, train_metrics="accuracy")
    data = dict_batches()
    history = estimator.fit(data, val_data=data, epochs=15, default_handlers=True)
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert history.last("val_accuracy") > 0.8  # the metric read the logits
    # val_loss is the model's own loss over the data, as computed by hand
    with torch.no_grad():
        outputs = [net(b["features"], b["mask"], b["labels"]) for b in data]
        expected = sum(float(o["loss"] if as_dict else o.loss) for o in outputs) / len(data)
    assert history.last("val_loss") == pytest.approx(expected, rel=1e-5)


def test_predict_returns_the_logits_and_drops_the_label():
    net = Classifier()
    estimator = make(net)
    out = estimator.predict(dict_batches(2))
    assert out.shape == (16, 3)
    batch = dict_batches(1)[0]
    with torch.no_grad():
        assert torch.allclose(out[:8], net(batch["features"], batch["mask"]).logits)


def test_evaluate_reports_the_models_loss():
    estimator = make(Classifier(as_dict=True))
    result = estimator.evaluate(dict_batches(2))
    assert set(result) == {"val_loss"} and result["val_loss"] > 0


class PairModel(nn.Module):
    """``net(x, y)``: a model that takes the label positionally and returns its loss in a dict."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x, y=None):
        pred = self.linear(x)
        return {"loss": None if y is None else nn.functional.mse_loss(pred, y), "logits": pred}


def test_a_pair_batch_passes_the_label_last():
    torch.manual_seed(0)
    x = torch.randn(32, 2)
    data = [(x[i : i + 8], x[i : i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    estimator = make(PairModel(), train_metrics="mse")
    before = estimator.evaluate(data)
    estimator.fit(data, epochs=30, default_handlers=False)
    after = estimator.evaluate(data)
    assert after["val_loss"] < 0.1 * before["val_loss"] and set(after) == {"val_loss", "val_mse"}
    assert estimator.predict([x]).shape == (32, 1)


def test_the_label_key_is_configurable():
    data = dict_batches(2, key="target")
    with pytest.raises(BatchFormatError, match=re.escape("put the label under 'labels' or 'label'")):
        make(Classifier()).fit(data, epochs=1)
    net = nn.Sequential(nn.Linear(4, 3))

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, features, mask):
            return self.net(features * mask)

    processor = BatchProcessor(label_key="target")
    estimator = Estimator(Wrapped(), nn.CrossEntropyLoss(), optimizer="adam", device="cpu", batch_processor=processor)
    history = estimator.fit(data, epochs=1)
    assert "train_accuracy" in history
    assert estimator.predict(data).shape == (16, 3)  # the "target" key is dropped in predict


def test_an_output_key_feeds_a_given_loss():
    processor = BatchProcessor(output_key="logits")
    estimator = Estimator(
        Classifier(), nn.CrossEntropyLoss(), optimizer="adam", device="cpu", batch_processor=processor
    )
    data = [{"features": b["features"], "labels": b["labels"]} for b in dict_batches(2)]
    # the model is not given labels (the loss takes them), so its own loss is None and unused
    assert "train_loss" in estimator.fit(data, epochs=1)


def test_a_model_output_given_to_a_loss_points_to_loss_none():
    estimator = Estimator(Classifier(as_dict=True), nn.CrossEntropyLoss(), optimizer="adam", device="cpu")
    data = [{"features": b["features"], "labels": b["labels"]} for b in dict_batches(1)]
    with pytest.raises(LossInputError, match=r"it holds loss, logits: use Estimator\(loss=None\).*output_key='logits'"):
        estimator.fit(data, epochs=1)


def test_loss_none_with_a_tensor_output_is_explained():
    net = nn.Linear(4, 3)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return self.net(x)

    with pytest.raises(LossInputError, match=r"loss=None\) trains on the loss the model computes.*returned shape"):
        make(Plain()).fit(data, epochs=1)


def test_a_model_output_without_loss_is_explained():
    estimator = make(Classifier(), BatchProcessor(label_key="target"))
    data = dict_batches(1)  # no "target": data alone, and "labels" goes to forward, which computes its loss
    assert len(estimator.fit(data, epochs=1)["train_loss"]) == 1

    class NoLoss(Classifier):
        def forward(self, features, mask=None, labels=None):
            return Output(None, self.linear(features))

    with pytest.raises(LossInputError, match=r"has no loss: did forward get the label\?.*put the label under 'labels'"):
        make(NoLoss()).fit(dict_batches(1), epochs=1)


def test_a_missing_output_key_is_explained():
    estimator = make(Classifier(as_dict=True), BatchProcessor(output_key="scores"))
    with pytest.raises(FitforgeValueError, match=r"a dict \(keys: loss, logits\) without 'scores'.*output_key"):
        estimator.fit(dict_batches(1), epochs=1)


def test_loss_none_refuses_a_val_loss_or_weights():
    with pytest.raises(FitforgeValueError, match="so val_loss cannot be given with it"):
        make(Classifier(), val_loss=nn.CrossEntropyLoss())
    with pytest.raises(FitforgeValueError, match="so loss_weights cannot be given with it"):
        make(Classifier(), loss_weights=[1.0])


@pytest.mark.parametrize("name", ["label_key", "output_key"])
def test_keys_must_be_strings(name):
    with pytest.raises(FitforgeTypeError, match=f"BatchProcessor: {name} must be a non-empty str or None, got int 3"):
        BatchProcessor(**{name: 3})


def test_the_models_own_loss_and_its_logits_read_nothing_to_the_host_per_batch():
    from fitforge.testing import HostReadCounter

    def reads(batches):
        net = Classifier()  # SGD: Adam reads its step count (a CPU tensor) every step
        estimator = Estimator(net, None, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), train_metrics="accuracy")
        data = dict_batches(batches)
        with HostReadCounter() as counter:
            estimator.fit(data, val_data=data[:2], epochs=1)
        return counter.count

    assert reads(4) == reads(32)  # the reads are per epoch (means at epoch end, first-batch checks), never per batch


def test_an_unpack_of_its_own_gets_the_label_back_under_labels():
    class Nested(BatchProcessor):
        def unpack(self, batch):
            features, label = batch
            return features, label

    data = [({"features": b["features"]}, b["labels"]) for b in dict_batches(2)]
    history = make(Classifier(), Nested()).fit(data, epochs=1)
    assert len(history["train_loss"]) == 1  # Classifier got labels=...: no "no label" error


def test_loss_none_with_a_net_that_cannot_take_the_label_is_explained():
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    with pytest.raises(BatchFormatError, match=r"with loss=None the net computes its own loss.*Give a loss function"):
        make(nn.Linear(4, 3)).fit(data, epochs=1)


def test_lr_find_steps_only_the_optimizers_a_batch_chooses():
    class TwoParts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)

        def forward(self, x):
            return self.a(x) + self.b(x)

    class OnlyA(BatchProcessor):
        def fit_batch(self, state, batch):
            out = super().fit_batch(state, batch)
            out.step = [0]
            return out

    net = TwoParts()
    estimator = Estimator(
        net, nn.MSELoss(), device="cpu", batch_processor=OnlyA(),
        optimizer=[torch.optim.SGD(net.a.parameters(), lr=0.1), torch.optim.SGD(net.b.parameters(), lr=0.1)],
    )  # fmt: skip
    steps = []
    estimator.optimizers[1].register_step_post_hook(lambda *_: steps.append(1))
    estimator.optimizers[0].register_step_post_hook(lambda *_: steps.append(0))
    estimator.lr_find([(torch.randn(8, 2), torch.randn(8, 1))], num_steps=5)
    assert steps and set(steps) == {0}
