"""Freezing and unfreezing between fits under DDP and FSDP, on a one-process gloo group: the DDP
wrapper fitforge made follows the parameters that train (DDP syncs those it was made with, and
only those), a user's wrapper that no longer fits is an error, and under FSDP the check compares
the shards the optimizers hold, also after an evaluation left a unit's parameters gathered."""

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fitforge import Estimator
from fitforge.distributed import ddp, fsdp, strategy
from fitforge.exceptions import FitforgeValueError
from helpers import regression_batches

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


def backbone_and_head():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


@pytest.fixture
def ddp_estimator(one_rank_group, monkeypatch):
    """An Estimator whose net fitforge wrapped in DDP (a world of 2 pretended while it wraps)."""

    def make(frozen):
        net = backbone_and_head()
        net[0].requires_grad_(not frozen)
        with monkeypatch.context() as patch:
            patch.setattr(strategy, "world_size", lambda: 2)
            estimator = Estimator(
                net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu", strategy="ddp"
            )
        assert isinstance(estimator.train_net, DistributedDataParallel)
        return estimator

    return make


def test_freezing_after_the_net_was_wrapped_wraps_it_again_so_ddp_does_not_wait_for_its_gradients(
    ddp_estimator, caplog
):
    estimator = ddp_estimator(frozen=False)
    first = estimator.train_net
    estimator.fit(regression_batches(), epochs=1, default_handlers=False)
    assert estimator.train_net is first  # nothing changed: the same wrapper
    estimator.net[0].requires_grad_(False)
    before = flat(estimator.net[0])
    with caplog.at_level(logging.INFO, logger="fitforge"):
        estimator.fit(regression_batches(), epochs=2, default_handlers=False)  # DDP's own would fail at batch 2
    assert estimator.train_net is not first and estimator.train_net.module is estimator.net
    assert torch.equal(before, flat(estimator.net[0]))
    (line,) = [r.getMessage() for r in caplog.records if "DistributedDataParallel anew" in r.getMessage()]
    assert line.startswith("2 parameter(s) were frozen or unfrozen since the net was prepared for several processes")
    assert "(0.weight, 0.bias)" in line


def test_unfreezing_after_the_net_was_wrapped_wraps_it_again_with_its_options(ddp_estimator):
    estimator = ddp_estimator(frozen=True)
    estimator.fit(regression_batches(), epochs=1, default_handlers=False)
    first, before = estimator.train_net, flat(estimator.net[0])
    estimator.net[0].requires_grad_(True)
    estimator.fit(regression_batches(), epochs=1, default_handlers=False)
    assert estimator.train_net is not first and not torch.equal(before, flat(estimator.net[0]))
    assert ddp._SYNCED[estimator.train_net] == (frozenset(id(p) for p in estimator.net.parameters()), {})


def test_a_net_frozen_whole_when_the_estimator_was_built_is_wrapped_by_the_first_fit_that_trains_it(
    one_rank_group, monkeypatch
):
    net = backbone_and_head().requires_grad_(False)
    with monkeypatch.context() as patch:
        patch.setattr(strategy, "world_size", lambda: 2)
        estimator = Estimator(net, nn.MSELoss(), device="cpu", strategy="ddp")  # evaluate-only: no optimizer
    assert estimator.train_net is net and estimator.optimizers == []
    estimator.evaluate(regression_batches())
    net[2].requires_grad_(True)  # the head
    before = flat(net[2])
    with pytest.warns(UserWarning, match="no optimizer given"):
        estimator.fit(regression_batches(), epochs=1, default_handlers=False)
    assert isinstance(estimator.train_net, DistributedDataParallel) and estimator.train_net.module is net
    assert not torch.equal(before, flat(net[2]))


def test_a_users_own_wrapper_that_no_longer_fits_is_an_error_naming_the_parameters(one_rank_group):
    net = backbone_and_head()
    net[0].requires_grad_(False)
    wrapper = DistributedDataParallel(net)
    estimator = Estimator(wrapper, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    estimator.fit(regression_batches(), epochs=1, default_handlers=False)
    net[0].requires_grad_(True)
    with pytest.raises(FitforgeValueError, match=r"and 2 changed since \(0\.weight, 0\.bias\): wrap the net again"):
        estimator.fit(regression_batches(), epochs=1, default_handlers=False)


needs_fsdp = pytest.mark.skipif(not fsdp.supported(), reason="needs FSDP2 (fully_shard)")


@needs_fsdp
def test_under_fsdp_gathered_parameters_left_by_an_evaluation_are_no_false_alarm_and_unfreezing_them_trains(
    one_rank_group, caplog
):
    net = backbone_and_head()
    net[0].requires_grad_(False)
    estimator = Estimator(
        net,
        nn.MSELoss(),
        optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
        device="cpu",
        strategy="fsdp",
        strategy_options={"reshard_after_forward": False},  # the units keep what a forward gathered
    )
    shards = estimator.optimizer.param_groups[0]["params"]
    held = {id(p) for p in shards}
    estimator.fit(regression_batches(), epochs=1, default_handlers=False)
    estimator.evaluate(regression_batches(2))
    assert {id(p) for p in net.parameters()} != held  # the gathered ones, not the optimizer's
    net[0].requires_grad_(True)  # set on the gathered parameters
    before = shards[0].detach().full_tensor().clone()  # net[0].weight's shard
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(regression_batches(), epochs=1, default_handlers=False)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not torch.equal(before, shards[0].detach().full_tensor())
