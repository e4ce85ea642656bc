"""NaNGuardHandler: the three policies on a loss (or a gradient) that turns nan/inf at a known batch,
the optimizer step it guards (on the device for fused optimizers, by a host read otherwise), what
each costs in host reads, its state across a checkpoint, and its argument errors."""

import logging
import math
import re

import pytest
import torch
from torch import nn

from fitforge import BatchOutput, Estimator, TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler
from fitforge.handlers.nan_guard import NaNGuardHandler, NonFiniteLossError
from fitforge.testing import HostReadCounter, RecordingHandler, linear_data
from helpers import NanGradient


class PoisonNet(nn.Module):
    """Linear(1, 1) whose output (hence loss and gradients) is multiplied by ``poison`` at the given
    training forward calls, and whose gradients only are nan at ``grad_calls``: call k is the k-th
    batch read in the run, counted from 0."""

    def __init__(self, calls=(), poison=math.nan, grad_calls=()):
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.calls, self.poison, self.grad_calls, self.count = set(calls), poison, set(grad_calls), 0

    def forward(self, x):
        y = self.linear(x)
        if self.training:
            if self.count in self.calls:
                y = y * self.poison
            if self.count in self.grad_calls:
                y = NanGradient.apply(y)
            self.count += 1
        return y


def batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.rand(4, 1, generator=g) * 2 - 1 for _ in range(n)]
    return [(x, 2 * x + 3) for x in xs]


def make_optimizer(net, fused):
    return (
        torch.optim.Adam(net.parameters(), lr=0.1, fused=True) if fused else torch.optim.SGD(net.parameters(), lr=0.1)
    )


def fit(calls=(), handlers=(), data=None, poison=math.nan, fused=False, grad_calls=(), **kwargs):
    """Train a PoisonNet with SGD, or with ``fused`` a fused Adam (which can skip a step on the device)."""
    torch.manual_seed(0)
    net = PoisonNet(calls, poison, grad_calls)
    optimizer = make_optimizer(net, fused)
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizer, device="cpu")
    if "batches" not in kwargs:
        kwargs.setdefault("epochs", 3)
    history = estimator.fit(data or batches(), event_handlers=list(handlers), **kwargs)
    return history, net


def finite(net):
    return all(torch.isfinite(p).all() for p in net.parameters())


def same_weights(net, other):
    return all(torch.equal(a, b) for a, b in zip(net.parameters(), other.parameters()))


def test_stop_with_a_fused_optimizer_skips_bad_steps_on_the_device_and_stops_at_epoch_end():
    guard = NaNGuardHandler()
    data = batches()
    history, net = fit(calls={5, 6}, handlers=[guard], data=data, fused=True)  # epoch 2, batches 2 and 3
    assert history.epochs == 2  # epoch 2 ran to its end, then the stop
    assert history.stop_reason == "NaNGuardHandler: loss nan at epoch 2, batch 2 (global step 5)"
    assert guard.stopped_epoch == 1
    assert math.isnan(history["train_loss"][1]) and not math.isnan(history["train_loss"][0])
    # Issue 14, point 2: the optimizer stepped on the nan gradients, so the weights (and every
    # checkpoint after) were nan. Now the two bad steps were skipped: the weights are those of the
    # six good batches.
    _, clean = fit(data=data + [data[0], data[3]], epochs=1, fused=True)
    assert finite(net) and same_weights(net, clean)


def test_stop_without_a_fused_optimizer_reads_every_batch_and_stops_at_the_first_bad_one():
    history, net = fit(calls={5, 6}, handlers=[NaNGuardHandler()])
    assert (
        history.epochs == 2 and history.stop_reason == "NaNGuardHandler: loss nan at epoch 2, batch 2 (global step 5)"
    )
    _, clean = fit(batches=5)
    assert finite(net) and same_weights(net, clean)


@pytest.mark.parametrize("policy", ["stop", "skip", "raise"])
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused adam"])
def test_no_policy_steps_on_a_nan_gradient_of_a_finite_loss(policy, fused):
    # The loss of batch 2 is finite, its gradients are not: caught in that batch, not one late.
    data = batches()
    guard = NaNGuardHandler(policy)
    if policy == "raise":
        with pytest.raises(
            NonFiniteLossError,
            match=r"the training gradient \(loss [\d.]+\) at epoch 1, batch 2 "
            r"\(global step 1\) is not finite",
        ):
            fit(grad_calls={1}, handlers=[guard], data=data, fused=fused)
        return
    history, net = fit(grad_calls={1}, handlers=[guard], data=data, fused=fused, epochs=1)
    _, clean = fit(data=[data[0], data[2], data[3]] if policy == "skip" or fused else [data[0]], epochs=1, fused=fused)
    assert finite(net) and same_weights(net, clean)
    if policy == "stop":
        assert re.fullmatch(
            r"NaNGuardHandler: gradient \(loss [\d.]+\) at epoch 1, batch 2 \(global step 1\) is not "
            r"finite",
            history.stop_reason,
        )
    else:
        assert guard.skipped == 1 and history.stop_reason == "reached epochs=1"


def test_a_fused_guard_skips_a_whole_accumulation_group_with_a_bad_gradient():
    from fitforge.handlers import GradientUpdateHandler

    data = batches()
    history, net = fit(
        grad_calls={0},
        data=data,
        fused=True,
        epochs=1,
        handlers=[NaNGuardHandler(), GradientUpdateHandler(accumulate=2)],
    )
    _, clean = fit(data=data[2:], epochs=1, fused=True, handlers=[GradientUpdateHandler(accumulate=2)])
    assert finite(net) and same_weights(net, clean)  # the group of batches 1-2 was not stepped
    assert history.stop_reason.startswith("NaNGuardHandler: gradient")


def test_stop_with_check_every_1_stops_before_the_bad_step():
    history, net = fit(calls={5}, handlers=[NaNGuardHandler("stop", check_every=1)])
    assert history.stop_reason == "NaNGuardHandler: loss nan at epoch 2, batch 2 (global step 5)"
    assert finite(net)
    _, clean = fit(batches=5)  # the same five good steps, no guard: the same weights, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), clean.parameters()))


def test_check_every_n_names_the_first_bad_batch_read_at_the_next_check():
    recorder = RecordingHandler()
    history, _ = fit(calls={4}, handlers=[NaNGuardHandler(check_every=3), recorder], fused=True)
    # read after global steps 2 and 5: the bad batch 4 is found at 5, which is cancelled
    assert history.stop_reason == "NaNGuardHandler: loss nan at epoch 2, batch 1 (global step 4)"
    assert [c[4] for c in recorder.calls if c[0] == "batch_end"][-1] == 4  # batch 5 never reached the recorder
    assert recorder.calls[-2][0] == "epoch_end" and recorder.calls[-2][4] == 5


@pytest.mark.parametrize("poison, shown", [(math.nan, "nan"), (math.inf, "inf")])
def test_raise_names_epoch_batch_step_and_value_and_train_end_still_runs(poison, shown):
    recorder = RecordingHandler()
    with pytest.raises(NonFiniteLossError, match=rf"loss {shown} at epoch 2, batch 3 \(global step 6\) is not finite"):
        fit(calls={6}, handlers=[NaNGuardHandler("raise"), recorder], poison=poison)
    assert recorder.events[-1] == "train_end"
    assert issubclass(NonFiniteLossError, ValueError)


def test_raise_with_check_every_1_fails_at_the_bad_batch():
    recorder = RecordingHandler()
    with pytest.raises(NonFiniteLossError, match=r"epoch 1, batch 2 \(global step 1\)"):
        fit(calls={1}, handlers=[NaNGuardHandler("raise", check_every=1), recorder])
    assert "epoch_end" not in recorder.events


def test_skip_steps_over_bad_batches_as_if_they_were_not_there(caplog):
    data = batches()
    guard = NaNGuardHandler("skip")
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        history, net = fit(calls={1, 5}, handlers=[guard], data=data, epochs=2)
    assert history.epochs == 2 and history.stop_reason == "reached epochs=2"
    assert guard.skipped == 2 and finite(net)
    assert "skipped 1 batch(es) of epoch 1" in caplog.text and "skipped 1 batch(es) of epoch 2" in caplog.text
    good = [b for i, b in enumerate(data + data) if i not in {1, 5}]
    _, clean = fit(data=good, epochs=1)  # the six good batches in the same order
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), clean.parameters()))
    assert not math.isnan(history["train_loss"][0])  # a skipped batch is not in the epoch's metrics


def reads_in_one_epoch(n_batches, guard, fused=True):
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer=make_optimizer(net, fused), device="cpu")
    with HostReadCounter() as reads:
        estimator.fit(linear_data(n=4 * n_batches, batch_size=4), epochs=1, event_handlers=[guard()])
    return reads.count


def test_the_default_with_a_fused_optimizer_adds_no_host_read_per_batch():
    assert reads_in_one_epoch(8, NaNGuardHandler) == reads_in_one_epoch(64, NaNGuardHandler)
    assert reads_in_one_epoch(8, NaNGuardHandler) > reads_in_one_epoch(8, lambda: RecordingHandler())  # it reads once


@pytest.mark.parametrize(
    "guard, fused",
    [(lambda: NaNGuardHandler(check_every=1), True), (lambda: NaNGuardHandler("skip"), True), (NaNGuardHandler, False)],
    ids=["check_every=1", "skip", "not fused"],
)
def test_per_batch_checks_read_every_batch_as_documented(guard, fused):
    assert reads_in_one_epoch(64, guard, fused) - reads_in_one_epoch(8, guard, fused) == 56


def test_the_record_rides_in_the_state_dict():
    net = nn.Linear(1, 1)
    state = TrainState(Estimator(net, nn.MSELoss(), optimizer=make_optimizer(net, True), device="cpu"))
    state.history.new_epoch()
    guard = NaNGuardHandler()
    guard.train_begin(state)
    state.global_step, state.batch_idx = 9, 2
    state.output = BatchOutput((), None, None, torch.tensor(math.inf))
    guard.backward_end(state)
    saved = guard.state_dict()
    restored = NaNGuardHandler()
    restored.train_begin(state)
    restored.load_state_dict(saved)
    state.run.epoch_finished = True
    restored.epoch_end(state)
    assert state.run.stop_reason == "NaNGuardHandler: loss inf at epoch 1, batch 3 (global step 9)"
    assert restored.state_dict()["stopped_epoch"] == 0


def test_a_run_it_stopped_trains_no_more_on_resume(tmp_path):
    def saver():
        return CheckpointHandler(tmp_path, resume_from_checkpoint=True)

    history, _ = fit(calls={5}, handlers=[NaNGuardHandler(), saver()], epochs=4)
    assert history.epochs == 2
    history, _ = fit(handlers=[NaNGuardHandler(), saver()], epochs=4)  # the same script, run again
    assert history.epochs == 2 and history.stop_reason.startswith("already stopped")


def test_its_declared_state_access_holds():
    history, _ = fit(calls={5}, handlers=[NaNGuardHandler()], check_access=True)
    assert history.stop_reason.startswith("NaNGuardHandler")


def test_it_runs_before_the_optimizer_step():
    net = nn.Linear(1, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    lines = estimator.describe_loop([NaNGuardHandler("skip")]).splitlines()
    assert lines[3].split()[:2] == ["backward_end", "NaNGuardHandler(guard)"]  # after backward, before batch_end
    assert lines[4].split()[1] == "GradientUpdateHandler(step)" and "NaNGuard" not in lines[4]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"policy": "halt"}, FitforgeValueError, r"policy must be one of \('stop', 'skip', 'raise'\), got 'halt'"),
        ({"policy": 1}, FitforgeTypeError, r"policy must be one of .*got int 1"),
        ({"check_every": 0}, FitforgeValueError, r"check_every must be a positive int or None, got 0"),
        ({"check_every": 2.5}, FitforgeTypeError, r"check_every must be a positive int or None, got float 2.5"),
        ({"policy": "skip", "check_every": 5}, FitforgeValueError, r"policy='skip' decides every batch"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        NaNGuardHandler(**kwargs)


def test_fused_sgd_is_guarded_on_the_host():
    # A skipped first step of a fused SGD with momentum leaves its buffers uninitialised: not trusted.
    torch.manual_seed(0)
    net = PoisonNet(grad_calls={0})
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizer, device="cpu")
    history = estimator.fit(batches(), epochs=2, event_handlers=[NaNGuardHandler("skip")])
    assert history.stop_reason == "reached epochs=2" and finite(net)
    assert all(bool(s["momentum_buffer"].abs().max() < 100) for s in optimizer.state.values())
