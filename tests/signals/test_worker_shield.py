"""DataLoader workers a fit starts leave preemption signals to the fit's process (issue 36)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

from fitforge import Estimator
from fitforge.signals.worker_shield import ShieldedWorkerInit, shield_worker, shielded, shielding

X = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(1))


class SignalledInWorkers(Dataset):
    """X, Y; each worker, at its first sample, gets SIGTERM, SIGUSR1 and SIGINT from another process
    (the ``kill`` command, as a scheduler signalling the process group), then reads on."""

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int):
        worker = get_worker_info()
        if worker is not None and not getattr(worker.dataset, "signalled", False):
            worker.dataset.signalled = True  # the worker's own copy
            for name in ("TERM", "USR1", "INT"):
                subprocess.run(["kill", "-s", name, str(os.getpid())], check=True)
        return X[i], Y[i]


def init_marks(folder):
    def mark(worker_id: int) -> None:
        (folder / f"worker{worker_id}").touch()

    return mark


def fitted(train, val, epochs=2):
    torch.manual_seed(0)
    estimator = Estimator(nn.Linear(6, 3), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    history = estimator.fit(train, val, epochs=epochs)
    return estimator.net.state_dict(), history


@pytest.mark.integration  # DataLoader workers, signalled by kill
def test_workers_in_training_and_validation_outlive_signals_from_another_process(tmp_path):
    mark = init_marks(tmp_path)
    train = DataLoader(SignalledInWorkers(), batch_size=4, shuffle=True, num_workers=2, worker_init_fn=mark)
    val = DataLoader(SignalledInWorkers(), batch_size=8, num_workers=2)
    weights, history = fitted(train, val)
    plain_weights, plain_history = fitted(
        DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True, num_workers=2), DataLoader(TensorDataset(X, Y), 8)
    )
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)  # every batch trained, none lost
    assert history["val_loss"] == plain_history["val_loss"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker0", "worker1"]  # the loader's own init ran too
    assert train.worker_init_fn is mark and val.worker_init_fn is None  # given back after each start


def _shielded_child(exiting, done, ready) -> None:
    shield_worker(exiting, done)
    ready.set()
    while True:
        time.sleep(0.05)


@pytest.mark.integration  # a forked worker
@pytest.mark.parametrize("release", ["done", "exiting"])
def test_a_shielded_worker_obeys_sigterm_only_once_its_loader_or_the_main_process_lets_it_go(release):
    context = multiprocessing.get_context("fork")
    events = {"exiting": context.Event(), "done": context.Event()}
    ready = context.Event()
    child = context.Process(target=_shielded_child, args=(events["exiting"], events["done"], ready), daemon=True)
    child.start()
    assert ready.wait(10)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # a scheduler's, or this process's
        os.kill(child.pid, signum)
    child.join(0.5)
    assert child.is_alive()
    events[release].set()  # the loader shuts it down, or this process exits
    os.kill(child.pid, signal.SIGTERM)
    child.join(10)
    assert child.exitcode == 0


@pytest.mark.integration  # a fresh interpreter per start method
@pytest.mark.parametrize(
    "start", [("fork", "1"), ("spawn", "0"), ("forkserver", "1", "preload")], ids=lambda a: "-".join(a)
)
def test_shielded_workers_of_every_start_method_train_and_let_the_interpreter_exit(start):
    # Each worker gets SIGTERM, SIGUSR1 and SIGINT from another process at its first sample; persistent
    # workers stay alive to the interpreter's exit, where multiprocessing terminates and joins them.
    script = Path(__file__).with_name("worker_shield_run.py")
    done = subprocess.run([sys.executable, str(script), *start], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["trained", "2", "exits"]
    assert "killed by signal" not in done.stderr


def test_outside_a_fit_a_loader_s_workers_are_its_own():
    loader = DataLoader(TensorDataset(X, Y), batch_size=4, num_workers=2)
    assert shielded(loader) is loader
    with shielding():
        passes = shielded(loader)
        assert isinstance(passes, Iterable) and passes is not loader
        assert shielded([1, 2]) == [1, 2]  # no workers to shield
        in_process = DataLoader(TensorDataset(X, Y), batch_size=4)
        assert shielded(in_process) is in_process
    assert shielded(loader) is loader


def test_the_shielded_init_pickles_for_spawned_workers():
    again = pickle.loads(pickle.dumps(ShieldedWorkerInit(print, None)))
    assert isinstance(again, ShieldedWorkerInit) and again.own is print


@pytest.mark.integration  # a spawned DataLoader worker
def test_a_spawned_worker_is_shielded_too(tmp_path):
    train = DataLoader(
        SignalledInWorkers(), batch_size=8, num_workers=1, multiprocessing_context="spawn", persistent_workers=True
    )
    weights, _ = fitted(train, None, epochs=1)
    plain, _ = fitted(DataLoader(TensorDataset(X, Y), batch_size=8), None, epochs=1)
    assert all(torch.equal(weights[k], plain[k]) for k in weights)


class WaitsForTheSave(Dataset):
    """A validation set read by 2 workers: batch 1 (worker 1's first) waits for a checkpoint to appear
    in ``folder`` and notes whether one did; once it is under way, the first sample (worker 0's) sends
    the fit SIGTERM, so the fit abandons the validation while batch 1 is being read."""

    def __init__(self, folder) -> None:
        self.folder, self.fit = folder, os.getpid()

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        if i == 0 and get_worker_info() is not None:  # not in the check before training
            for _ in range(300):  # workers start slowly on a busy machine
                if (self.folder.parent / "reading").exists():
                    break
                time.sleep(0.05)
            os.kill(self.fit, signal.SIGTERM)
        if i == 4:
            (self.folder.parent / "reading").touch()
            for _ in range(300):
                if any(self.folder.glob("*.pt")):
                    (self.folder.parent / "seen").touch()
                    break
                time.sleep(0.1)
        return X[i], Y[i]


@pytest.mark.integration  # DataLoader workers
@pytest.mark.parametrize("period, saved", [(2, "model-epoch0batch2.pt"), (None, "model-epoch0batch8.pt")])
def test_a_signal_in_a_validation_saves_before_its_workers_are_shut_down(tmp_path, period, saved):
    # Dropping the abandoned validation's iterator shuts its workers down, which waits for the batch
    # each is reading: the save must come first (here a worker's batch waits for the save itself).
    from fitforge.handlers import CheckpointHandler, ValidationHandler

    folder = tmp_path / "checkpoints"
    val = DataLoader(WaitsForTheSave(folder), batch_size=4, num_workers=2)
    estimator = Estimator(nn.Linear(6, 3), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    validation = ValidationHandler(
        val, batch_period=period, epoch_period=None if period else 1
    )  # mid-epoch, or its end
    handlers = [validation, CheckpointHandler(folder)]
    with pytest.raises(SystemExit) as exit_:
        estimator.fit(DataLoader(TensorDataset(X, Y), batch_size=4), epochs=1, event_handlers=handlers)
    assert exit_.value.code == 143
    assert [p.name for p in folder.glob("*.pt")] == [saved]
    assert (tmp_path / "seen").exists()  # the save came while the worker was still reading
