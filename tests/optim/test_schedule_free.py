"""A schedule-free optimizer (``schedulefree.AdamWScheduleFree``) trains one sequence of weights and evaluates
another: validations, ``evaluate`` and ``predict`` run with the evaluated ones, training goes on bitwise as if no
validation had run, a resume is bitwise, and a fit starts in train mode whatever mode it was left in."""

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.handlers import CheckpointHandler
from fitforge.optim.schedule_free import ScheduleFreeWeights, switches_modes
from fitforge.testing import linear_data

schedulefree = pytest.importorskip("schedulefree", reason="needs the schedulefree package (pip install schedulefree)")


def estimator():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    return Estimator(net, nn.MSELoss(), optimizer=schedulefree.AdamWScheduleFree(net.parameters(), lr=0.05))


def weights(est):
    return [p.detach().clone() for p in est.net.parameters()]


def test_evaluate_and_predict_use_the_evaluated_weights_and_leave_the_training_ones():
    est = estimator()
    assert isinstance(est.weight_average, ScheduleFreeWeights) and switches_modes(est.optimizer)
    train, val = linear_data(n=64, batch_size=8), linear_data(n=16, batch_size=16, seed=1)
    est.fit(train, epochs=3)
    trained = weights(est)
    got = est.evaluate(val)["val_loss"]
    predicted = est.predict(val)
    assert all(torch.equal(a, b) for a, b in zip(trained, weights(est)))  # the training weights, bitwise
    assert est.optimizer.param_groups[0]["train_mode"]
    est.optimizer.eval()  # what the user would do by hand
    (x, y), *_ = list(val)
    with torch.no_grad():
        expected = est.net(x)
    assert got == pytest.approx(float(nn.functional.mse_loss(expected, y)), rel=1e-6)
    assert torch.equal(predicted, expected)
    assert not any(torch.equal(a, b) for a, b in zip(trained, weights(est)))  # eval mode: other weights
    est.fit(train, epochs=1)  # left in eval mode: fit switches to train mode first
    assert est.optimizer.param_groups[0]["train_mode"]


def test_training_goes_on_bitwise_after_each_validation():
    train, val = linear_data(n=64, batch_size=8), linear_data(n=16, batch_size=16, seed=1)
    with_validation, without = estimator(), estimator()
    history = with_validation.fit(train, val_data=val, epochs=3)
    without.fit(train, epochs=3)
    assert all(torch.equal(a, b) for a, b in zip(weights(with_validation), weights(without)))
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert with_validation.evaluate(val)["val_loss"] == history["val_loss"][-1]  # validated with the evaluated ones


def test_a_resume_is_bitwise_and_the_best_checkpoint_holds_the_evaluated_weights(tmp_path):
    train, val = linear_data(n=64, batch_size=8), linear_data(n=16, batch_size=16, seed=1)

    def fit(folder, batches, resume=False):
        est = estimator()
        saver = CheckpointHandler(folder, batch_period=5, resume_from_checkpoint=resume)
        est.fit(train, val_data=val, batches=batches, event_handlers=[saver])
        return est

    whole = fit(tmp_path / "whole", 20)
    fit(tmp_path / "cut", 10)
    resumed = fit(tmp_path / "cut", 20, resume=True)
    assert all(torch.equal(a, b) for a, b in zip(weights(whole), weights(resumed)))
    assert str(whole.optimizer.state_dict()) == str(resumed.optimizer.state_dict())
    evaluated = whole.weight_average.averaged_state_dict()
    whole.optimizer.eval()
    assert all(torch.equal(evaluated[k], v) for k, v in whole.net.state_dict().items())


def test_lr_find_on_a_fresh_estimator_switches_to_train_mode_and_puts_everything_back():
    est = estimator()  # schedulefree builds its optimizers evaluating
    assert not est.optimizer.param_groups[0]["train_mode"]
    before = weights(est)
    est.lr_find(linear_data(n=64, batch_size=8), num_steps=5)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(est)))
    assert not est.optimizer.param_groups[0]["train_mode"]  # as it was


def test_nested_swaps_put_the_training_weights_back_once():
    est = estimator()
    est.fit(linear_data(n=64, batch_size=8), epochs=2)
    trained = weights(est)
    average = est.weight_average
    average.swap_in()
    average.swap_in()  # an evaluate run from a handler during a validation
    average.swap_out()
    assert not any(torch.equal(a, b) for a, b in zip(trained, weights(est)))  # still the evaluated ones
    average.swap_out()
    assert all(torch.equal(a, b) for a, b in zip(trained, weights(est))) and est.optimizer.param_groups[0]["train_mode"]
