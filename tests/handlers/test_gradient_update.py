"""GradientUpdateHandler: plain steps, gradient accumulation, clipping by norm and by value."""

import pytest
import torch
from torch import nn

from fitforge.events import BatchBegin
from fitforge.exceptions import CancelBatch, FitforgeTypeError, FitforgeValueError
from fitforge.handlers import GradientUpdateHandler
from helpers import make_estimator


def data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 1


def trained(batch_size, accumulate, epochs=1, n=8, **kwargs):
    torch.manual_seed(0)
    estimator = make_estimator(net=nn.Linear(3, 1))
    x, y = data(n)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
    history = estimator.fit(batches, epochs=epochs, event_handlers=[GradientUpdateHandler(accumulate, **kwargs)])
    return estimator.net, history


def test_accumulating_n_batches_equals_one_batch_n_times_larger():
    big, _ = trained(batch_size=8, accumulate=1, epochs=3)
    small, _ = trained(batch_size=2, accumulate=4, epochs=3)
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b)


def test_a_trailing_partial_group_is_stepped_with_its_own_mean():
    # 3 batches of 2 with accumulate=2: a group of two batches, then one of a single batch at epoch end.
    stepwise, _ = trained(batch_size=2, accumulate=2, n=6)
    torch.manual_seed(0)
    reference = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = data(6)
    for part in (slice(0, 4), slice(4, 6)):  # the mean over a group equals one batch of the group
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x[part]), y[part]).backward()
        optimizer.step()
    for a, b in zip(stepwise.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_optimizer_steps_count_steps_not_batches():
    steps = []

    class Record(BatchBegin):
        def batch_begin(self, state):
            steps.append(state.optimizer_steps)

    estimator = make_estimator(net=nn.Linear(3, 1))
    x, y = data(10)
    batches = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 10, 2)]
    estimator.fit(batches, epochs=1, event_handlers=[GradientUpdateHandler(accumulate=2), Record()])
    assert steps == [0, 0, 1, 1, 2]


def test_a_cancelled_batch_drops_its_group_so_far():
    class CancelSecond(BatchBegin):
        def batch_begin(self, state):
            if state.batch_idx == 1:
                raise CancelBatch

    estimator = make_estimator(net=nn.Linear(3, 1))
    x, y = data(8)
    batches = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]
    before = [p.detach().clone() for p in estimator.net.parameters()]
    seen = []

    class Record(BatchBegin):
        priority = 10

        def batch_begin(self, state):
            seen.append((state.batch_idx, state.accumulated_batches))

    estimator.fit(batches, epochs=1, event_handlers=[GradientUpdateHandler(accumulate=3), CancelSecond(), Record()])
    # batch 0 accumulated, batch 1 cancelled (the group is dropped), batches 2 and 3 form the trailing group
    assert seen == [(0, 0), (2, 0), (3, 1)]
    assert any(not torch.equal(a, b) for a, b in zip(before, estimator.net.parameters()))


@pytest.mark.parametrize("kwargs, bound", [({"clip_norm": 0.01}, "norm"), ({"clip_value": 0.001}, "value")])
def test_clipping_bounds_the_update(kwargs, bound):
    torch.manual_seed(0)
    estimator = make_estimator(net=nn.Linear(3, 1))
    before = torch.cat([p.detach().flatten().clone() for p in estimator.net.parameters()])
    x, y = data(8)
    estimator.fit([(x, y * 100)], epochs=1, event_handlers=[GradientUpdateHandler(**kwargs)])  # huge gradients
    update = (torch.cat([p.detach().flatten() for p in estimator.net.parameters()]) - before) / 0.1  # SGD lr 0.1
    if bound == "norm":
        assert update.norm() == pytest.approx(0.01, rel=1e-4)
    else:
        assert update.abs().max() == pytest.approx(0.001, rel=1e-4)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"accumulate": 0}, FitforgeValueError, "accumulate must be a positive int, got 0"),
        ({"accumulate": 2.0}, FitforgeTypeError, "accumulate must be a positive int, got float 2.0"),
        ({"clip_norm": -1.0}, FitforgeValueError, "clip_norm must be a positive number or None, got -1.0"),
        ({"clip_value": "1"}, FitforgeTypeError, "clip_value must be a positive number or None, got str"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        GradientUpdateHandler(**kwargs)
