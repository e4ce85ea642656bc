"""SIGTERM/SIGINT during fit: stop at the next batch boundary, save, run train_end, then exit 143 or
raise KeyboardInterrupt; resuming loses no step."""

import os
import signal
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchBegin, BatchEnd, EpochEnd, TrainEnd
from fitforge.handlers import (
    CheckpointHandler,
    EarlyStoppingHandler,
    GradientUpdateHandler,
)

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)  # 6 batches of 8


class Signal(BatchBegin, EpochEnd, TrainEnd):
    """Send ``signum`` to this process (``times`` times) at batch_begin of step ``at``, or at the
    epoch end reached after ``at`` batches (after CheckpointHandler's epoch_end); records train_end."""

    priority = 950

    def __init__(self, signum, at, where="batch", times=1):
        self.signum, self.at, self.where, self.times = signum, at, where, times
        self.fired = self.ended = False
        self.steps_done = None

    def _send(self, state):
        self.fired, self.steps_done = True, state.global_step + (self.where == "batch")
        for _ in range(self.times):
            os.kill(os.getpid(), self.signum)

    def batch_begin(self, state):
        if self.where == "batch" and state.global_step == self.at:
            self._send(state)

    def epoch_end(self, state):
        if self.where == "epoch_end" and state.global_step == self.at:
            self._send(state)

    def train_end(self, state):
        self.ended = True


def train(folder, seed=0, resume=False, extra=(), epochs=4, accumulate=1, checkpoint=True, validate=False):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device="cpu"
    )
    data = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    handlers = [GradientUpdateHandler(accumulate=accumulate), *extra]
    if checkpoint:
        handlers.append(CheckpointHandler(folder, epoch_period=2, resume_from_checkpoint=resume))
    # A validation loader without a generator draws a worker seed from torch's global generator.
    val = DataLoader(TensorDataset(X[:16], Y[:16]), batch_size=8) if validate else None
    history = estimator.fit(data, val_data=val, epochs=epochs, event_handlers=handlers)
    return net.state_dict(), history


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return train(tmp_path_factory.mktemp("whole"))


def assert_resumes_exactly(folder, whole, **kwargs):
    weights, history = train(folder, seed=123, resume=True, **kwargs)
    assert all(torch.equal(weights[k], whole[0][k]) for k in whole[0])
    assert history["train_loss"] == whole[1]["train_loss"]


def newest_step(folder):
    return max(int(p.stem.split("batch")[1]) for p in folder.glob("model-epoch*.pt"))


@pytest.mark.parametrize("where, at", [("batch", 3), ("batch", 8), ("epoch_end", 6)])
def test_sigterm_saves_at_the_next_batch_boundary_and_exits_143(tmp_path, whole, where, at):
    before = signal.getsignal(signal.SIGTERM)
    sender = Signal(signal.SIGTERM, at, where)
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path, extra=[sender])
    assert exit_.value.code == 143 and sender.fired and sender.ended  # train_end ran before the exit
    assert newest_step(tmp_path) == sender.steps_done  # 0 steps lost, whatever epoch_period=2 says
    assert signal.getsignal(signal.SIGTERM) is before
    assert_resumes_exactly(tmp_path, whole)


def test_sigint_raises_keyboard_interrupt_after_saving(tmp_path, whole):
    sender = Signal(signal.SIGINT, 9)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, extra=[sender])
    assert sender.fired and sender.ended and newest_step(tmp_path) == 10
    assert_resumes_exactly(tmp_path, whole)


def test_a_preempted_accumulation_group_waits_for_the_resume(tmp_path, tmp_path_factory):
    whole = train(tmp_path_factory.mktemp("whole"), accumulate=4)
    with pytest.raises(SystemExit):
        train(tmp_path, extra=[Signal(signal.SIGTERM, 2)], accumulate=4)  # 3 batches into a group of 4
    saved = torch.load(tmp_path / "model-epoch0batch3.pt", weights_only=True)
    assert saved["accumulated_batches"] == 3 and saved["optimizer_steps"] == 0 and saved["grads"]
    assert_resumes_exactly(tmp_path, whole, accumulate=4)


def test_restore_best_leaves_a_preempted_run_as_it_is(tmp_path):
    stopper = EarlyStoppingHandler("train_loss", restore_best=True, patience=5)
    torch.manual_seed(0)
    with pytest.raises(SystemExit):
        train(tmp_path, extra=[stopper, Signal(signal.SIGTERM, 8)])
    saved = torch.load(tmp_path / "model-epoch1batch9.pt", weights_only=True)
    assert saved["handlers"]["EarlyStoppingHandler"]["best_weights"] is not None  # kept for the resumed run


def test_without_a_checkpoint_handler_fit_still_stops_cleanly(tmp_path):
    sender = Signal(signal.SIGTERM, 3)
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path, extra=[sender], checkpoint=False)
    assert exit_.value.code == 143 and sender.ended and not list(tmp_path.iterdir())


def test_a_second_signal_acts_at_once(tmp_path):
    sender = Signal(signal.SIGTERM, 3, times=2)
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path, extra=[sender])
    assert exit_.value.code == 143 and sender.ended
    assert not list(tmp_path.glob("model-epoch*.pt"))  # no batch boundary was reached: nothing saved


def test_fit_in_another_thread_leaves_signals_alone(tmp_path):
    class Probe(BatchEnd):
        def batch_end(self, state):
            self.handler = signal.getsignal(signal.SIGTERM)

    probe, before = Probe(), signal.getsignal(signal.SIGTERM)
    worker = threading.Thread(target=train, args=(tmp_path,), kwargs={"extra": [probe], "epochs": 1})
    worker.start()
    worker.join()
    assert probe.handler is before


def test_a_preempted_partial_epoch_is_saved_before_its_epoch_end_handlers_run(tmp_path, tmp_path_factory):
    whole = train(tmp_path_factory.mktemp("whole"), validate=True)
    with pytest.raises(SystemExit):
        train(tmp_path, extra=[Signal(signal.SIGTERM, 8)], validate=True)
    weights, history = train(tmp_path, seed=123, resume=True, validate=True)
    assert all(torch.equal(weights[k], whole[0][k]) for k in whole[0])
    assert history["val_loss"] == whole[1]["val_loss"]  # the partial epoch was not validated
