"""run_params: a run's hyperparameters as plain values, read at train_begin; check_params and
last_values, the helpers the loggers share."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from fitforge import Estimator, History
from fitforge.exceptions import FitforgeTypeError
from fitforge.handlers import LambdaHandler
from fitforge.reporting.hparams import check_params, last_values, run_params
from fitforge.testing import linear_data, linear_problem


def params_of(estimator, train, **fit_kwargs):
    seen = []
    fit_kwargs.setdefault("epochs", 1)
    estimator.fit(train, event_handlers=[LambdaHandler(train_begin=lambda s: seen.append(run_params(s)))], **fit_kwargs)
    return seen[0]


def test_the_params_of_a_simple_run():
    estimator, train, _ = linear_problem(lr=0.05)
    params = params_of(estimator, train, epochs=2)
    assert params == {
        "model": "Linear",
        "parameters": 2,
        "trainable_parameters": 2,
        "loss": "MSELoss",
        "optimizer": "SGD",
        "lr": 0.05,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "batch_size": train.batch_size,
        "epochs": 2,
        "precision": "32-true",
        "device": "cpu",
        "strategy": "auto",
        "world_size": 1,
    }
    assert all(type(value) in (str, int, float, bool) for value in params.values())


def test_several_optimizers_betas_and_batches():
    net = nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 1))
    net[0].requires_grad_(False)
    optimizers = [
        torch.optim.Adam(net[1].parameters(), lr=torch.tensor(0.01), betas=(0.8, 0.95), weight_decay=0.1),
        torch.optim.SGD(net[0].parameters(), lr=0.5, momentum=0.9),
    ]
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizers, device="cpu", precision="bf16-mixed")
    params = params_of(estimator, linear_data(), epochs=None, batches=3)
    assert params["optimizer"] == "Adam" and params["optimizer_1"] == "SGD"
    assert params["lr"] == pytest.approx(0.01) and type(params["lr"]) is float  # a tensor lr, as a float
    assert (params["beta1"], params["beta2"], params["weight_decay"]) == pytest.approx((0.8, 0.95, 0.1))
    assert (params["lr_1"], params["momentum_1"]) == (0.5, 0.9) and "beta1_1" not in params
    assert (params["parameters"], params["trainable_parameters"]) == (13, 5)
    assert params["batches"] == 3 and "epochs" not in params
    assert params["precision"] == "bf16-mixed"


def test_batch_size_of_a_batch_sampler_and_none_for_other_data():
    data = TensorDataset(torch.rand(12, 1), torch.rand(12, 1))
    estimator, _, _ = linear_problem()
    sampler = BatchSampler(SequentialSampler(data), batch_size=3, drop_last=False)
    assert params_of(estimator, DataLoader(data, batch_sampler=sampler))["batch_size"] == 3
    batches = [(torch.rand(4, 1), torch.rand(4, 1))] * 2  # a list of batches: not known
    assert "batch_size" not in params_of(estimator, batches)


def test_loss_names():
    def mse(pred, label):
        return ((pred - label) ** 2).mean()

    estimator, train, _ = linear_problem()
    estimator.loss = mse
    assert params_of(estimator, train)["loss"] == "mse"
    estimator.loss = [nn.MSELoss(), mse]
    assert params_of(estimator, train)["loss"] == "MSELoss,mse"
    estimator.loss = None  # the model computes its own loss: nothing to say
    state = SimpleNamespace(estimator=estimator, run=SimpleNamespace(max_epochs=1, max_batches=None), _loop=None)
    assert "loss" not in run_params(state) and "batch_size" not in run_params(state)  # no fit: no data


def test_check_params():
    assert check_params("MLflowHandler", None) == {}
    assert check_params("MLflowHandler", {"seed": 3, "note": "x", "scale": 0.5, "flag": True}) == {
        "seed": 3,
        "note": "x",
        "scale": 0.5,
        "flag": True,
    }
    with pytest.raises(FitforgeTypeError, match=r"MLflowHandler: params must be a dict of str to .*, got list"):
        check_params("MLflowHandler", [("a", 1)])
    with pytest.raises(FitforgeTypeError, match=r"got str 'a': NoneType None"):
        check_params("MLflowHandler", {"a": None})
    with pytest.raises(FitforgeTypeError, match=r"got int 1: int 2"):
        check_params("MLflowHandler", {1: 2})


def test_last_values_skip_nan_and_empty_keys():
    history = History()
    for epoch, (loss, val) in enumerate([(3.0, math.nan), (2.0, 1.5), (1.0, math.nan)]):
        history.new_epoch()
        history.record("train_loss", loss)
        history.record("val_loss", val)
        if epoch == 0:
            history.record("never", math.inf)
    assert last_values(history) == {"train_loss": 1.0, "val_loss": 1.5}


def test_a_run_config_is_recorded_as_flat_params():
    estimator, train, _ = linear_problem()
    estimator.run_config = {
        "seed": 0,
        "model": {"class_path": "torch.nn.Linear", "init_args": {"in_features": 1, "bias": True}},
        "handlers": [{"class_path": "x.H", "init_args": {}}],
        "fit": {"epochs": 1, "batches": None, "lrs": [0.1, 0.2], "empty": []},
    }
    params = params_of(estimator, train)
    config = {key: value for key, value in params.items() if key.startswith("config.")}
    assert config == {
        "config.seed": 0,
        "config.model.class_path": "torch.nn.Linear",
        "config.model.init_args.in_features": 1,
        "config.model.init_args.bias": True,
        "config.handlers.0.class_path": "x.H",
        "config.handlers.0.init_args": "{}",
        "config.fit.epochs": 1,
        "config.fit.batches": "null",
        "config.fit.lrs.0": 0.1,
        "config.fit.lrs.1": 0.2,
        "config.fit.empty": "[]",
    }
    assert params["model"] == "Linear"  # the run's own params stay
