"""Fine-tuning in phases on one estimator: freeze, fit the head, unfreeze, lower the rate, fit again.
The backbone changes in the second fit only, and the epochs and history continue across the fits."""

import logging
import warnings

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.handlers import LambdaHandler
from helpers import regression_batches


def backbone_and_head():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(1, 8), nn.Tanh()), nn.Linear(8, 1))


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


@pytest.mark.parametrize("optimizer", ["over every parameter", "adam", None])
def test_freeze_fit_unfreeze_set_lr_fit_trains_the_backbone_in_the_second_fit_only(optimizer, caplog):
    net = backbone_and_head()
    backbone, head = net[0], net[1]
    backbone.requires_grad_(False)
    if optimizer == "over every parameter":
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizer, device="cpu")
    epochs = []
    numbered = LambdaHandler(epoch_end=lambda state: epochs.append(state.run.epochs_before + state.epoch + 1))
    weights = [(flat(backbone), flat(head))]
    with caplog.at_level(logging.WARNING, logger="fitforge"), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        first = estimator.fit(regression_batches(), epochs=2, event_handlers=[numbered])
        weights.append((flat(backbone), flat(head)))
        backbone.requires_grad_(True)
        estimator.set_lr(1e-4)
        second = estimator.fit(regression_batches(), epochs=3, event_handlers=[numbered])
        weights.append((flat(backbone), flat(head)))
    assert [str(w.message).split(":")[0] for w in warned] == (["fit"] if optimizer is None else [])  # the default's
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []  # every parameter is in the optimizer
    assert torch.equal(weights[0][0], weights[1][0]) and not torch.equal(weights[1][0], weights[2][0])
    assert not torch.equal(weights[0][1], weights[1][1]) and not torch.equal(weights[1][1], weights[2][1])
    assert epochs == [1, 2, 3, 4, 5]  # numbered across the fits
    assert (first.epochs, second.epochs, estimator.history.epochs) == (2, 3, 5)
    assert estimator.history["train_loss"] == first["train_loss"] + second["train_loss"]
    assert estimator.history["lr"][2:] == [1e-4] * 3 and estimator.history["lr"][0] != 1e-4


def test_the_trainable_only_idiom_warns_and_add_param_group_then_set_lr_fixes_it(caplog):
    net = backbone_and_head()
    backbone = net[0]
    backbone.requires_grad_(False)
    trainable = [p for p in net.parameters() if p.requires_grad]
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adam(trainable, lr=1e-2), device="cpu")
    estimator.fit(regression_batches(), epochs=1)
    backbone.requires_grad_(True)
    before = flat(backbone)
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(regression_batches(), epochs=1)
    assert torch.equal(before, flat(backbone))  # what the issue saw: nothing trained it...
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "0.0.weight, 0.0.bias" in warned[0]  # ...but now it is named
    estimator.optimizer.add_param_group({"params": estimator.net[0].parameters()})
    estimator.set_lr(1e-4)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(regression_batches(), epochs=1)
    assert not torch.equal(before, flat(backbone)) and caplog.records == []
    assert [g["lr"] for g in estimator.optimizer.param_groups] == [1e-4, 1e-4] and estimator.history.epochs == 3
