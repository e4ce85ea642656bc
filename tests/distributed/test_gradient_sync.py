"""In-process checks of gradient accumulation under DDP (fitforge.distributed.gradient_sync and
GradientUpdateHandler) on a one-rank gloo group: which batches' backwards all-reduce, the averaging
of a group that ends unsynced or is saved open, the flag given back, and the cases that sync every
batch. The ranks' results are compared under torchrun in test_accumulation.py."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from fitforge import Estimator
from fitforge.distributed import gradient_sync
from fitforge.distributed.gradient_sync import average_gradients, deferrable, synced_parameters
from fitforge.events import Event
from fitforge.exceptions import FitforgeTypeError
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler, LambdaHandler
from helpers import regression_batches

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


@pytest.fixture
def averages(monkeypatch):
    """The number of times a GradientSync averaged gradients over the ranks."""
    calls = []
    real = gradient_sync.average_gradients
    monkeypatch.setattr(gradient_sync, "average_gradients", lambda *args: calls.append(1) or real(*args))
    return calls


class Unsized:
    """Batches without ``len``: the epoch's last batch is known only once the data ran out."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def ddp_estimator(optimizers=1):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    wrapper = DistributedDataParallel(net)
    if optimizers == 1:
        optimizer = [torch.optim.SGD(net.parameters(), lr=0.1)]
    else:
        optimizer = [torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[2].parameters(), lr=0.1)]
    return Estimator(wrapper, nn.MSELoss(), optimizer=optimizer, device="cpu")


def count_allreduces(estimator):
    """A list that grows by one per bucket DDP all-reduces (a comm hook around the default one)."""
    calls = []

    def counting(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    estimator.train_net.register_comm_hook(None, counting)
    return calls


def syncs(estimator, data, handlers=(), **fit):
    """Whether each training batch's backward all-reduced (DDP's flag at its backward_end)."""
    seen = []
    record = LambdaHandler(backward_end=lambda state: seen.append(state.estimator.train_net.require_backward_grad_sync))
    estimator.fit(data, event_handlers=[*handlers, record], **{"epochs": 1, **fit})
    return seen


F, T = False, True


def test_only_the_batch_completing_a_group_or_the_epoch_all_reduces(one_rank_group):
    estimator = ddp_estimator()
    allreduces = count_allreduces(estimator)
    seen = syncs(estimator, regression_batches(7), [GradientUpdateHandler(accumulate=3)], epochs=2)
    assert seen == [F, F, T, F, F, T, T] * 2  # groups of 3, 3 and the epoch's trailing 1
    assert len(allreduces) == 6  # one per optimizer step
    assert estimator.train_net.require_backward_grad_sync  # given back for evaluate and later fits


def test_the_last_batch_of_batches_n_all_reduces(one_rank_group):
    seen = syncs(ddp_estimator(), regression_batches(7), [GradientUpdateHandler(accumulate=3)], epochs=None, batches=5)
    assert seen == [F, F, T, F, T]


def test_a_group_that_ends_unsynced_is_averaged_before_its_step(one_rank_group, averages):
    estimator = ddp_estimator()
    updater = GradientUpdateHandler(accumulate=3)
    seen = syncs(estimator, Unsized(regression_batches(7)), [updater], epochs=2)
    assert seen == [F, F, T, F, F, T, F] * 2  # the last batch of data without len is not known in advance
    assert len(averages) == 2  # once per epoch end, before the trailing group's step
    stopper = LambdaHandler(batch_end=lambda state: state.global_step == 4)  # mid-group: no batch foresaw it
    assert syncs(ddp_estimator(), regression_batches(7), [updater, stopper]) == [F, F, T, F, F]
    assert len(averages) == 3


def test_the_same_weights_as_syncing_every_batch(one_rank_group):
    weights = []
    for sync_each_batch in (False, True):
        estimator = ddp_estimator()
        updater = GradientUpdateHandler(accumulate=3, sync_each_batch=sync_each_batch)
        estimator.fit(Unsized(regression_batches(7)), epochs=2, event_handlers=[updater])
        weights.append([p.detach().clone() for p in estimator.net.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*weights))


def test_an_open_group_is_averaged_before_a_checkpoint_saves_it(one_rank_group, averages, tmp_path):
    estimator = ddp_estimator()
    saver = CheckpointHandler(tmp_path, batch_period=4, epoch_period=None)
    syncs(estimator, regression_batches(7), [GradientUpdateHandler(accumulate=3), saver])
    assert len(averages) == 1  # batch 4 ends one of 3 batches into the second group
    saved = torch.load(tmp_path / "model-epoch0batch4.pt", weights_only=True)
    assert saved["accumulated_batches"] == 1 and set(saved["grads"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_the_flag_is_given_back_when_training_fails_mid_group(one_rank_group):
    estimator = ddp_estimator()

    def fail(state):
        if state.global_step == 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        estimator.fit(
            regression_batches(7),
            epochs=1,
            event_handlers=[GradientUpdateHandler(accumulate=3), LambdaHandler(batch_end=fail)],
        )
    assert estimator.train_net.require_backward_grad_sync


def test_every_batch_syncs_when_asked_or_with_several_optimizers(one_rank_group):
    updater = GradientUpdateHandler(accumulate=3, sync_each_batch=True)
    assert Event.BATCH_BEGIN not in updater.handled_events
    assert syncs(ddp_estimator(), regression_batches(4), [updater]) == [T] * 4
    # A batch chooses the optimizers it steps after its forward: too late to skip the all-reduce.
    assert syncs(ddp_estimator(optimizers=2), regression_batches(4), [GradientUpdateHandler(accumulate=3)]) == [T] * 4


def test_the_default_path_adds_no_call_per_batch():
    estimator = Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd", device="cpu")
    loop = estimator.describe_loop()
    assert "batch_begin  (none)" in loop and "train_end    LoggingHandler(report) -> ManifestHandler(report)\n" in loop
    assert Event.BATCH_BEGIN not in GradientUpdateHandler().handled_events
    assert GradientUpdateHandler(accumulate=2).handled_events is None


def test_a_net_that_is_no_ddp_wrapper_or_has_sparse_gradients_syncs_as_ddp_does(one_rank_group):
    assert deferrable(nn.Linear(1, 1)) is None  # one process, or FSDP's fully_shard net
    assert deferrable(DistributedDataParallel(nn.Embedding(4, 2, sparse=True))) is None
    assert deferrable(DistributedDataParallel(nn.Embedding(4, 2))) is not None


def test_the_averaged_parameters_are_those_ddp_all_reduces(one_rank_group):
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    net[1].weight = net[0].weight  # tied: all-reduced once
    net[0].bias.requires_grad_(False)  # frozen: no gradient
    net._ddp_params_and_buffers_to_ignore = ["2.bias"]  # DDP leaves it alone
    params, sparse = synced_parameters(DistributedDataParallel(net))
    assert params == [net[0].weight, net[1].bias, net[2].weight] and not sparse


def test_averaging_keeps_a_missing_gradient_missing(one_rank_group):
    used, unused, half = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2).half())
    used.grad, half.grad = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]).half()
    average_gradients([used, unused, half], None)  # one rank: the mean is the gradient itself
    assert used.grad.tolist() == [1.0, 2.0] and unused.grad is None and half.grad.tolist() == [3.0, 4.0]
    average_gradients([], None)


def test_sync_each_batch_must_be_a_bool():
    with pytest.raises(FitforgeTypeError, match=r"GradientUpdateHandler: sync_each_batch must be True or False, got"):
        GradientUpdateHandler(accumulate=2, sync_each_batch=1)
