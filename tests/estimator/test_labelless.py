"""Batches of data alone (a tensor, ``(x,)``, a dict without a label key): a net that computes its
own loss (``Estimator(loss=None)``) trains, evaluates and predicts on them; a given loss is refused
before any step, naming both ways that work."""

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.exceptions import BatchFormatError, FitforgeTypeError, FitforgeValueError, LossInputError
from fitforge.testing import HostReadCounter

torch.manual_seed(0)
X = torch.randn(96, 6) @ torch.randn(6, 6)  # correlated columns: a 3-wide code reconstructs most of them


class AutoEncoder(nn.Module):
    """Returns its reconstruction loss with the reconstruction, as a dict."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode = nn.Linear(6, 3), nn.Linear(3, 6)

    def forward(self, x):
        recon = self.decode(torch.relu(self.encode(x)))
        return {"loss": nn.functional.mse_loss(recon, x), "logits": recon}


class VAE(nn.Module):
    """A variational auto-encoder: its loss is the reconstruction error plus the KL term, drawn with
    the reparameterisation trick (the global RNG), returned as an attribute of its output."""

    class Output:
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits

    def __init__(self):
        super().__init__()
        self.encode, self.decode = nn.Linear(6, 4), nn.Linear(2, 6)

    def forward(self, x):
        mean, log_var = self.encode(x).chunk(2, dim=1)
        z = mean + torch.randn_like(mean) * (0.5 * log_var).exp() if self.training else mean
        recon = self.decode(z)
        kl = -0.5 * (1 + log_var - mean.pow(2) - log_var.exp()).sum(1).mean()
        return VAE.Output(nn.functional.mse_loss(recon, x, reduction="none").sum(1).mean() + 0.1 * kl, recon)


def own_loss(net, **kwargs):
    return Estimator(net, None, optimizer=torch.optim.Adam(net.parameters(), lr=0.02), device="cpu", **kwargs)


@pytest.mark.parametrize(
    "data, options",
    [
        (DataLoader(TensorDataset(X), batch_size=16, shuffle=True), {}),  # batches (x,)
        (X, {"batch_size": 16}),  # fit(X): arrays alone, batched and shuffled like (X, y)
        (DataLoader(X, batch_size=16), {}),  # batches of bare tensors
        ([{"x": X[i : i + 16]} for i in range(0, 96, 16)], {}),  # dict batches without a label key
    ],
    ids=["TensorDataset(X)", "fit(X)", "bare tensors", "dicts"],
)
def test_an_autoencoder_trains_on_data_alone(data, options):
    torch.manual_seed(0)
    estimator = own_loss(AutoEncoder())
    before = estimator.evaluate(X[:64], batch_size=32)["val_loss"]
    history = estimator.fit(data, val_data=X[:64], epochs=25, **options)
    assert history["train_loss"][-1] < 0.5 * history["train_loss"][0]
    assert history["val_loss"][-1] < 0.5 * before
    assert estimator.predict(X).shape == X.shape  # the output's "logits": the reconstruction


def test_a_vae_trains_on_its_own_loss_and_evaluates_on_the_same_data():
    torch.manual_seed(0)
    estimator = own_loss(VAE())
    history = estimator.fit(X, validation_split=0.25, epochs=20, batch_size=24)
    assert history["train_loss"][-1] < 0.7 * history["train_loss"][0]
    assert set(estimator.evaluate(X, batch_size=32)) == {"val_loss"}
    with torch.no_grad():
        expected = estimator.net.eval()(X).loss.item()
    assert estimator.evaluate(X, batch_size=96)["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_language_model_builds_its_labels_from_its_inputs():
    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

        def forward(self, input_ids, attention_mask):
            logits = self.head(self.embed(input_ids))
            labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)  # the next token
            return {"loss": nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels), "logits": logits}

    ids = torch.arange(10).repeat(8, 2)[:, :12] + 1  # counting sequences: the next token is learnable
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}] * 4
    history = own_loss(CausalLM()).fit(batches, epochs=10)
    assert history["train_loss"][-1] < 0.5 * history["train_loss"][0]


LABELLESS = "compares the net's output with a label, but the batches are data alone"
BOTH_WAYS = ("fit((X, X), batch_size=...)", "Estimator(net, loss=None)")


@pytest.mark.parametrize(
    "data",
    [X, DataLoader(TensorDataset(X), batch_size=16), [{"x": X[:16]}]],
    ids=["fit(X)", "TensorDataset(X)", "dict"],
)
def test_a_given_loss_refuses_data_alone_before_any_step(data):
    class Net(nn.Module):  # a dict batch's keys are forward's arguments
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(6, 6)

        def forward(self, x):
            return self.linear(x)

    net = Net()
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu")
    with pytest.raises(LossInputError, match=re.escape(LABELLESS)) as info:
        estimator.fit(data, epochs=1)
    assert all(way in str(info.value) for way in BOTH_WAYS)
    assert all(torch.equal(v, weights[k]) for k, v in net.state_dict().items())
    assert len(estimator.history) == 0
    assert isinstance(info.value, FitforgeValueError)


def test_validation_data_alone_with_a_given_loss_fails_before_training():
    net = nn.Linear(6, 6)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu")
    with pytest.raises(
        LossInputError, match="the first batch of val_data cannot be evaluated: .*" + re.escape(LABELLESS)
    ):
        estimator.fit((X, X), val_data=X[:32], epochs=1)
    assert all(torch.equal(v, weights[k]) for k, v in net.state_dict().items())
    with pytest.raises(LossInputError, match=re.escape(LABELLESS)):
        estimator.evaluate(X)
    assert estimator.predict(X).shape == X.shape  # predict needs no label


def test_a_metric_that_needs_a_label_names_the_batch():
    with pytest.raises(FitforgeValueError, match="metric 'mse'") as info:
        own_loss(AutoEncoder(), train_metrics="mse").fit(X, epochs=1)
    assert "label" in str(info.value)


def test_a_dict_without_a_label_whose_keys_forward_cannot_take_is_explained():
    estimator = own_loss(AutoEncoder())
    message = "got a dict batch with keys ['x', 'target'] and no label ('labels' or 'label'), so every key went"
    with pytest.raises(BatchFormatError, match=re.escape(message)):
        estimator.fit([{"x": X[:16], "target": X[:16]}], epochs=1)


def test_data_alone_reads_nothing_to_the_host_per_batch():
    def reads(batches):
        estimator = Estimator(AutoEncoder(), None, optimizer="sgd", device="cpu")
        with HostReadCounter() as counter:
            estimator.fit(DataLoader(TensorDataset(X[: batches * 4]), batch_size=4), epochs=1)
        return counter.count

    assert reads(3) == reads(24)


def test_validation_arrays_alone_of_as_many_rows_as_the_training_arrays_are_named():
    with pytest.raises(FitforgeTypeError, match=re.escape("val_data=DataLoader(X_val, batch_size=...)")):
        own_loss(AutoEncoder()).fit(X, X, epochs=1)
