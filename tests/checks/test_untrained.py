"""Trainable parameters in no optimizer are named once per fit through the fitforge logger; frozen
ones outside the optimizer, and nets the optimizers cover, get no warning."""

import logging

import pytest
import torch
from torch import nn

from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.checks.untrained import untrained_names, warn_untrained
from helpers import regression_batches


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


def trainable(net):
    return [p for p in net.parameters() if p.requires_grad]


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "fitforge" and r.levelno == logging.WARNING]


def fit(estimator, epochs=1):
    return estimator.fit(regression_batches(), epochs=epochs, default_handlers=False)


def test_unfrozen_parameters_in_no_optimizer_are_named_with_their_count_and_the_fix_once_per_fit(caplog):
    torch.manual_seed(0)
    net = Net()
    net.backbone.requires_grad_(False)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adam(trainable(net)), device="cpu")
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(estimator)
        assert warnings_of(caplog) == []  # frozen and outside the optimizer: no mistake
        net.backbone.requires_grad_(True)
        fit(estimator, epochs=2)
    (record,) = warnings_of(caplog)  # once for the fit, not per epoch or batch
    message = record.getMessage()
    assert message.startswith(
        "fit: 4 trainable parameters of net (28 values) are in no optimizer, so training leaves them unchanged: "
        "backbone.0.weight, backbone.0.bias, backbone.2.weight, backbone.2.bias."
    )
    assert 'estimator.optimizer.add_param_group({"params": estimator.net.backbone.parameters()})' in message
    assert "estimator.set_lr(" in message and "torch.optim.Adam(net.parameters(), ...)" in message
    assert "requires_grad_(False)" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(estimator)
    assert len(warnings_of(caplog)) == 1  # every fit says it again


def test_the_suggested_fix_makes_the_warning_go_and_trains_the_backbone(caplog):
    torch.manual_seed(0)
    net = Net()
    net.backbone.requires_grad_(False)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adam(trainable(net)), device="cpu")
    net.backbone.requires_grad_(True)
    estimator.optimizer.add_param_group({"params": estimator.net.backbone.parameters()})
    before = net.backbone[0].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(estimator)
    assert warnings_of(caplog) == [] and not net.backbone[0].weight.equal(before)


def test_an_optimizer_over_every_parameter_covers_frozen_and_unfrozen_ones(caplog):
    net = Net()
    net.backbone.requires_grad_(False)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(estimator)
        net.backbone.requires_grad_(True)
        fit(estimator)
    assert warnings_of(caplog) == []


def test_several_optimizers_count_together_and_parameters_outside_the_net_are_ignored():
    net, outside = Net(), nn.Linear(2, 2)
    gan_like = [torch.optim.SGD(net.backbone.parameters(), lr=0.1), torch.optim.SGD(outside.parameters(), lr=0.1)]
    assert untrained_names(net, gan_like) == ["head.weight", "head.bias"]
    gan_like.append(torch.optim.SGD(net.head.parameters(), lr=0.1))
    assert untrained_names(net, gan_like) == []


class OwnLoss(nn.Module):
    """A model that computes its own loss from its labels (as a Hugging Face model does)."""

    def __init__(self):
        super().__init__()
        self.body, self.out = nn.Linear(1, 4), nn.Linear(4, 1)

    def forward(self, x, labels=None):
        pred = self.out(torch.tanh(self.body(x)))
        return {"loss": nn.functional.mse_loss(pred, labels), "logits": pred}


def test_a_model_that_computes_its_own_loss_is_checked_too(caplog):
    net = OwnLoss()
    net.body.requires_grad_(False)
    estimator = Estimator(net, None, optimizer=torch.optim.SGD(trainable(net), lr=0.1), device="cpu")
    net.body.requires_grad_(True)
    batches = [{"x": x, "labels": y} for x, y in regression_batches()]
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(batches, epochs=1, default_handlers=False)
    (record,) = warnings_of(caplog)
    assert "1 trainable parameter" not in record.getMessage()
    assert "2 trainable parameters of net (8 values) are in no optimizer" in record.getMessage()
    assert "body.weight, body.bias" in record.getMessage()


class Pair(BatchProcessor):
    """Two optimizers, each stepping part of the net (a GAN's generator and discriminator)."""

    def fit_batch(self, state, batch):
        x, y = batch
        pred = state.estimator.train_net(x)
        loss = nn.functional.mse_loss(pred, y)
        loss.backward()
        return BatchOutput((x,), y, pred, loss, (loss,), len(x))


def test_a_processor_with_several_optimizers_is_checked_over_their_union(caplog):
    net = Net()
    optimizers = [torch.optim.SGD(net.backbone.parameters(), lr=0.1), torch.optim.SGD(net.head.parameters(), lr=0.1)]
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizers, device="cpu", batch_processor=Pair())
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(estimator)
    assert warnings_of(caplog) == []
    estimator.optimizers[1].param_groups[0]["params"] = [net.head.weight]  # the bias left out
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(estimator)
    (record,) = warnings_of(caplog)
    assert "1 trainable parameter of net (1 value) is in no optimizer" in record.getMessage()
    # head.weight is held: no module to give, so the parameter by name
    assert "\"params\": [estimator.net.get_parameter(name) for name in ('head.bias',)]" in record.getMessage()
    assert "estimator.optimizers[i].add_param_group" in record.getMessage()


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 1)), "estimator.net[0].parameters()"),
        (lambda: nn.ModuleDict({"a-b": nn.Linear(1, 2), "c": nn.Linear(2, 1)}), "get_submodule('a-b')"),
    ],
)
def test_the_fix_names_the_module_that_holds_them(caplog, build, expected):
    net = build()
    first = next(iter(net.children()))
    held = [p for p in net.parameters() if all(p is not q for q in first.parameters())]
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        warn_untrained(net, [torch.optim.SGD(held, lr=0.1)])
    assert expected in warnings_of(caplog)[0].getMessage()


def test_many_names_are_cut_to_five_and_lazy_parameters_are_counted_as_tensors(caplog):
    net = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)], nn.LazyLinear(1))
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        warn_untrained(net, [torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)])
    message = warnings_of(caplog)[0].getMessage()
    assert "10 trainable parameters of net (8 values) are in no optimizer" in message  # the lazy ones: no size yet
    assert "0.weight, 0.bias, 1.weight, 1.bias, 2.weight and 5 more." in message
    assert '"params": estimator.net.parameters()' in message


def test_the_fix_for_a_digit_named_child_of_a_plain_module_is_runnable():
    from fitforge.checks.untrained import _parameters_of

    net = nn.Module()  # not indexable: the fix must not say net[0]
    net.add_module("0", nn.Linear(1, 1))
    fix = _parameters_of(net, ["0.weight", "0.bias"], set())
    assert fix == "estimator.net.get_submodule('0').parameters()"
    estimator = type("Holder", (), {"net": net})()
    assert len(list(eval(fix, {"estimator": estimator}))) == 2
