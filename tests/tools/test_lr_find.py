"""lr_find: a sensible suggestion on y = 2x + 3, early stop on divergence, an exact restore of
everything it touched (also after a failure midway), the batch processor, plot, and clear errors."""

import math
import random
import re
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fitforge import BatchProcessor, Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.testing import linear_problem
from fitforge.tools.lr_find import LRFindResult, _suggest, lr_find
from helpers import regression_batches


def test_it_suggests_a_learning_rate_that_trains_the_linear_problem():
    estimator, train, _ = linear_problem()
    result = lr_find(estimator, train)
    assert result.diverged and 20 < len(result.lrs) < 100  # SGD on this problem blows up well before lr 10
    assert result.lrs[0] == 1e-7 and result.lrs == sorted(result.lrs)
    assert 1e-3 < result.suggestion < 1.0 and result.suggestion < result.min_loss_lr
    estimator.optimizer.param_groups[0]["lr"] = result.suggestion
    history = estimator.fit(train, epochs=5)
    assert history["train_loss"][-1] < 0.01 * result.losses[0]


def test_the_rate_grows_exponentially_over_num_steps_and_the_data_is_cycled():
    class Recorder(BatchProcessor):
        def __init__(self):
            super().__init__()
            self.lrs = []

        def fit_batch(self, state, batch):
            self.lrs.append([g["lr"] for o in state.estimator.optimizers for g in o.param_groups])
            return super().fit_batch(state, batch)

    net = nn.Linear(1, 1)
    optimizer = torch.optim.SGD([{"params": [net.weight]}, {"params": [net.bias], "lr": 0.5}], lr=0.1)
    recorder = Recorder()
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizer, device="cpu", batch_processor=recorder)
    result = lr_find(estimator, regression_batches(3), start_lr=1e-6, end_lr=1e-2, num_steps=9, diverge_factor=math.inf)
    assert len(recorder.lrs) == 9 and result.lrs == pytest.approx([10 ** (-6 + k / 2) for k in range(9)])
    assert all(a == b == lr for (a, b), lr in zip(recorder.lrs, result.lrs))  # every group gets the rate
    assert optimizer.param_groups[1]["lr"] == 0.5  # and gets its own back


def test_the_loss_is_smoothed_with_bias_correction():
    estimator, train, _ = linear_problem()
    result = lr_find(estimator, train, num_steps=5, end_lr=1e-6, smoothing=0.5)
    raw, average = result.raw_losses, 0.0
    for i, loss in enumerate(raw):
        average = 0.5 * average + 0.5 * loss
        assert result.losses[i] == pytest.approx(average / (1 - 0.5 ** (i + 1)))
    assert lr_find(estimator, train, num_steps=5, end_lr=1e-6, smoothing=1).losses == raw  # 1: no smoothing


def test_it_stops_when_the_loss_diverges_or_is_not_finite():
    estimator, train, _ = linear_problem()
    result = lr_find(estimator, train, start_lr=1e-2, end_lr=1e3, num_steps=50)
    assert result.diverged and len(result.lrs) < 50
    losses = result.losses  # the last one is the first above 4 x the lowest before it
    assert losses[-1] > 4 * min(losses[:-1]) and all(
        losses[i] <= 4 * min(losses[:i]) for i in range(1, len(losses) - 1)
    )

    class NanAt(BatchProcessor):
        def fit_batch(self, state, batch):
            output = super().fit_batch(state, batch)
            if state.batch_idx == 6:
                output.loss = torch.tensor(float("nan"))
            return output

    estimator, train, _ = linear_problem(batch_processor=NanAt())
    result = lr_find(estimator, train, num_steps=20)
    assert result.diverged and len(result.lrs) == 6 and all(map(math.isfinite, result.raw_losses))


class Failing(BatchProcessor):
    """Fails at step ``at`` (after the previous steps changed the weights and the optimizer)."""

    def __init__(self, at=None):
        super().__init__()
        self.at, self.calls = at, 0

    def fit_batch(self, state, batch):
        self.calls += 1
        if state.batch_idx == self.at:
            raise RuntimeError("boom")
        return super().fit_batch(state, batch)


def snapshot(estimator):
    net = estimator.net
    return {
        "state": {k: v.clone() for k, v in net.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in net.parameters()],
        "optimizer": [
            {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for s in estimator.optimizer.state.values()
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in estimator.optimizer.param_groups],
        "modes": [m.training for m in net.modules()],
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def assert_same(a, b):
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])  # parameters and BatchNorm buffers
    assert [g is None for g in a["grads"]] == [g is None for g in b["grads"]]
    assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]) if x is not None)
    assert len(a["optimizer"]) == len(b["optimizer"]) > 0
    for x, y in zip(a["optimizer"], b["optimizer"]):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # Adam's step and moments
    assert a["groups"] == b["groups"] and a["modes"] == b["modes"]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]
    assert np.array_equal(a["rng"][2], b["rng"][2])


@pytest.mark.parametrize("fail_at", [None, 5])
def test_it_restores_weights_optimizer_modes_and_generators_exactly_even_when_it_fails(fail_at):
    net = nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 1))
    processor = Failing(fail_at)
    estimator = Estimator(
        net,
        nn.MSELoss(),
        optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
        device="cpu",
        batch_processor=processor,
    )
    batches = regression_batches(4, batch_size=8)
    estimator.fit(batches, epochs=1)  # Adam has a state to keep
    net[2].eval()  # a module in its own mode
    estimator.net[4].weight.grad = torch.full_like(net[4].weight, 0.5)  # a gradient left by the user
    random.random(), np.random.rand()
    before = snapshot(estimator)
    processor.calls = 0
    if fail_at is None:
        result = lr_find(estimator, batches, num_steps=12, end_lr=1.0)
        assert len(result.lrs) > 5 and processor.calls == len(result.lrs) + result.diverged
    else:
        with pytest.raises(RuntimeError, match="boom"):
            lr_find(estimator, batches, num_steps=12)
        assert processor.calls == fail_at + 1  # the custom processor ran every step
    assert_same(snapshot(estimator), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float16 mixed precision needs a CUDA device")
def test_it_steps_through_the_fp16_scaler_and_restores_it():
    net = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    estimator = Estimator(
        net, nn.MSELoss(), optimizer=torch.optim.Adam(net.parameters()), device="cuda", precision="16-mixed"
    )
    estimator.fit(regression_batches(4), epochs=1)
    before = snapshot(estimator)
    scaler = estimator.scaler.state_dict()
    result = lr_find(estimator, regression_batches(4), num_steps=30)
    assert len(result.lrs) > 5 and estimator.scaler.get_scale() > 0
    assert_same(snapshot(estimator), before)
    assert estimator.scaler.state_dict() == scaler


def test_suggestion_is_the_steepest_descent_before_the_minimum_else_the_minimum_over_ten():
    lrs = [10.0**k for k in range(-6, 1)]
    assert _suggest(lrs, [5.0, 4.9, 4.0, 1.0, 0.5, 0.4, 9.0]) == (1e-4, 1e-1)  # central slope -1.95 at 1e-4
    assert _suggest(lrs, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]) == (1e-7, 1e-6)  # never falls: min / 10
    assert _suggest(lrs[:3], [3.0, 3.0, 3.0]) == (1e-7, 1e-6)  # flat: no negative slope
    assert _suggest([], []) == (None, None)


def test_plot_writes_a_png_and_needs_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    estimator, train, _ = linear_problem()
    result = lr_find(estimator, train, num_steps=30)
    figure = result.plot(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.axes[0].get_xscale() == "log" and figure.axes[0].get_xlabel() == "learning rate"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"LRFindResult.plot\(\) needs matplotlib: pip install 'fitforge\[plot\]'"):
        LRFindResult().plot()


def test_the_plot_clips_the_loss_axis_to_the_useful_range_of_a_diverged_sweep(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    result = LRFindResult(
        lrs=[1e-5, 1e-4, 1e-3, 1e-2, 1e-1], losses=[2.0, 1.5, 1.0, 40.0, 1e6], raw_losses=[2.0, 1.4, 0.9, 50.0, 1e7]
    )
    assert result.loss_range() == (0.9, 2.5)  # 10% of the 1.0 drop below the lowest, 50% above the first
    bottom, top = result.plot(tmp_path / "lr.png").axes[0].get_ylim()
    assert (bottom, top) == pytest.approx((0.9, 2.5))
    assert LRFindResult(lrs=[1.0], losses=[math.nan]).loss_range() is None
    assert LRFindResult(lrs=[1.0, 2.0], losses=[1.0, 1.0]).loss_range() == (0.9, 1.5)  # flat: 1.0 as the span


def test_lr_find_takes_arrays_as_fit_does():
    estimator, train, _ = linear_problem()
    x = torch.cat([batch[0] for batch in train])
    y = torch.cat([batch[1] for batch in train])
    result = estimator.lr_find((x.numpy(), y.numpy()), num_steps=20, batch_size=16)
    assert len(result.lrs) >= 2 and result.suggestion is not None


def test_the_repr_is_one_short_line():
    estimator, train, _ = linear_problem()
    result = lr_find(estimator, train, num_steps=300)
    text = repr(result)
    assert re.fullmatch(
        r"LRFindResult\(steps=\d+, lrs=1e-07\.\.[\d.e+-]+, suggestion=[\d.e+-]+, min_loss_lr=[\d.e+-]+, "
        r"diverged=(True|False)\)",
        text,
    ), text
    assert len(text) < 120 and repr(LRFindResult()) == "LRFindResult(steps=0)"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"start_lr": 1.0, "end_lr": 0.1},
            FitforgeValueError,
            "0 < start_lr < end_lr < inf, got start_lr=1.0, end_lr=0.1",
        ),
        ({"start_lr": 0.1, "end_lr": 0.1}, FitforgeValueError, "start_lr=0.1, end_lr=0.1"),
        ({"start_lr": 0}, FitforgeValueError, "got start_lr=0, end_lr=10"),
        ({"end_lr": math.inf}, FitforgeValueError, "end_lr=inf"),
        ({"start_lr": "1e-7"}, FitforgeTypeError, "start_lr must be a number, got str '1e-7'"),
        ({"end_lr": math.nan}, FitforgeValueError, "end_lr must be a number, not nan"),
        ({"num_steps": 1}, FitforgeValueError, "num_steps must be an int >= 2, got 1"),
        ({"num_steps": 10.0}, FitforgeTypeError, "num_steps must be an int >= 2, got float 10.0"),
        ({"smoothing": 0}, FitforgeValueError, r"smoothing must be in \(0, 1\] \(the weight of each new loss\), got 0"),
        ({"smoothing": 1.5}, FitforgeValueError, "got 1.5"),
        ({"diverge_factor": 1}, FitforgeValueError, r"diverge_factor must be > 1 \(math.inf never stops\), got 1"),
        ({"diverge_factor": None}, FitforgeTypeError, "diverge_factor must be a number, got NoneType None"),
    ],
)
def test_argument_errors_name_the_argument_what_was_given_and_what_is_expected(kwargs, error, message):
    estimator, train, _ = linear_problem()
    with pytest.raises(error, match=message):
        lr_find(estimator, train, **kwargs)


def test_bad_estimators_and_data_are_clear_errors_before_any_step():
    estimator, train, _ = linear_problem()
    with pytest.raises(FitforgeTypeError, match="lr_find: estimator must be a fitforge Estimator, got Linear"):
        lr_find(estimator.net, train)
    with pytest.raises(FitforgeTypeError, match="train_data must be an iterable of"):
        lr_find(estimator, torch.zeros(()))
    with pytest.raises(FitforgeValueError, match=r"train_data is empty \(len 0\)"):
        lr_find(estimator, [])
    with pytest.raises(FitforgeValueError, match="train_data is a one-shot iterator"):
        lr_find(estimator, iter(train))

    class Empty:  # no len(): found empty only when read
        def __iter__(self):
            return iter(())

    weights = [p.clone() for p in estimator.net.parameters()]
    with pytest.raises(FitforgeValueError, match="lr_find: train_data yielded no batch"):
        lr_find(estimator, Empty())
    assert all(torch.equal(a, b) for a, b in zip(weights, estimator.net.parameters()))


def test_the_estimator_method_runs_the_same_range_test():
    from fitforge.testing import linear_problem as problem

    estimator, train, _ = problem()
    by_method = estimator.lr_find(train, num_steps=20)
    estimator, train, _ = problem()
    by_function = lr_find(estimator, train, num_steps=20)
    assert by_method.lrs == by_function.lrs and by_method.suggestion == by_function.suggestion
