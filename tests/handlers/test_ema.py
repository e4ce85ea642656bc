"""EMAHandler: the average equals one computed by hand, evaluation runs with it (and the raw
weights keep training), checkpoints hold it, and a resume after kill -9 continues it bitwise."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchEnd
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, EMAHandler, GradientUpdateHandler
from fitforge.testing import HostReadCounter

TRAINER = Path(__file__).with_name("ema_trainer.py")


def problem(seed=0, n=160, batch_norm=True):
    torch.manual_seed(seed)
    X = torch.randn(n, 6)
    y = (X[:, 0] + X[:, 1] > 0).long()
    layers = [nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 2)]
    net = nn.Sequential(*(layer for layer in layers if batch_norm or not isinstance(layer, nn.BatchNorm1d)))
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.2), device="cpu")
    return estimator, DataLoader(TensorDataset(X, y), batch_size=16), (X, y)


class HandAverage(BatchEnd):
    """An EMA of the parameters (and floating buffers) computed as the definition says, after each
    optimizer step, beside the handler."""

    priority = 1

    def __init__(self, net, decay, every=1):
        self.net, self.decay, self.every, self.seen = net, decay, every, 0
        self.average = {k: v.detach().clone() for k, v in net.state_dict().items() if v.is_floating_point()}

    def batch_end(self, state):
        if state.optimizer_steps == self.seen:
            return
        self.seen = state.optimizer_steps
        if self.seen % self.every == 0:
            live = self.net.state_dict()
            for key, average in self.average.items():
                average.copy_(self.decay * average + (1 - self.decay) * live[key])


@pytest.mark.parametrize("every, accumulate", [(1, 1), (3, 1), (1, 2)])
def test_the_average_equals_one_computed_by_hand_after_50_steps(every, accumulate):
    estimator, train, _ = problem()  # 10 batches an epoch
    hand, ema = HandAverage(estimator.net, 0.9, every), EMAHandler(decay=0.9, every=every)
    handlers = [ema, hand] + ([GradientUpdateHandler(accumulate=accumulate)] if accumulate > 1 else [])
    estimator.fit(train, epochs=5 * accumulate, event_handlers=handlers)
    assert hand.seen == 50 and ema.updates == 50 // every
    averaged = ema.averaged_state_dict()
    for key, value in hand.average.items():
        torch.testing.assert_close(averaged[key], value, rtol=1e-6, atol=1e-6)
    raw = estimator.net.state_dict()
    assert not torch.allclose(raw["0.weight"], averaged["0.weight"])  # the raw weights trained on
    assert torch.equal(averaged["1.num_batches_tracked"], raw["1.num_batches_tracked"])  # integers: live


def hand_copy(estimator, average):
    net = copy.deepcopy(estimator.net)
    net.load_state_dict({**net.state_dict(), **average})
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.2), device="cpu")


def test_evaluate_and_predict_use_the_average_and_leave_the_raw_weights_as_they_were():
    estimator, train, (X, _) = problem()
    hand, ema = HandAverage(estimator.net, 0.8), EMAHandler(decay=0.8)
    estimator.fit(train, epochs=3, event_handlers=[ema, hand])
    raw = {k: v.clone() for k, v in estimator.net.state_dict().items()}
    reference = hand_copy(estimator, hand.average)
    assert estimator.evaluate(train) == pytest.approx(reference.evaluate(train), rel=1e-6)
    torch.testing.assert_close(estimator.predict(X), reference.predict(X), rtol=1e-6, atol=1e-6)
    streamed = torch.cat(list(estimator.predict_batches(X, batch_size=40)))
    torch.testing.assert_close(streamed, reference.predict(X), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(v, raw[k]) for k, v in estimator.net.state_dict().items())
    ema.evaluate_averaged = False  # the switch: the raw weights
    assert estimator.evaluate(train) == pytest.approx(hand_copy(estimator, raw).evaluate(train), rel=1e-6)
    assert estimator.evaluate(train) != pytest.approx(reference.evaluate(train), rel=1e-6)


def test_the_validation_in_fit_judges_the_average():
    estimator, train, _ = problem()

    class ValueAtEpochEnd(HandAverage):
        def __init__(self, *args):
            super().__init__(*args)
            self.values = []

        def batch_end(self, state):
            super().batch_end(state)
            if state.batch_idx + 1 == state.num_batches:
                self.values.append(hand_copy(state.estimator, self.average).evaluate(train)["val_loss"])

    hand = ValueAtEpochEnd(estimator.net, 0.7)
    history = estimator.fit(train, val_data=train, epochs=3, event_handlers=[EMAHandler(0.7), hand])
    assert history["val_loss"] == pytest.approx(hand.values, rel=1e-6)


def test_buffers_live_evaluates_with_the_trained_running_statistics():
    estimator, train, _ = problem()
    ema = EMAHandler(decay=0.9, buffers="live")
    estimator.fit(train, epochs=2, event_handlers=[ema])
    averaged, raw = ema.averaged_state_dict(), estimator.net.state_dict()
    assert torch.equal(averaged["1.running_mean"], raw["1.running_mean"])
    assert not torch.equal(averaged["0.weight"], raw["0.weight"])


def test_a_non_finite_buffer_stays_live_instead_of_becoming_nan():
    estimator, train, _ = problem(batch_norm=False)
    estimator.net.register_buffer("mask", torch.tensor([0.0, -float("inf")]))
    ema = EMAHandler(decay=0.5)
    estimator.fit(train, epochs=1, event_handlers=[ema])
    assert torch.equal(ema.averaged_state_dict()["mask"], torch.tensor([0.0, -float("inf")]))


def test_the_best_checkpoint_holds_the_average_and_the_regular_ones_the_raw_weights(tmp_path):
    estimator, train, _ = problem()
    hand, ema = HandAverage(estimator.net, 0.8), EMAHandler(decay=0.8)
    saver = CheckpointHandler(tmp_path, monitor="val_loss", save_best=True)
    estimator.fit(train, val_data=train, epochs=2, event_handlers=[ema, hand, saver])
    best = torch.load(saver.best_path, weights_only=True)
    regular = torch.load(saver.saved[-1], weights_only=True)
    raw = estimator.net.state_dict()
    assert best["best"]["epoch"] == 1  # improving each epoch: the last is best, with this average
    for key, value in hand.average.items():
        torch.testing.assert_close(best["model"][key], value, rtol=1e-6, atol=1e-6)
        assert torch.equal(regular["model"][key], raw[key])
        torch.testing.assert_close(regular["handlers"]["EMAHandler"]["averages"][key], value, rtol=1e-6, atol=1e-6)


def test_restore_best_puts_the_best_average_back_into_the_average():
    estimator, train, _ = problem()
    ema = EMAHandler(decay=0.5)
    best = {}

    class KeepBest(BatchEnd):  # the average at the end of epoch 1
        priority = 2

        def batch_end(self, state):
            if state.global_step + 1 == state.num_batches:
                best.update(ema.averaged_state_dict())

    # mode="max" on a falling val_loss: epoch 1 is "best", so its average is the one put back
    stopper = EarlyStoppingHandler(monitor="val_loss", mode="max", patience=5, restore_best=True)
    history = estimator.fit(train, val_data=train, epochs=3, event_handlers=[ema, KeepBest(), stopper])
    assert history["val_loss"][0] == max(history["val_loss"])
    averaged = ema.averaged_state_dict()
    assert all(torch.equal(averaged[k], v) for k, v in best.items() if v.is_floating_point())
    assert not torch.equal(estimator.net.state_dict()["0.weight"], best["0.weight"])  # raw: the last


def test_a_second_fit_continues_the_average_and_a_fit_without_it_evaluates_its_own_weights():
    estimator, train, _ = problem()
    hand, ema = HandAverage(estimator.net, 0.9), EMAHandler(decay=0.9)
    estimator.fit(train, epochs=1, event_handlers=[ema, hand])
    estimator.fit(train, epochs=1, event_handlers=[ema, hand])
    assert ema.updates == 20
    averaged = ema.averaged_state_dict()
    for key, value in hand.average.items():
        torch.testing.assert_close(averaged[key], value, rtol=1e-6, atol=1e-6)
    assert estimator.weight_average is ema
    estimator.fit(train, epochs=1)
    assert estimator.weight_average is None
    assert estimator.evaluate(train) == pytest.approx(hand_copy(estimator, estimator.net.state_dict()).evaluate(train))


def test_no_host_read_per_training_batch():
    def reads(batches):
        estimator, _, (X, y) = problem(n=16 * batches)
        train = DataLoader(TensorDataset(X, y), batch_size=16)
        with HostReadCounter() as counter:
            estimator.fit(train, val_data=train, epochs=1, event_handlers=[EMAHandler()])
        return counter.count

    assert reads(4) == reads(16) > 0


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"decay": 1.0}, FitforgeValueError, "decay must be in [0, 1)"),
        ({"decay": -0.1}, FitforgeValueError, "decay must be in [0, 1)"),
        ({"decay": "0.9"}, FitforgeTypeError, "decay must be a number in [0, 1), got str"),
        ({"every": 0}, FitforgeValueError, "every must be a positive int, got 0"),
        ({"buffers": "mean"}, FitforgeValueError, "buffers must be 'average' or 'live', got 'mean'"),
        ({"evaluate_averaged": 1}, FitforgeTypeError, "evaluate_averaged must be True or False"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        EMAHandler(**kwargs)


def test_an_average_before_any_fit_and_a_checkpoint_of_other_weights_are_refused():
    with pytest.raises(FitforgeValueError, match="no average yet: fit with this handler first"):
        EMAHandler().averaged_state_dict()
    estimator, train, _ = problem()
    ema = EMAHandler()
    estimator.fit(train, epochs=1, event_handlers=[ema])
    state = ema.state_dict()
    state["averages"] = {"other.weight": torch.zeros(1)}
    with pytest.raises(FitforgeValueError, match=re.escape("missing: ['0.weight',")):
        ema.load_state_dict(state)


def run_trainer(folder, out, kill_at=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, str(TRAINER), str(folder), str(out)] + ([str(kill_at)] if kill_at is not None else [])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_kill_9_and_resume_keeps_the_average_bitwise(tmp_path):
    whole = run_trainer(tmp_path / "whole", tmp_path / "whole.pt")
    assert whole.returncode == 0, whole.stderr
    killed = run_trainer(tmp_path / "run", tmp_path / "killed.pt", kill_at=13)  # mid-epoch 2, after a save
    assert killed.returncode == -9, killed.stderr
    resumed = run_trainer(tmp_path / "run", tmp_path / "resumed.pt")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    want, got = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    for part in ("averaged", "raw"):
        assert want[part].keys() == got[part].keys()
        assert all(torch.equal(want[part][k], got[part][k]) for k in want[part]), part
    assert want["updates"] == got["updates"] == 30


def test_under_fsdp_the_average_is_sharded_saved_with_the_shards_and_resumed(tmp_path):
    import torch.distributed as dist

    from fitforge.distributed import fsdp

    if not (dist.is_available() and dist.is_gloo_available() and fsdp.supported()):
        pytest.skip("needs gloo and FSDP2 (fully_shard)")

    def estimator():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.2)
        return Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, device="cpu", strategy="fsdp")

    _, train, _ = problem()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        whole, whole_ema = estimator(), EMAHandler(decay=0.8)
        whole.fit(train, epochs=2, event_handlers=[whole_ema])
        want = {k: v.full_tensor() for k, v in whole_ema.averaged_state_dict().items()}
        assert all(type(a).__name__ == "DTensor" for a in whole_ema.sharded_averages().values())
        averaged_loss = whole.evaluate(train)["val_loss"]
        whole_ema.evaluate_averaged = False
        assert whole.evaluate(train)["val_loss"] != pytest.approx(averaged_loss)  # the raw weights differ
        first, ema = estimator(), EMAHandler(decay=0.8)
        first.fit(train, batches=13, event_handlers=[ema, CheckpointHandler(tmp_path, batch_period=13)])
        assert ema.state_dict()["averages"] == {}  # in the DCP folder, with the weights' shards
        resumed, ema = estimator(), EMAHandler(decay=0.8)
        resumed.fit(train, epochs=2, event_handlers=[ema, CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
        got = {k: v.full_tensor() for k, v in ema.averaged_state_dict().items()}
        assert all(torch.equal(got[k], want[k]) for k in want) and ema.updates == 20
        reference = {k: v.full_tensor() for k, v in whole.net.state_dict().items()}
        assert all(torch.equal(v.full_tensor(), reference[k]) for k, v in resumed.net.state_dict().items())
    finally:
        dist.destroy_process_group()


class HandAverageAtEpochEnd(HandAverage):
    """HandAverage that also looks at epoch end, where a trailing accumulation group steps."""

    def epoch_end(self, state):
        self.batch_end(state)


def test_a_step_at_epoch_end_is_averaged_too():
    from fitforge.events import EpochEnd

    class Hand(HandAverageAtEpochEnd, EpochEnd):
        pass

    estimator, _, (X, y) = problem(n=16 * 23)
    train = DataLoader(TensorDataset(X, y), batch_size=16)  # 23 batches: 5 groups of 4, then one of 3
    hand, ema = Hand(estimator.net, 0.9, every=2), EMAHandler(decay=0.9, every=2)
    estimator.fit(train, epochs=2, event_handlers=[ema, hand, GradientUpdateHandler(accumulate=4)])
    assert hand.seen == 12 and ema.updates == 6
    averaged = ema.averaged_state_dict()
    for key, value in hand.average.items():
        torch.testing.assert_close(averaged[key], value, rtol=1e-6, atol=1e-6)


def test_the_average_of_bfloat16_weights_is_kept_in_float32_and_moves():
    estimator, train, _ = problem(batch_norm=False)
    estimator.net.to(torch.bfloat16)
    estimator.optimizers = [torch.optim.SGD(estimator.net.parameters(), lr=0.2)]
    X, y = train.dataset.tensors
    data = DataLoader(TensorDataset(X.to(torch.bfloat16), y), batch_size=16)
    start = {k: v.float().clone() for k, v in estimator.net.state_dict().items()}
    ema = EMAHandler(decay=0.999)
    estimator.fit(data, epochs=2, event_handlers=[ema])
    assert all(average.dtype == torch.float32 for average in ema._averages)
    moved = [not torch.equal(ema._averages[i], start[name]) for i, name in enumerate(ema._names)]
    assert all(moved)  # in bfloat16, 0.001 * (weight - average) rounds to no change
    assert ema.averaged_state_dict()["0.weight"].dtype == torch.bfloat16  # swapped into the net as its dtype


def test_load_checkpoint_loads_its_average_or_evaluates_the_loaded_weights(tmp_path, caplog):
    estimator, train, _ = problem()
    ema = EMAHandler(decay=0.5)
    estimator.fit(train, epochs=3, event_handlers=[ema, CheckpointHandler(tmp_path, max_checkpoints=3)])
    first = torch.load(tmp_path / "model-epoch1batch10.pt", weights_only=True)
    estimator.load_checkpoint(tmp_path / "model-epoch1batch10.pt")
    expected = hand_copy(estimator, first["handlers"]["EMAHandler"]["averages"]).evaluate(train)
    assert estimator.evaluate(train) == pytest.approx(expected, rel=1e-6)  # epoch 1's average, not epoch 3's
    plain, _, _ = problem()
    plain.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path / "plain")])
    with caplog.at_level("INFO", logger="fitforge"):
        estimator.load_checkpoint(tmp_path / "plain" / "model-epoch1batch10.pt")
    assert "holds no average of the weights" in caplog.text and estimator.weight_average is None
    assert estimator.evaluate(train) == pytest.approx(plain.evaluate(train), rel=1e-6)


def test_two_averaging_handlers_are_refused_before_training():
    estimator, train, _ = problem()
    with pytest.raises(FitforgeValueError, match=r"2 handlers average the weights \(EMAHandler, EMAHandler\)"):
        estimator.fit(train, epochs=1, event_handlers=[EMAHandler(), EMAHandler(0.9)])
