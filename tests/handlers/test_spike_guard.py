"""SpikeGuardHandler: injected bad batches spike the loss; the guard goes back to the last good
weights each time, never checkpoints a spiked state, ends near a clean run, and gives up past
max_recoveries, naming the batches; its decision is read every few batches, not every batch. After a
rollback the snapshot's own losses judge the next batches, and a resume goes on with the same snapshot."""

import logging

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.checkpoint.files import load_checkpoint
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, LambdaHandler, LossSpikeError, SpikeGuardHandler
from fitforge.testing import HostReadCounter
from helpers import Crash

SPIKED = (150, 260, 380)  # the bad batches' positions
BATCHES, BATCH = 480, 64


def problem():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH + 400, 8, generator=generator)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    batches = [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(BATCHES)]
    return batches, (x[-400:], y[-400:])


def spiked(batches):
    """Inputs scaled by 1e3 and labels scrambled in the batches at ``SPIKED``."""
    bad = list(batches)
    for i in SPIKED:
        x, y = bad[i]
        bad[i] = (x * 1e3, y.flip(0))
    return bad


class SpikedOnce:
    """``batches``, with the spiked ones in the first pass only: later epochs are clean."""

    def __init__(self, batches):
        self.batches, self.passes = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.passes += 1
        return iter(spiked(self.batches) if self.passes == 1 else self.batches)


def estimator():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    return Estimator(
        net, nn.CrossEntropyLoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    )


def val_loss(est, val):
    return est.evaluate([val])["val_loss"]


def test_three_spikes_are_recovered_from_and_the_run_ends_near_a_clean_one(tmp_path, caplog):
    batches, val = problem()
    clean = estimator()
    clean.fit(batches, epochs=2, default_handlers=False)
    guarded, guard = estimator(), SpikeGuardHandler(snapshot_every=8)  # a snapshot at every check without a spike
    saver = CheckpointHandler(tmp_path, batch_period=4, max_checkpoints=1000)
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        history = guarded.fit(SpikedOnce(batches), epochs=2, event_handlers=[guard, saver], default_handlers=False)
    assert guard.recoveries == [(1, i + 1) for i in SPIKED]  # each bad batch, named from 1
    assert history["spike_recoveries"] == [3.0, 0.0]
    assert caplog.text.count("SpikeGuardHandler: the training loss spiked at epoch 1 batch") == 3
    assert abs(val_loss(guarded, val) - val_loss(clean, val)) <= 0.02 * val_loss(clean, val)
    unguarded = estimator()
    unguarded.fit(SpikedOnce(batches), epochs=2, default_handlers=False)
    assert not val_loss(unguarded, val) <= 1.02 * val_loss(clean, val)  # the spikes hurt without the guard
    # Never a spiked state in a checkpoint: every one is as good as the start, at least.
    start = val_loss(estimator(), val)
    for path in sorted(tmp_path.glob("*.pt")):
        probe = estimator()
        probe.net.load_state_dict(load_checkpoint(path)["model"])
        assert val_loss(probe, val) < start, path.name


def test_past_max_recoveries_the_run_fails_naming_the_batches():
    batches, _ = problem()
    with pytest.raises(
        LossSpikeError,
        match=r"spiked 3 times, more than max_recoveries=2, at epoch 1 batch 151, epoch 1 batch 261, epoch 1 batch 381",
    ):
        estimator().fit(
            spiked(batches), epochs=1, event_handlers=[SpikeGuardHandler(max_recoveries=2)], default_handlers=False
        )


def test_lr_factor_lowers_the_rate_at_each_recovery():
    batches, _ = problem()
    est = estimator()
    est.fit(spiked(batches), epochs=1, event_handlers=[SpikeGuardHandler(lr_factor=0.5)], default_handlers=False)
    assert est.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)


def test_the_decision_is_read_every_few_batches_not_every_batch():
    batches, _ = problem()

    def reads(n):
        with HostReadCounter() as counter:
            estimator().fit(batches[:n], epochs=1, event_handlers=[SpikeGuardHandler()], default_handlers=False)
        return counter.count

    assert reads(64) - reads(32) == 4  # one read per 8 batches (check_every's default)


def test_bad_arguments_are_refused():
    with pytest.raises(FitforgeValueError, match="factor must be above 1"):
        SpikeGuardHandler(factor=0.5)
    with pytest.raises(FitforgeTypeError, match="max_recoveries must be an int >= 0"):
        SpikeGuardHandler(max_recoveries=-1)


def test_a_spike_in_the_epochs_last_batches_is_caught_at_its_end():
    batches, _ = problem()
    bad = list(batches)
    x, y = bad[-2]
    bad[-2] = (x * 1e3, y.flip(0))  # after the epoch's last check (every 8 batches)
    guard = SpikeGuardHandler()
    history = estimator().fit(bad, epochs=1, event_handlers=[guard], default_handlers=False)
    assert guard.recoveries == [(1, BATCHES - 1)] and history["spike_recoveries"] == [1.0]


def test_a_loss_that_can_be_negative_is_judged_only_when_not_finite():
    def shifted(pred, label):  # a negative log-likelihood can be below 0
        return nn.functional.cross_entropy(pred, label) - 3.0

    batches, _ = problem()
    est = estimator()
    est.loss = shifted
    guard = SpikeGuardHandler()
    est.fit(batches[:100], epochs=1, event_handlers=[guard], default_handlers=False)
    assert guard.recoveries == []


def test_an_averaged_copy_of_the_weights_goes_back_too():
    from fitforge.handlers import EMAHandler

    batches, val = problem()
    bad = list(batches[:200])
    x, y = bad[100]
    bad[100] = (x * float("nan"), y)
    est = estimator()
    handlers = [SpikeGuardHandler(), EMAHandler(decay=0.9)]
    est.fit(bad, epochs=1, event_handlers=handlers, default_handlers=False, check_access=True)
    assert torch.isfinite(torch.tensor(val_loss(est, val)))  # evaluated with the average


def test_the_undone_batches_count_in_no_training_value():
    batches, _ = problem()
    clean = estimator().fit(batches, epochs=2)
    guarded = estimator().fit(SpikedOnce(batches), epochs=2, event_handlers=[SpikeGuardHandler(snapshot_every=8)])
    assert guarded["spike_recoveries"] == [3.0, 0.0]
    for epoch in (0, 1):  # the spiked batches' losses (about 1e3 times the others) left the epoch's mean
        assert abs(guarded["train_loss"][epoch] - clean["train_loss"][epoch]) <= 0.05 * clean["train_loss"][epoch]
    unguarded = estimator().fit(SpikedOnce(batches), epochs=1)
    assert unguarded["train_loss"][0] > 2 * clean["train_loss"][0]  # what the guard leaves out


def regression(spike=True, batches=40, noise=1.0):
    """The issue's run: y = x @ w + 0.5 + noise in batches of 16, the loss falling fast in the first
    epoch; batch 30's inputs x1e3 (epoch n batch 31, from 1) when ``spike``."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(batches * 16, 4, generator=generator), torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    y = x @ w + 0.5 + noise * torch.randn(batches * 16, 1, generator=generator)
    data = [(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]) for i in range(batches)]
    if spike:
        data[30] = (data[30][0] * 1e3, data[30][1])
    return data


def regressor(lr=0.05, loss=None):
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    return Estimator(net, loss or nn.MSELoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=lr))


def training_loss(est, **data):
    return est.evaluate(regression(spike=False, **data))["val_loss"]  # the final weights, on the clean batches


def test_one_spike_an_epoch_while_the_loss_falls_fast_is_recovered_from_once_each():
    # A rollback restores weights whose loss is above the losses of the steps it undoes: the losses saved
    # with them judge the batches after it, so those are no spikes (before, each check undid them again).
    # Epoch 1's spike goes back to batch 16's snapshot, the first the median judged (not to the start).
    clean = regressor()
    clean.fit(regression(spike=False), epochs=2)
    guard, guarded = SpikeGuardHandler(), regressor()
    history = guarded.fit(regression(), epochs=2, event_handlers=[guard])
    assert guard.recoveries == [(1, 31), (2, 31)] and history["spike_recoveries"] == [1.0, 1.0]
    assert abs(training_loss(guarded) - training_loss(clean)) <= 0.02 * training_loss(clean)


def test_the_give_up_error_counts_distinct_spikes():
    with pytest.raises(
        LossSpikeError, match=r"spiked 2 times, more than max_recoveries=1, at epoch 1 batch 31, epoch 2 batch 31:"
    ):
        regressor().fit(
            regression(), epochs=2, event_handlers=[SpikeGuardHandler(max_recoveries=1)], default_handlers=False
        )


class OffsetAt:
    """MSE, plus 1e3 at its ``at``-th call: a spike of the loss alone, the weights' course unchanged."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, pred, label):
        self.calls += 1
        return nn.functional.mse_loss(pred, label) + (1e3 if self.calls == self.at else 0.0)


def test_a_spike_right_after_a_snapshot_ten_times_below_the_last_is_recovered_from_once():
    # Snapshots at batches 8 and 16 (every check once the window judges), the loss 10x lower at the
    # second; the spike at batch 17 leaves the weights on course, so by the check at batch 24 the window
    # holds losses far below the second snapshot's: the rollback is judged by the snapshot's own.
    losses = []
    record = LambdaHandler(backward_end=lambda state: losses.append(float(state.output.loss.detach())), priority=-3001)
    guard, est = SpikeGuardHandler(window=8, snapshot_every=8, check_every=8), regressor(lr=0.1, loss=OffsetAt(17))
    data = {"batches": 64, "noise": 0.01}
    est.fit(regression(spike=False, **data), epochs=1, event_handlers=[guard, record], default_handlers=False)
    assert losses[7] > 10 * losses[15]  # the losses judged at the two snapshots' checks
    assert guard.recoveries == [(1, 17)]
    clean = regressor(lr=0.1)
    clean.fit(regression(spike=False, **data), epochs=1, default_handlers=False)
    assert abs(training_loss(est, **data) - training_loss(clean, **data)) <= 0.02 * training_loss(clean, **data)


@pytest.mark.parametrize("crash", [60, 78])  # saves before epoch 2's spike and after its recovery
def test_a_resume_goes_on_with_the_same_snapshot_and_losses(tmp_path, crash):
    # A save makes the state it saves the snapshot, with the losses it saves: a resume from it starts from
    # both, and checks at the same batches (saves every 6, checks every 8), so it is the run not cut.
    def run(folder, crash=None):
        guard, est = SpikeGuardHandler(), regressor()
        handlers = [guard, CheckpointHandler(folder, batch_period=6, resume_from_checkpoint=True)]
        try:
            est.fit(regression(), epochs=2, event_handlers=handlers + ([Crash(crash)] if crash else []))
        except RuntimeError:  # the crash
            return None
        return guard.recoveries, est.history["spike_recoveries"], est.history["train_loss"], est.net.state_dict()

    whole = run(tmp_path / "whole")
    assert run(tmp_path / "cut", crash) is None
    resumed = run(tmp_path / "cut")
    assert resumed[:3] == whole[:3] and whole[0] == [(1, 31), (2, 31)]
    for name, value in whole[3].items():
        assert torch.equal(resumed[3][name], value), name


def test_two_saves_of_one_state_take_one_snapshot(tmp_path, monkeypatch):
    taken = []
    take = SpikeGuardHandler._take_snapshot
    monkeypatch.setattr(SpikeGuardHandler, "_take_snapshot", lambda self, state: taken.append(1) or take(self, state))
    saver = CheckpointHandler(tmp_path, monitor="train_loss", save_best=True, epoch_period=1)  # both at epoch ends
    regressor().fit(regression(spike=False), epochs=2, event_handlers=[SpikeGuardHandler(snapshot_every=1000), saver])
    assert len(list(tmp_path.glob("*.pt"))) >= 3  # the best and the periodic ones
    assert len(taken) == 1 + 1 + 2  # the start, the first judged state, one per epoch end's state
