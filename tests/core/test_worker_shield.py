"""DataLoader workers a fit starts leave preemption signals to the fit's process (issue 36)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

from fitforge import Estimator
from fitforge.core.worker_shield import ShieldedWorkerInit, shielded, shielding

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


def test_a_sigterm_from_the_fit_s_own_process_still_ends_a_worker():
    import multiprocessing
    import time

    from fitforge.events import BatchBegin

    class KillWorker(BatchBegin):  # as the loader's shutdown of a stuck worker does
        def batch_begin(self, state):
            if state.global_step == 1:
                # Killed while it holds the lock of the loader's done event (for a moment, when it checks
                # the event), the worker would leave the loader waiting on it for ever: kill it once it
                # has prefetched and waits for indices, holding no lock the loader takes.
                time.sleep(0.3)
                for child in multiprocessing.active_children():
                    os.kill(child.pid, signal.SIGTERM)
                    child.join(10)
                    assert child.exitcode == 0  # torch's worker exits so on its parent's SIGTERM

    torch.manual_seed(0)
    estimator = Estimator(nn.Linear(6, 3), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    data = DataLoader(TensorDataset(X, Y), batch_size=2, num_workers=1)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"):
        estimator.fit(data, epochs=1, event_handlers=[KillWorker()])


def test_outside_a_fit_a_loader_s_workers_are_its_own():
    loader = DataLoader(TensorDataset(X, Y), batch_size=4, num_workers=2)
    assert shielded(loader) is loader
    with shielding():
        passes = shielded(loader)
        assert passes is not loader and shielded(DataLoader(TensorDataset(X, Y))) is not None
        assert shielded([1, 2]) == [1, 2]  # no workers to shield
        in_process = DataLoader(TensorDataset(X, Y), batch_size=4)
        assert shielded(in_process) is in_process
    assert shielded(loader) is loader


def test_the_shielded_init_pickles_for_spawned_workers():
    again = pickle.loads(pickle.dumps(ShieldedWorkerInit(None)))
    assert isinstance(again, ShieldedWorkerInit) and again.own is None


def test_a_spawned_worker_is_shielded_too(tmp_path):
    train = DataLoader(
        SignalledInWorkers(), batch_size=8, num_workers=1, multiprocessing_context="spawn", persistent_workers=True
    )
    weights, _ = fitted(train, None, epochs=1)
    plain, _ = fitted(DataLoader(TensorDataset(X, Y), batch_size=8), None, epochs=1)
    assert all(torch.equal(weights[k], plain[k]) for k in weights)
