"""FaultTolerantStrategy's arguments and its step handler's arithmetic (the groups' weighted gradients and
vetoes in one all-reduce, a commit or a cancel); tests/fault_tolerance/test_replica_groups.py runs it for real."""

import socket
import types

import pytest
import torch
from torch import nn

from fitforge.core.clock import RunClock
from fitforge.exceptions import CancelBatch, FitforgeTypeError, FitforgeValueError
from fitforge.fault_tolerance import FaultTolerantStrategy, QuorumStepHandler, Share, StepVetoed
from fitforge.handlers import LRSchedulerHandler


def test_the_lighthouse_and_the_replica_id_come_from_the_arguments_or_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "7")
    strategy = FaultTolerantStrategy()
    assert (strategy.lighthouse, strategy.replica_id) == ("http://lighthouse:29510", "fitforge_0007")
    assert FaultTolerantStrategy(lighthouse="http://a:1", replica_id="east").replica_id == "east"
    assert FaultTolerantStrategy(replica_id=12).replica_id == "fitforge_0012"  # ids sort as the ints do
    assert "replica_id='fitforge_0012'" in repr(FaultTolerantStrategy(replica_id=12))


def test_the_address_the_others_reach_a_group_at_follows_the_lighthouse_s():
    assert FaultTolerantStrategy(lighthouse="http://127.0.0.1:29510", replica_id=0).host == "127.0.0.1"
    assert FaultTolerantStrategy(lighthouse="http://head-node:29510", replica_id=0).host == socket.gethostname()
    assert FaultTolerantStrategy(lighthouse="http://head-node:29510", replica_id=0, host="10.0.0.7").host == "10.0.0.7"


def test_a_missing_lighthouse_or_replica_id_and_bad_numbers_are_refused(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(FitforgeValueError, match="torchft_lighthouse --min_replicas 2"):
        FaultTolerantStrategy(replica_id=0)
    with pytest.raises(FitforgeValueError, match="REPLICA_GROUP_ID"):
        FaultTolerantStrategy(lighthouse="http://a:1")
    with pytest.raises(FitforgeTypeError, match="min_replicas must be an int >= 1"):
        FaultTolerantStrategy(lighthouse="http://a:1", replica_id=0, min_replicas=0)
    with pytest.raises(FitforgeValueError, match="timeout must be a positive number of seconds"):
        FaultTolerantStrategy(lighthouse="http://a:1", replica_id=0, timeout=0)


class Manager:
    """torchft's Manager as the handler uses it; the other groups' parts of the sum are ``others``."""

    def __init__(self, groups: int, others: torch.Tensor, commits: bool = True) -> None:
        self.groups, self.others, self.commits, self.errors = groups, others, commits, []

    def allreduce(self, tensor):  # an average over the groups, as torchft's default
        tensor.add_(self.others).div_(self.groups)
        return types.SimpleNamespace(wait=lambda: None)

    def report_error(self, error):
        self.errors.append(error)

    def should_commit(self):
        return self.commits and not self.errors


def step(manager: Manager, share: Share, grad: torch.Tensor, veto: str | None = None):
    strategy = FaultTolerantStrategy(lighthouse="http://a:1", replica_id=0)
    strategy.manager, strategy.batches = manager, types.SimpleNamespace(share=share)
    net = nn.Linear(2, 1, bias=False).double()
    net.weight.grad = grad.clone()
    if veto:
        strategy.veto_step(veto)
    handler = QuorumStepHandler(strategy)
    state = types.SimpleNamespace(estimator=types.SimpleNamespace(net=net), run=types.SimpleNamespace(clock=RunClock()))
    handler.batch_end(state)
    return net.weight.grad, handler


def test_the_gradient_is_the_sum_of_the_groups_gradients_weighted_by_their_shares():
    share = Share(step=4, indices=[0, 1, 2], weight=0.75, groups=2, rank=0)  # 3 of the step's 4 samples
    others = torch.tensor([0.25 * 2 * 8.0, 0.25 * 2 * 4.0, 0.0], dtype=torch.float64)  # the other group's 1 sample
    grad, handler = step(Manager(2, others), share, torch.tensor([[4.0, 0.0]], dtype=torch.float64))
    assert grad.tolist() == [[0.75 * 4.0 + 0.25 * 8.0, 0.25 * 4.0]]
    assert handler.changes == [(4, 2)]


def test_a_veto_of_any_group_cancels_the_step_on_every_group():
    share = Share(step=4, indices=[0], weight=0.5, groups=2, rank=0)
    vetoed_elsewhere = torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64)  # the other group's veto, scaled by 2
    manager = Manager(2, vetoed_elsewhere)
    with pytest.raises(CancelBatch):
        step(manager, share, torch.ones(1, 2, dtype=torch.float64))
    assert isinstance(manager.errors[0], StepVetoed)
    manager = Manager(2, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(CancelBatch):
        step(manager, share, torch.ones(1, 2, dtype=torch.float64), veto="bad gradients")
    assert "bad gradients" in str(manager.errors[0])
    with pytest.raises(CancelBatch):  # a commit the quorum refused (a lost group)
        step(
            Manager(2, torch.zeros(3, dtype=torch.float64), commits=False), share, torch.ones(1, 2, dtype=torch.float64)
        )


def test_a_non_finite_sum_is_vetoed_on_every_group_and_a_late_veto_is_refused():
    share = Share(step=4, indices=[0], weight=0.5, groups=2, rank=0)
    manager = Manager(2, torch.tensor([float("nan"), 0.0, 0.0], dtype=torch.float64))  # another group's NaN
    with pytest.raises(CancelBatch):
        step(manager, share, torch.ones(1, 2, dtype=torch.float64))
    assert "not finite" in str(manager.errors[0])
    strategy = FaultTolerantStrategy(lighthouse="http://a:1", replica_id=0)
    strategy.decided = True  # the step's commit is decided: a veto now would land on the next step
    with pytest.raises(FitforgeValueError, match="below Stage.STEP - 1"):
        strategy.veto_step("too late")


def test_failed_commits_past_max_retries_say_why_the_last_one_failed(caplog):
    class Refusing(Manager):
        def should_commit(self):
            raise RuntimeError("should_commit failed 11 times consecutively, exceeding max_retries=10")

    share = Share(step=9, indices=[0], weight=1.0, groups=1, rank=0)  # a lighthouse with --min_replicas 1
    with pytest.raises(StepVetoed, match="max_retries=10 times in a row, the last time because the quorum holds 1"):
        step(Refusing(1, torch.zeros(3, dtype=torch.float64)), share, torch.ones(1, 2, dtype=torch.float64))


def test_a_handler_monitoring_a_training_value_is_refused_before_the_first_quorum(monkeypatch):
    net = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = LRSchedulerHandler(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), monitor="train_loss")
    strategy = FaultTolerantStrategy(lighthouse="http://a:1", replica_id=0)
    state = types.SimpleNamespace(
        services=types.SimpleNamespace(steps=None), _loop=types.SimpleNamespace(handlers=[plateau])
    )
    with pytest.raises(FitforgeValueError, match="monitors 'train_loss'.*monitor a validation value"):
        strategy.join(state)


def test_an_empty_replica_id_is_refused(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "")
    with pytest.raises(FitforgeValueError, match="REPLICA_GROUP_ID"):
        FaultTolerantStrategy(lighthouse="http://a:1")
