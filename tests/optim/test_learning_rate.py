"""Estimator.set_lr: every parameter group's lr (and the initial_lr schedulers read), per group or
per optimizer, checked before anything changes."""

import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, StepLR

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import LRSchedulerHandler
from helpers import regression_batches


def groups_estimator():
    net = nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD([{"params": net[0].parameters(), "lr": 0.01}, {"params": net[1].parameters()}], lr=0.1)
    return Estimator(net, nn.MSELoss(), optimizer=optimizer, device="cpu")


def two_optimizers():
    net = nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 1))
    optimizers = [torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.Adam(net[1].parameters(), lr=0.01)]
    return Estimator(net, nn.MSELoss(), optimizer=optimizers, device="cpu")


def rates(estimator):
    return [[group["lr"] for group in optimizer.param_groups] for optimizer in estimator.optimizers]


def test_a_number_sets_every_group_of_every_optimizer():
    estimator = groups_estimator()
    estimator.set_lr(1e-3)
    assert rates(estimator) == [[1e-3, 1e-3]]
    estimator = two_optimizers()
    estimator.set_lr(0)  # a rate of 0 is a rate (torch accepts it)
    assert rates(estimator) == [[0.0], [0.0]]


def test_a_list_sets_one_rate_per_group_and_an_optimizer_is_chosen_by_index_or_object():
    estimator = groups_estimator()
    estimator.set_lr([1e-5, np.float32(1e-4)])
    assert rates(estimator) == [[1e-5, pytest.approx(1e-4)]]
    estimator = two_optimizers()
    estimator.set_lr(0.5, optimizer=1)
    assert rates(estimator) == [[0.1], [0.5]]
    estimator.set_lr([0.25], optimizer=estimator.optimizers[0])
    assert rates(estimator) == [[0.25], [0.5]]


def test_a_tensor_rate_is_filled_in_place():
    net = nn.Linear(1, 1)
    estimator = Estimator(
        net, nn.MSELoss(), optimizer=torch.optim.Adam(net.parameters(), lr=torch.tensor(0.01)), device="cpu"
    )
    tensor = estimator.optimizer.param_groups[0]["lr"]
    estimator.set_lr(1e-4)
    assert estimator.optimizer.param_groups[0]["lr"] is tensor and tensor.item() == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("lr", "optimizer", "error", "message"),
    [
        (-1e-3, None, FitforgeValueError, "set_lr: lr must be a finite number >= 0, got -0.001"),
        (float("nan"), None, FitforgeValueError, "set_lr: lr must be a finite number >= 0, got nan"),
        (float("inf"), None, FitforgeValueError, "set_lr: lr must be a finite number >= 0, got inf"),
        ("1e-3", None, FitforgeTypeError, "set_lr: lr must be a number >= 0 (or a list of them, one per parameter "),
        (True, None, FitforgeTypeError, "set_lr: lr must be a number >= 0"),
        ([1e-3, -1.0], None, FitforgeValueError, "set_lr: lr[1] must be a finite number >= 0, got -1.0"),
        ([1e-3, None], None, FitforgeTypeError, "set_lr: lr[1] must be a number >= 0"),
        ([1e-3], None, FitforgeValueError, "lr has 1 learning rates, but the optimizer has 2 parameter group(s)"),
        (1e-3, 1, FitforgeValueError, "set_lr: optimizer=1, but the estimator has 1 optimizer(s) (indices 0 to 0)"),
        (1e-3, "sgd", FitforgeTypeError, "set_lr: optimizer must be None (every optimizer), an index"),
        (1e-3, torch.optim.SGD([nn.Parameter(torch.ones(1))]), FitforgeValueError, "is not one of the estimator's"),
    ],
)
def test_bad_values_are_named_and_nothing_changes(lr, optimizer, error, message):
    estimator = groups_estimator()
    with pytest.raises(error, match=re.escape(message)):
        estimator.set_lr(lr, optimizer=optimizer)
    assert rates(estimator) == [[0.01, 0.1]]  # checked before any group changes


def test_a_list_with_several_optimizers_needs_the_optimizer_named():
    with pytest.raises(FitforgeValueError, match=r"has 2 optimizers; pass optimizer=<index> too"):
        two_optimizers().set_lr([1e-3])


def test_a_scheduler_built_afterwards_starts_from_the_new_rate():
    estimator = groups_estimator()
    LambdaLR(estimator.optimizer, lambda step: 1.0)  # an earlier phase's: it recorded initial_lr 0.01 and 0.1
    estimator.set_lr([1e-4, 1e-3])
    assert [g["initial_lr"] for g in estimator.optimizer.param_groups] == [1e-4, 1e-3]
    warmup = LambdaLR(estimator.optimizer, lambda step: 0.5)  # would start from 0.01 and 0.1 otherwise
    assert warmup.base_lrs == [1e-4, 1e-3] and rates(estimator) == [[5e-5, 5e-4]]


def test_after_a_one_cycle_phase_the_next_fit_trains_at_the_rate_set():
    net = nn.Linear(1, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    estimator.fit(regression_batches(), epochs=2, event_handlers=[LRSchedulerHandler.one_cycle(max_lr=0.1)])
    assert estimator.optimizer.param_groups[0]["lr"] < 1e-5  # a one-cycle phase ends near 0
    estimator.set_lr(0.02)
    step = StepLR(estimator.optimizer, step_size=1, gamma=0.5)
    history = estimator.fit(regression_batches(), epochs=2, event_handlers=[LRSchedulerHandler(step)])
    assert history["lr"] == [0.01, 0.005] and estimator.history["lr"][2:] == [0.01, 0.005]
