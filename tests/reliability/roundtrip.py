"""State round trip through a mid-epoch checkpoint, run in its own process by test_state_roundtrip.py.

Run A trains with everything stateful (weights, Adam, the GradScaler of precision="16-mixed",
a user handler's LR scheduler, EarlyStoppingHandler, CheckpointHandler's best, MetricHandler's
sums, history, the python/numpy/torch generators, the counters, the data order) and stops at
the batch_begin right after the checkpoint of 12 batches (4 batches into epoch 2), taking a
snapshot of every component there. Run B builds everything afresh with other seeds (every
component perturbed), resumes from that file and takes the same snapshot at its first
batch_begin. Prints one JSON line: component -> {"perturbed": B before the load differs from
A's snapshot, "restored": B after the load equals it}.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchBegin, EpochEnd, TrainBegin
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, MetricHandler

STEP = 12  # batch_period=3 writes the checkpoint of 12 completed batches; 8 batches an epoch


class Stop(Exception):
    """Ends a run once its snapshot is taken."""


class Scheduler(EpochEnd):
    """A user handler with state: steps an LR scheduler at every epoch end."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def epoch_end(self, state) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


class Probe(TrainBegin, BatchBegin):
    """Snapshots at train_begin (priority 800: before CheckpointHandler, 900, loads anything) and
    at batch_begin: at step ``at``, or at the run's first batch when ``at`` is None (a resume that
    lost the counters must not meet the snapshot's step by chance)."""

    priority = 800

    def __init__(self, parts: dict, at: int | None) -> None:
        self.parts, self.at, self.snapshots = parts, at, {}

    def train_begin(self, state) -> None:
        self.snapshots["before"] = snapshot(state, self.parts)

    def batch_begin(self, state) -> None:
        if self.at is None or state.global_step == self.at:
            self.snapshots["at"] = snapshot(state, self.parts)
            raise Stop


def snapshot(state, parts: dict) -> dict:
    estimator = state.estimator
    return copy.deepcopy(
        {
            "weights": estimator.net.state_dict(),
            "adam": estimator.optimizer.state_dict(),
            "grad_scaler": estimator.scaler.state_dict(),
            "lr_scheduler (user handler)": parts["scheduler"].state_dict(),
            "early_stopping": parts["early_stopping"].state_dict(),
            "checkpoint_best": parts["saver"].best,
            "metric_sums": parts["metrics"].state_dict(),
            "history": state.history.state_dict(),
            "rng_python": random.getstate(),
            "rng_numpy": np.random.get_state(),
            "rng_torch": torch.get_rng_state(),
            "counters": {
                "epoch": state.epoch,
                "global_step": state.global_step,
                "batch_idx": state.batch_idx,
                "optimizer_steps": state.optimizer_steps,
            },
            "data_order_seed": state._loop.data.seed,
            "next_batch": state.batch,
        }
    )


def same(a, b) -> bool:
    """Bitwise equal, recursively (tensors by dtype, shape and values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def run(folder: Path, seed: int, at: int | None) -> dict:
    """A fit whose generators and initial weights come from ``seed``; its Probe's snapshots."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(1234)  # the same data in both runs
    x, y = torch.randn(64, 10, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    # precision="16-mixed" on the CPU: float16 autocast and a GradScaler("cpu"), whose state checkpoints keep.
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), train_metrics="accuracy", optimizer=optimizer, device="cpu", precision="16-mixed"
    )
    parts = {
        "scheduler": Scheduler(optimizer),
        "early_stopping": EarlyStoppingHandler("train_loss", patience=10),
        "metrics": MetricHandler(),
        "saver": CheckpointHandler(
            folder, monitor="train_loss", save_best=True, batch_period=3, resume_from_checkpoint=True
        ),
    }
    probe = Probe(parts, at)
    with contextlib.suppress(Stop):
        estimator.fit(data, epochs=3, event_handlers=[*parts.values(), probe])
    assert "at" in probe.snapshots, "the run ended before its snapshot"
    return probe.snapshots


def main() -> None:
    folder = Path(sys.argv[1])
    saved = run(folder, seed=0, at=STEP)["at"]  # A: stops right after the checkpoint of STEP batches
    assert (folder / f"model-epoch1batch{STEP}.pt").is_file()
    resumed = run(folder, seed=999, at=None)  # B: everything fresh from other seeds, then resumed
    report = {
        name: {"perturbed": not same(resumed["before"][name], value), "restored": same(resumed["at"][name], value)}
        for name, value in saved.items()
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
