"""A signal during a validation abandons it at its next batch: the checkpoint holds the state of the
last training batch, the resumed run redoes the validation where it was due and ends bitwise as
the uninterrupted run; SIGUSR1 requeues a SLURM job; a signal during the checks before training
stops the fit before its first batch. (In one process; the reliability suite times them in real
processes, and under torchrun.)"""

import math
import os
import signal
import stat

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from fitforge import Estimator
from fitforge.core.events import Stage
from fitforge.events import BatchBegin, EpochEnd
from fitforge.handlers import CheckpointHandler, ValidationHandler
from helpers import checkpoint_files

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)  # 6 batches of 8


class ValSet(Dataset):
    """32 validation samples (4 batches of 8). Each read draws from torch's global generator, as a
    random augmentation would; once armed, its ``reads``-th read sends ``signum`` to this process."""

    def __init__(self):
        self.signum, self.reads = None, None
        self.sent = False

    def __len__(self):
        return 32

    def __getitem__(self, i):
        torch.rand(())
        if self.reads is not None:
            self.reads -= 1
            if self.reads == 0:
                self.sent = True
                os.kill(os.getpid(), self.signum)
        return X[i], Y[i]


class Arm(BatchBegin, EpochEnd):
    """Arms the validation set at batch_begin of step ``at`` (its validations read after), or at
    ``epoch_end`` before the validation (``at="epoch_end:<batches>"``), for its ``after_reads``-th read."""

    priority = Stage.METRICS - 1

    def __init__(self, val, signum, at, after_reads=10):
        self.val, self.signum, self.at, self.after_reads = val, signum, at, after_reads

    def _arm(self):
        self.val.signum, self.val.reads = self.signum, self.after_reads

    def batch_begin(self, state):
        if state.global_step == self.at:
            self._arm()

    def epoch_end(self, state):
        if self.at == f"epoch_end:{state.global_step}":
            self._arm()


def train(folder, extra=(), resume=False, seed=0, val=None, batch_period=4):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device="cpu"
    )
    val = ValSet() if val is None else val
    handlers = [
        ValidationHandler(DataLoader(val, batch_size=8), batch_period=batch_period),
        CheckpointHandler(folder, epoch_period=3, resume_from_checkpoint=resume),
        *extra,
    ]
    history = estimator.fit(
        DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True), epochs=3, event_handlers=handlers
    )
    return net.state_dict(), history


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return train(tmp_path_factory.mktemp("whole"))


def saved(folder):
    """The regular checkpoints, by name."""
    return sorted(path.name for path in folder.glob("model-epoch*.pt"))


def assert_resumes_exactly(folder, whole, seed=123):
    """``seed``: another than the whole run's, to show that the checkpoint's generators are restored."""
    weights, history = train(folder, seed=seed, resume=True)
    assert all(torch.equal(weights[k], whole[0][k]) for k in whole[0])
    assert history["val_loss"] == whole[1]["val_loss"] and history["train_loss"] == whole[1]["train_loss"]


def test_a_signal_during_a_batch_period_validation_saves_that_batch_and_the_resume_redoes_it(tmp_path, whole):
    val = ValSet()
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path, extra=[Arm(val, signal.SIGTERM, at=7)], val=val)  # the validation after 8 batches
    assert exit_.value.code == 143 and val.sent
    assert val.reads < 0 and val.reads > -8  # it stopped in the batch after the signal: at most 8 more reads
    assert saved(tmp_path) == ["model-epoch1batch8.pt"]
    checkpoint = torch.load(tmp_path / "model-epoch1batch8.pt", weights_only=True)
    assert checkpoint["handlers"]["ValidationHandler"] == {"validated_at": 4, "owed": 8}
    assert math.isnan(checkpoint["history"]["columns"]["val_loss"][1])  # nothing of the abandoned one recorded
    assert_resumes_exactly(tmp_path, whole)


def test_a_signal_during_an_epoch_end_validation_saves_before_that_epoch_end(tmp_path, whole):
    val = ValSet()
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path, extra=[Arm(val, signal.SIGTERM, at="epoch_end:6")], val=val, batch_period=None)
    assert exit_.value.code == 143 and val.sent
    assert saved(tmp_path) == ["model-epoch0batch6.pt"]  # the epoch is not over: its end is the resumed run's
    assert torch.load(tmp_path / "model-epoch0batch6.pt", weights_only=True)["position"] == 6
    weights, history = train(tmp_path, seed=123, resume=True, batch_period=None)
    reference = train(tmp_path / "reference", batch_period=None)
    assert all(torch.equal(weights[k], reference[0][k]) for k in weights)
    assert history["val_loss"] == reference[1]["val_loss"]


def test_a_signal_in_the_last_batch_leaves_the_epoch_end_to_the_resumed_run(tmp_path, whole):
    val = ValSet()
    arm = Arm(val, signal.SIGTERM, at=5, after_reads=None)
    arm.batch_begin = lambda state: os.kill(os.getpid(), signal.SIGTERM) if state.global_step == 5 else None
    with pytest.raises(SystemExit):
        train(tmp_path, extra=[arm], val=val)
    assert saved(tmp_path) == ["model-epoch0batch6.pt"]  # no validation ran at the epoch's end
    assert_resumes_exactly(tmp_path, whole)


def fake_scontrol(folder, status=0):
    """An ``scontrol`` that writes its arguments to ``folder/called`` and exits with ``status``."""
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" > {folder / "called"}\nexit {status}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder / "called"


@pytest.mark.parametrize(
    "slurm",
    [
        pytest.param("requeued", marks=pytest.mark.integration),  # runs the stand-in scontrol
        pytest.param("requeue fails", marks=pytest.mark.integration),
        "no scontrol",
        "no slurm",
    ],
)
def test_sigusr1_saves_then_requeues_a_slurm_job_or_exits_138(tmp_path, monkeypatch, whole, slurm, caplog):
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    called = fake_scontrol(bin_folder, status=1 if slurm == "requeue fails" else 0)
    scontrol_there = slurm in ("requeued", "requeue fails")
    monkeypatch.setenv("PATH", f"{bin_folder}{os.pathsep}{os.environ['PATH']}" if scontrol_there else "/nonexistent")
    if slurm == "no slurm":
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    else:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
    val = ValSet()
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path / "run", extra=[Arm(val, signal.SIGUSR1, at=7)], val=val)
    assert exit_.value.code == (0 if slurm == "requeued" else 138)
    assert (called.read_text().split() if called.exists() else None) == (
        ["requeue", "4242"] if scontrol_there else None
    )
    if slurm in ("requeue fails", "no scontrol"):
        assert "not requeued" in caplog.text
    assert saved(tmp_path / "run") == ["model-epoch1batch8.pt"]
    monkeypatch.undo()
    assert_resumes_exactly(tmp_path / "run", whole)


@pytest.mark.parametrize("resumed", [False, True])
def test_a_signal_during_the_checks_before_training_stops_before_the_first_batch(tmp_path, whole, resumed):
    if resumed:
        val = ValSet()
        with pytest.raises(SystemExit):
            train(tmp_path, extra=[Arm(val, signal.SIGTERM, at=7)], val=val)
    before = {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)}
    val = ValSet()
    val.signum, val.reads = signal.SIGTERM, 2  # the check before training reads the first samples
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path, resume=True, val=val)
    assert exit_.value.code == 143 and val.sent
    # Nothing to save: the resumed state is on disk already (a fresh run has none).
    assert {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)} == before
    assert_resumes_exactly(tmp_path, whole, seed=123 if resumed else 0)
